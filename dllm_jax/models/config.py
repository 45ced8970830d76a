"""Model configuration: one frozen dataclass for the LLaMA / Qwen2 / LLaDA / Dream family.

The same `ModelConfig` builds an autoregressive model (LLaMA-3, Qwen2.5), a masked
diffusion model (LLaDA, Dream) or a block-causal D2F student: the architecture is shared
and the attention pattern is chosen per call, by data (see `masks.py`).

Presets go from `tiny` (tests, milliseconds per step on a CPU) to the real published shapes,
which are meant to be built with `jax.eval_shape` or loaded from a checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# The module imports no JAX (a config file, and so a config typo on the command line, loads
# without it); dtype names become jnp dtypes when a model asks for them.
DTYPE_NAMES = ("bfloat16", "float16", "float32")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


def check_dtype(name: str) -> str:
  """`name` if it names a dtype the models take, else an error that lists the valid names."""
  if name not in DTYPE_NAMES:
    raise ValueError(f"Unknown dtype {name!r}; use one of {list(DTYPE_NAMES)}.")
  return name


def resolve_dtype(name: str) -> Any:
  """Maps a dtype name to a jnp dtype, with an error that lists the valid names."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return getattr(jnp, check_dtype(name))


# Logit of ids >= active_vocab_size: finite, so a loss against a teacher's zero probability
# there gives 0 * (-1e9) = 0 rather than 0 * -inf = nan; softmax still gives exactly 0.
ACTIVE_VOCAB_FLOOR = -1e9


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder-only transformer.

  Attributes:
    vocab_size: number of token ids (including special ids such as [MASK]).
    active_vocab_size: if set, ids >= it get the logit ACTIVE_VOCAB_FLOOR, so no decoder
      proposes them and no loss gives them mass: the rows that pad a vocabulary past its
      tokenizer's ids (for sharding or alignment) can then never be emitted. None: all ids.
    d_model: residual width D.
    n_layers: number of transformer blocks.
    n_heads: query heads H.
    n_kv_heads: key/value heads K (grouped-query attention when K < H).
    head_dim: per-head width; defaults to d_model // n_heads.
    mlp_dim: SwiGLU hidden width F.
    max_seq_len: longest sequence (prompt + answer) a forward or cache may hold.
    rope_theta: RoPE base frequency.
    norm_eps: RMSNorm epsilon.
    qkv_bias: q/k/v projections carry a bias (Qwen2, Dream).
    tie_embeddings: the head reuses the token embedding matrix.
    shift_logits: Dream's convention: the prediction for position i is read from the
      output at i - 1 (the model was initialised from an AR model). Applied inside a call.
    param_dtype: dtype the parameters are stored in.
    dtype: compute dtype of matmuls; softmax, norms and logits are float32.
    scan_layers: run the blocks with `lax.scan` (fast compile); False unrolls the same
      scanned parameter tree (same checkpoints either way).
    remat_policy: one of REMAT_POLICIES, applied per block when training.
    lora_rank: rank of LoRA adapters on q/k/v/o (0 = no adapters).
    lora_alpha: LoRA scale numerator (scale = alpha / rank).
    lora_dropout: dropout on the adapter input while training.
    mask_token_id / eos_token_id / eot_token_id / pad_token_id / bos_token_id: special ids
      read from the checkpoint or tokenizer; None when the model has no such token.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  mlp_dim: int
  head_dim: int | None = None
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  qkv_bias: bool = False
  tie_embeddings: bool = False
  shift_logits: bool = False
  param_dtype: str = "float32"
  dtype: str = "float32"
  scan_layers: bool = True
  remat_policy: str = "none"
  lora_rank: int = 0
  lora_alpha: float = 0.0
  lora_dropout: float = 0.0
  mask_token_id: int | None = None
  eos_token_id: int | None = None
  eot_token_id: int | None = None
  pad_token_id: int | None = None
  bos_token_id: int | None = None
  name: str = "custom"
  active_vocab_size: int | None = None

  def __post_init__(self):
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                  "mlp_dim", "max_seq_len"):
      if getattr(self, field) <= 0:
        raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
          "for grouped-query attention.")
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
          f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
          "set head_dim explicitly.")
    if self.resolved_head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.resolved_head_dim}.")
    check_dtype(self.param_dtype)
    check_dtype(self.dtype)
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(
          f"Unknown remat_policy {self.remat_policy!r}; use one of {REMAT_POLICIES}.")
    if self.lora_rank < 0:
      raise ValueError(f"lora_rank must be >= 0, got {self.lora_rank}.")
    if not 0.0 <= self.lora_dropout < 1.0:
      raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}.")
    n = self.active_vocab_size
    if n is not None and (isinstance(n, bool) or not 0 < n <= self.vocab_size):
      raise ValueError(f"ModelConfig.active_vocab_size={n!r} must lie in (0, vocab_size="
                       f"{self.vocab_size}]; use None for the whole vocabulary.")
    for field in ("eos_token_id", "eot_token_id"):
      value = getattr(self, field)
      if n is not None and value is not None and value >= n:
        raise ValueError(f"ModelConfig.{field}={value} is >= active_vocab_size={n}: the model "
                         "could never stop. Raise active_vocab_size above every stop id.")
    for field in ("mask_token_id", "eos_token_id", "eot_token_id", "pad_token_id",
                  "bos_token_id"):
      value = getattr(self, field)
      if value is not None and not 0 <= value < self.vocab_size:
        raise ValueError(
            f"ModelConfig.{field}={value} is outside the vocabulary [0, {self.vocab_size}).")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

  @property
  def jnp_dtype(self):
    return resolve_dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return resolve_dtype(self.param_dtype)

  @property
  def lora_scale(self) -> float:
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  def replace(self, **changes) -> "ModelConfig":
    """Returns a copy with `changes`; unknown field names raise a clear error."""
    fields = {f.name for f in dataclasses.fields(self)}
    unknown = sorted(set(changes) - fields)
    if unknown:
      raise ValueError(f"Unknown ModelConfig field(s) {unknown}; valid fields: {sorted(fields)}.")
    return dataclasses.replace(self, **changes)

  def num_params(self, include_embeddings: bool = True) -> int:
    """Parameter count implied by the shapes (LoRA adapters excluded)."""
    d, h, k, hd, f, v = (self.d_model, self.n_heads, self.n_kv_heads,
                         self.resolved_head_dim, self.mlp_dim, self.vocab_size)
    attn = d * h * hd * 2 + d * k * hd * 2
    if self.qkv_bias:
      attn += h * hd + 2 * k * hd
    per_layer = attn + 3 * d * f + 2 * d
    total = self.n_layers * per_layer + d
    if include_embeddings:
      total += v * d * (1 if self.tie_embeddings else 2)
    return total


# Published shapes. Special ids follow each checkpoint's config / tokenizer.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        mlp_dim=64, max_seq_len=128, mask_token_id=3, eos_token_id=2, pad_token_id=0,
        bos_token_id=1),
    "small": ModelConfig(
        name="small", vocab_size=260, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4,
        mlp_dim=512, max_seq_len=512, mask_token_id=3, eos_token_id=2, pad_token_id=0,
        bos_token_id=1),
    "base_100m": ModelConfig(
        name="base_100m", vocab_size=260, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
        mlp_dim=2304, max_seq_len=2048, mask_token_id=3, eos_token_id=2, pad_token_id=0,
        bos_token_id=1),
    "base_1b": ModelConfig(
        name="base_1b", vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8,
        mlp_dim=8192, max_seq_len=4096, rope_theta=500000.0, mask_token_id=3, eos_token_id=2,
        pad_token_id=0, bos_token_id=1, param_dtype="bfloat16", dtype="bfloat16"),
    "llada_8b": ModelConfig(
        name="llada_8b", vocab_size=126464, d_model=4096, n_layers=32, n_heads=32,
        n_kv_heads=32, mlp_dim=12288, max_seq_len=4096, rope_theta=500000.0, norm_eps=1e-5,
        mask_token_id=126336, eos_token_id=126081, eot_token_id=126348, pad_token_id=126081,
        bos_token_id=126080, param_dtype="bfloat16", dtype="bfloat16"),
    "dream_7b": ModelConfig(
        name="dream_7b", vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
        n_kv_heads=4, mlp_dim=18944, max_seq_len=32768, rope_theta=1000000.0, norm_eps=1e-6,
        qkv_bias=True, shift_logits=True, mask_token_id=151666, eos_token_id=151643,
        pad_token_id=151643, bos_token_id=151665, param_dtype="bfloat16", dtype="bfloat16"),
    "llama3_8b": ModelConfig(
        name="llama3_8b", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
        n_kv_heads=8, mlp_dim=14336, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
        eos_token_id=128009, bos_token_id=128000, pad_token_id=128009,
        param_dtype="bfloat16", dtype="bfloat16"),
    "qwen2_5_7b": ModelConfig(
        name="qwen2_5_7b", vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
        n_kv_heads=4, mlp_dim=18944, max_seq_len=32768, rope_theta=1000000.0, norm_eps=1e-6,
        qkv_bias=True, eos_token_id=151645, pad_token_id=151643,
        param_dtype="bfloat16", dtype="bfloat16"),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """Returns a named preset, optionally with fields overridden."""
  if name not in PRESETS:
    raise ValueError(f"Unknown model preset {name!r}; available: {sorted(PRESETS)}.")
  cfg = PRESETS[name]
  return cfg.replace(**overrides) if overrides else cfg
