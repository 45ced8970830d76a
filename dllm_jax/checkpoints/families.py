"""Checkpoint families: how a HF `config.json` and tensor names map onto dllm_jax.

Four families share one network (`dllm_jax.models.Transformer`):

  llama   LlamaForCausalLM   `model.layers.{i}.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`
  qwen2   Qwen2ForCausalLM   llama names + q/k/v biases
  dream   DreamModel         qwen2 names, bidirectional, logits shifted right by one
  llada   LLaDAModelLM       `model.transformer.{wte, blocks.{i}.{attn_norm, q_proj, k_proj,
                             v_proj, attn_out, ff_norm, ff_proj (gate), up_proj, ff_out (down)},
                             ln_f, ff_out (head)}`, OLMo-style config keys

HF linear weights are [out, in]; our kernels are [in, out]: every `kernel` leaf is a transpose,
every other leaf (embedding, norm scales, biases) is copied as is. Layer leaves are stacked
along a leading axis L. A family also writes its own `config.json` back (export).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from dllm_jax.models.config import ModelConfig

Path_ = tuple[str, ...]

# Our projection name -> its leaf path prefix inside `layers`.
PROJECTIONS: dict[str, Path_] = {
    "q": ("attn", "q"), "k": ("attn", "k"), "v": ("attn", "v"), "o": ("attn", "o"),
    "gate": ("mlp", "gate"), "up": ("mlp", "up"), "down": ("mlp", "down")}
LORA_PROJECTIONS = ("q", "k", "v", "o")  # where the model has LoRA adapters


@dataclasses.dataclass(frozen=True)
class Family:
  """Name maps and config translation of one checkpoint family."""
  name: str
  model_types: tuple[str, ...]
  architectures: tuple[str, ...]
  layer_prefix: str                     # e.g. "model.layers.{i}."
  layer_names: dict[Path_, str]         # leaf path inside `layers` -> name after the prefix
  global_names: dict[Path_, str]        # top-level leaf path -> full name
  parse_config: Callable[[dict, dict[str, tuple[int, ...]]], dict]
  export_config: Callable[[ModelConfig], dict]
  ignorable: tuple[str, ...] = ()       # regexes of stored buffers that are not parameters
  # config.json keys that decide which tensors exist (named in loading errors)
  tying_key: str = "tie_word_embeddings"
  layers_key: str = "num_hidden_layers"
  bias_key: str = "attention_bias"

  def hf_name(self, path: Path_, layer: int | None = None) -> str:
    """HF tensor name of our leaf `path` (in layer `layer` for stacked leaves)."""
    if path[0] == "layers":
      if path[1:] not in self.layer_names:
        raise ValueError(f"the {self.name} family has no tensor for parameter {path}.")
      return self.layer_prefix.format(i=layer) + self.layer_names[path[1:]]
    if path not in self.global_names:
      raise ValueError(f"the {self.name} family has no tensor for parameter {path}.")
    return self.global_names[path]

  def module_name(self, projection: str, layer: int) -> str:
    """Full HF module name of a projection (`q`, ..., `down`), as PEFT addresses it."""
    leaf = self.layer_names[PROJECTIONS[projection] + ("kernel",)]
    return self.layer_prefix.format(i=layer) + leaf.removesuffix(".weight")

  def is_ignorable(self, name: str) -> bool:
    return any(re.search(p, name) for p in self.ignorable)


def _get(config: dict, key: str, family: str, default=None):
  value = config.get(key, default)
  if value is None:
    raise ValueError(f"config.json has no {key!r}, which a {family} checkpoint needs.")
  return value


def _expect(config: dict, key: str, allowed, family: str, default=None):
  value = config.get(key, default)
  if value not in allowed:
    found = f"sets {key}={value!r}" if key in config else f"does not set {key!r}"
    raise ValueError(
        f"config.json {found}; the {family} loader supports only {allowed!r} "
        "(dllm_jax implements RMSNorm + RoPE + SwiGLU pre-norm blocks).")


def _rope_theta(config: dict, default: float) -> float:
  params = config.get("rope_parameters") or config.get("rope_scaling") or {}
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type != "default":
    raise ValueError(
        f"config.json uses RoPE scaling {rope_type!r}; dllm_jax implements plain RoPE only. "
        "Use a checkpoint without rope scaling or drop it if you stay within the original window.")
  return float(params.get("rope_theta") or config.get("rope_theta") or default)


def _qwen_like(config: dict, shapes: dict, *, family: str, qkv_bias: bool,
               default_max_len: int) -> dict:
  del shapes
  _expect(config, "hidden_act", ("silu",), family, "silu")
  d = int(_get(config, "hidden_size", family))
  heads = int(_get(config, "num_attention_heads", family))
  return dict(
      vocab_size=int(_get(config, "vocab_size", family)), d_model=d,
      n_layers=int(_get(config, "num_hidden_layers", family)), n_heads=heads,
      n_kv_heads=int(config.get("num_key_value_heads") or heads),
      head_dim=int(config.get("head_dim") or d // heads),
      mlp_dim=int(_get(config, "intermediate_size", family)),
      max_seq_len=int(config.get("max_position_embeddings") or default_max_len),
      rope_theta=_rope_theta(config, 10000.0), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
      qkv_bias=qkv_bias, tie_embeddings=bool(config.get("tie_word_embeddings", False)))


def _parse_llama(config: dict, shapes: dict) -> dict:
  for key in ("attention_bias", "mlp_bias"):
    _expect(config, key, (False, None), "llama")
  return _qwen_like(config, shapes, family="llama", qkv_bias=False, default_max_len=2048)


def _parse_qwen2(config: dict, shapes: dict, family: str = "qwen2") -> dict:
  _expect(config, "use_sliding_window", (False, None), family)
  return _qwen_like(config, shapes, family=family, qkv_bias=True, default_max_len=32768)


def _parse_dream(config: dict, shapes: dict) -> dict:
  return dict(_parse_qwen2(config, shapes, "dream"), shift_logits=True)


_LLADA_FIXED = (("alibi", (False, None)), ("rope", (True,)), ("block_type", ("llama",)),
                ("layer_norm_type", ("rms",)), ("activation_type", ("silu",)),
                ("attention_layer_norm", (False, None)), ("scale_logits", (False, None)),
                ("input_emb_norm", (False, None)), ("include_bias", (False, None)),
                ("bias_for_layer_norm", (False, None)), ("clip_qkv", (None,)),
                ("block_group_size", (1, None)), ("multi_query_attention", (False, None)))


def _parse_llada(config: dict, shapes: dict) -> dict:
  for key, allowed in _LLADA_FIXED:
    _expect(config, key, allowed, "llada")
  d = int(_get(config, "d_model", "llada"))
  heads = int(_get(config, "n_heads", "llada"))
  mlp = config.get("mlp_hidden_size") or int(_get(config, "mlp_ratio", "llada")) * d
  # The embedding may be padded past `vocab_size` (`embedding_size`): the weight decides.
  wte = "model.transformer.wte.weight"
  declared = int(config.get("embedding_size") or _get(config, "vocab_size", "llada"))
  rows = shapes[wte][0] if wte in shapes else declared
  if rows != declared:
    raise ValueError(f"{wte} has {rows} rows but config.json declares embedding_size/"
                     f"vocab_size {declared}; the config and weights do not match.")
  return dict(
      vocab_size=rows, d_model=d, n_layers=int(_get(config, "n_layers", "llada")),
      n_heads=heads, n_kv_heads=int(config.get("n_kv_heads") or heads), head_dim=d // heads,
      mlp_dim=int(mlp), max_seq_len=int(config.get("max_sequence_length") or 4096),
      rope_theta=float(config.get("rope_theta") or 10000.0),
      norm_eps=float(config.get("rms_norm_eps", 1e-5)),
      qkv_bias=bool(config.get("include_qkv_bias", False)),
      tie_embeddings=bool(config.get("weight_tying", False)))


def _ids(cfg: ModelConfig) -> dict:
  return {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _check_export(cfg: ModelConfig, family: str, *, qkv_bias=None, shift=False):
  if qkv_bias is not None and cfg.qkv_bias != qkv_bias:
    other = "qwen2" if cfg.qkv_bias else "llama"
    raise ValueError(f"a {family} checkpoint {'has' if qkv_bias else 'has no'} q/k/v biases but "
                     f"the model {'has' if cfg.qkv_bias else 'has none'}; export as {other!r}.")
  if cfg.shift_logits != shift:
    raise ValueError(
        f"cfg.shift_logits={cfg.shift_logits} but {family} checkpoints are "
        f"{'' if shift else 'not '}read shifted; export a shifted model as 'dream' and an "
        "unshifted one as llama/qwen2/llada.")


def _export_qwen_like(cfg: ModelConfig, arch: str, model_type: str) -> dict:
  return dict(
      architectures=[arch], model_type=model_type, vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model, intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.n_layers,
      num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
      head_dim=cfg.resolved_head_dim, max_position_embeddings=cfg.max_seq_len,
      rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
      hidden_act="silu", tie_word_embeddings=cfg.tie_embeddings, dtype=cfg.param_dtype,
      **_ids(cfg))


def _export_llama(cfg: ModelConfig) -> dict:
  _check_export(cfg, "llama", qkv_bias=False)
  return dict(_export_qwen_like(cfg, "LlamaForCausalLM", "llama"), attention_bias=False,
              mlp_bias=False)


def _export_qwen2(cfg: ModelConfig) -> dict:
  _check_export(cfg, "qwen2", qkv_bias=True)
  return dict(_export_qwen_like(cfg, "Qwen2ForCausalLM", "qwen2"), use_sliding_window=False)


def _export_dream(cfg: ModelConfig) -> dict:
  _check_export(cfg, "dream", qkv_bias=True, shift=True)
  return dict(_export_qwen_like(cfg, "DreamModel", "Dream"), use_sliding_window=False,
              mask_token_id=cfg.mask_token_id)


def _export_llada(cfg: ModelConfig) -> dict:
  _check_export(cfg, "llada")
  if cfg.resolved_head_dim * cfg.n_heads != cfg.d_model:
    raise ValueError(f"LLaDA requires head_dim * n_heads == d_model; got "
                     f"{cfg.resolved_head_dim} * {cfg.n_heads} != {cfg.d_model}.")
  return dict(
      architectures=["LLaDAModelLM"], model_type="llada", d_model=cfg.d_model,
      n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, n_layers=cfg.n_layers,
      mlp_hidden_size=cfg.mlp_dim, vocab_size=cfg.vocab_size,
      embedding_size=cfg.vocab_size, max_sequence_length=cfg.max_seq_len,
      rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, weight_tying=cfg.tie_embeddings,
      include_bias=False, include_qkv_bias=cfg.qkv_bias, block_type="llama",
      layer_norm_type="rms", activation_type="silu", rope=True, alibi=False,
      attention_layer_norm=False, scale_logits=False, input_emb_norm=False,
      block_group_size=1, mask_token_id=cfg.mask_token_id, **_ids(cfg))


def _qwen_layer_names() -> dict[Path_, str]:
  names = {("attn_norm", "scale"): "input_layernorm.weight",
           ("mlp_norm", "scale"): "post_attention_layernorm.weight"}
  for p in ("q", "k", "v", "o"):
    names[("attn", p, "kernel")] = f"self_attn.{p}_proj.weight"
  for p in ("q", "k", "v"):
    names[("attn", p, "bias")] = f"self_attn.{p}_proj.bias"
  for p in ("gate", "up", "down"):
    names[("mlp", p, "kernel")] = f"mlp.{p}_proj.weight"
  return names


_QWEN_GLOBALS = {("embed", "embedding"): "model.embed_tokens.weight",
                 ("final_norm", "scale"): "model.norm.weight",
                 ("lm_head", "kernel"): "lm_head.weight"}
# RoPE frequency buffers: older transformers versions saved them with the weights; they are
# recomputed from rope_theta (HF skips them on load too), so they are allowed by name.
_QWEN_IGNORABLE = (r"\.rotary_emb\.inv_freq$",)

_LLADA_LAYER = {
    ("attn_norm", "scale"): "attn_norm.weight", ("mlp_norm", "scale"): "ff_norm.weight",
    ("attn", "q", "kernel"): "q_proj.weight", ("attn", "k", "kernel"): "k_proj.weight",
    ("attn", "v", "kernel"): "v_proj.weight", ("attn", "o", "kernel"): "attn_out.weight",
    ("attn", "q", "bias"): "q_proj.bias", ("attn", "k", "bias"): "k_proj.bias",
    ("attn", "v", "bias"): "v_proj.bias",
    # SwiGLU: silu(ff_proj(x)) * up_proj(x) -> ff_out, so ff_proj is the gate.
    ("mlp", "gate", "kernel"): "ff_proj.weight", ("mlp", "up", "kernel"): "up_proj.weight",
    ("mlp", "down", "kernel"): "ff_out.weight"}
_LLADA_GLOBALS = {("embed", "embedding"): "model.transformer.wte.weight",
                  ("final_norm", "scale"): "model.transformer.ln_f.weight",
                  ("lm_head", "kernel"): "model.transformer.ff_out.weight"}

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", ("llama",), ("LlamaForCausalLM",), "model.layers.{i}.",
                    _qwen_layer_names(), _QWEN_GLOBALS, _parse_llama, _export_llama,
                    _QWEN_IGNORABLE),
    "qwen2": Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), "model.layers.{i}.",
                    _qwen_layer_names(), _QWEN_GLOBALS, _parse_qwen2, _export_qwen2,
                    _QWEN_IGNORABLE, bias_key="model_type"),
    "dream": Family("dream", ("dream",), ("DreamModel",), "model.layers.{i}.",
                    _qwen_layer_names(), _QWEN_GLOBALS, _parse_dream, _export_dream,
                    _QWEN_IGNORABLE, bias_key="model_type"),
    # LLaDA's RoPE buffers are not persistent: its files hold parameters only.
    "llada": Family("llada", ("llada",), ("LLaDAModelLM",), "model.transformer.blocks.{i}.",
                    _LLADA_LAYER, _LLADA_GLOBALS, _parse_llada, _export_llada,
                    tying_key="weight_tying", layers_key="n_layers",
                    bias_key="include_qkv_bias"),
}


def get_family(name: str) -> Family:
  if name not in FAMILIES:
    raise ValueError(f"Unknown checkpoint family {name!r}; supported: {sorted(FAMILIES)}.")
  return FAMILIES[name]


def detect_family(config: dict, source: str = "config.json") -> Family:
  """Picks the family from `model_type`, else from `architectures`."""
  model_type = str(config.get("model_type") or "").lower()
  archs = config.get("architectures") or []
  for family in FAMILIES.values():
    if model_type in family.model_types:
      return family
  for family in FAMILIES.values():
    if any(a in family.architectures for a in archs):
      return family
  supported = ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in FAMILIES.values())
  raise ValueError(f"{source}: model_type={model_type or None!r}, architectures={archs!r} is "
                   f"not a supported family; supported: {supported}.")
