"""The decoder-only transformer: embed -> blocks (scanned, optionally remat) -> norm -> head.

One network serves AR, masked-diffusion and block-causal (D2F) models; the attention
pattern is data (`block_ids`, see masks.py). Every decoder talks to the model through
`Transformer.__call__` (or the functional `forward` wrapper), so a new decoder never needs
a new model.

Shape legend: B batch, T tokens in this call, S cache slots, V vocab, L layers.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.models import kv_cache as kvc
from dllm_jax.models import masks
from dllm_jax.models.config import ACTIVE_VOCAB_FLOOR, ModelConfig
from dllm_jax.models.layers import MLP, Attention, Dense, RMSNorm
from dllm_jax.parallel import mesh as mesh_lib

Array = jnp.ndarray

_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Block(nn.Module):
  """Pre-norm block. Scanned over layers: carry = residual stream, xs = this layer's cache."""
  cfg: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, layer_kv, positions, query_ids, key_ids, branches=None):
    cfg = self.cfg
    norm = lambda name: RMSNorm(cfg.norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype, name=name)
    cache_k, cache_v = layer_kv if layer_kv is not None else (None, None)
    attn_out, new_kv = Attention(cfg, self.deterministic, name="attn")(
        norm("attn_norm")(x), positions, query_ids, key_ids, cache_k, cache_v, branches)
    x = x + attn_out
    x = x + MLP(cfg, name="mlp")(norm("mlp_norm")(x))
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    return x, (new_kv if layer_kv is not None else None)


class Transformer(nn.Module):
  """Decoder-only transformer of the LLaMA / Qwen2 / LLaDA / Dream family."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, *, block_ids: Array, positions: Array | None = None,
               valid: Array | None = None, cache: kvc.KVCache | None = None,
               write_len: Array | int | None = None, branch_ids: Array | None = None,
               deterministic: bool = True,
               return_hidden: bool = False, input_embeddings: Array | None = None,
               head: bool = True):
    """Runs T tokens, attending to `cache` (if any) plus themselves.

    Args:
      tokens: [B, T] integer ids.
      block_ids: [B, T] (or [T]) int ids; a query sees a key iff key_id <= query_id.
      positions: [B, T] RoPE positions; default `cache.length + arange(T)` (or arange(T)).
      valid: [B, T] bool, False on padding (padding is never attended to).
      cache: a KVCache to read; when given, the call also returns the updated cache.
      write_len: [B] or int, how many of the T tokens (from the left) each row writes into
        the cache; default all T. Only trunk tokens (branch 0) may be written.
      branch_ids: [B, T] (or [T]) int branch of each token (masks.visibility): a token on
        branch b > 0 is seen only by tokens of its own branch; None = all on the trunk.
      deterministic: disables LoRA dropout when True.
      return_hidden: also return the final hidden states [B, T, D].
      input_embeddings: [B, T, D] used instead of looking `tokens` up (soft prompts,
        gradient analysis); `tokens` still sets the shapes.
      head: False skips the LM head: the first output is then the final (normed) hidden
        states [B, T, D], and `project(params, cfg, hidden[, at])` computes logits for the
        slots that need them (decoders whose forwards carry slots only to fill the cache).

    Returns:
      logits [B, T, V] float32, then the new cache if `cache` was given, then hidden states
      if `return_hidden`.
    """
    cfg = self.cfg
    batch, t = _check_inputs(cfg, tokens, cache, write_len)
    if positions is None:
      start = cache.length[:, None] if cache is not None else 0
      positions = start + jnp.arange(t, dtype=jnp.int32)[None, :]
    positions = jnp.broadcast_to(positions, (batch, t)).astype(jnp.int32)
    query_ids = jnp.broadcast_to(block_ids, (batch, t)).astype(jnp.int32)
    chunk_key_ids = masks.key_ids(query_ids, None if valid is None else
                                  jnp.broadcast_to(valid, (batch, t)))
    key_ids = chunk_key_ids if cache is None else jnp.concatenate(
        [cache.block_ids, chunk_key_ids], axis=1)

    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.jnp_dtype,
                     param_dtype=cfg.jnp_param_dtype,
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(stddev=0.02), ("vocab", "embed")),
                     name="embed")
    x = embed(tokens) if input_embeddings is None else input_embeddings.astype(cfg.jnp_dtype)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))

    block_cls = Block
    if cfg.remat_policy != "none":
      block_cls = nn.remat(Block, policy=_REMAT[cfg.remat_policy], prevent_cse=False)
    layers = nn.scan(
        block_cls, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
        length=cfg.n_layers,
        unroll=1 if cfg.scan_layers else cfg.n_layers,
        metadata_params={nn.PARTITION_NAME: "layers"})(cfg, deterministic, name="layers")
    layer_kv = (cache.k, cache.v) if cache is not None else None
    branches = None
    if branch_ids is not None:
      query_branch = jnp.broadcast_to(branch_ids, (batch, t)).astype(jnp.int32)
      key_branch = query_branch if cache is None else jnp.concatenate(
          [jnp.zeros(cache.block_ids.shape, jnp.int32), query_branch], axis=1)
      branches = (query_branch, key_branch)
    x, new_kv = layers(x, layer_kv, positions, query_ids, key_ids, branches)

    hidden = RMSNorm(cfg.norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype, name="final_norm")(x)
    if not head:
      if self.is_initializing():
        raise ValueError("initialise with head=True: the LM head's params must be created.")
      outputs = (hidden,)
      if cache is not None:
        outputs += (_write_cache(cache, new_kv, chunk_key_ids, write_len, batch, t),)
      return outputs[0] if len(outputs) == 1 else outputs
    if cfg.tie_embeddings:
      logits = embed.attend(hidden.astype(cfg.jnp_dtype))
    else:
      logits = Dense(cfg.vocab_size, ("embed", "vocab"), cfg.jnp_dtype, cfg.jnp_param_dtype,
                     name="lm_head")(hidden)
    logits = _floor_inactive(cfg, logits.astype(jnp.float32))
    if cfg.shift_logits:  # Dream: the prediction for position i lives at output i - 1.
      logits = jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
    logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))

    outputs = (logits,)
    if cache is not None:
      outputs += (_write_cache(cache, new_kv, chunk_key_ids, write_len, batch, t),)
    if return_hidden:
      outputs += (hidden,)
    return outputs[0] if len(outputs) == 1 else outputs


def _write_cache(cache: kvc.KVCache, new_kv, key_ids, write_len, batch: int, t: int):
  """The cache after writing each row's first `write_len` (default all T) chunk tokens."""
  write_len = t if write_len is None else write_len
  write_len = jnp.broadcast_to(jnp.asarray(write_len, jnp.int32), (batch,))
  return kvc.write(cache, new_kv[0], new_kv[1], key_ids, write_len)


def _floor_inactive(cfg: ModelConfig, logits: Array) -> Array:
  """Ids past the tokenizer's vocabulary (`active_vocab_size`) get the floor logit."""
  if cfg.active_vocab_size is not None and cfg.active_vocab_size < cfg.vocab_size:
    ids = jnp.arange(cfg.vocab_size, dtype=jnp.int32)
    logits = jnp.where(ids < cfg.active_vocab_size, logits, ACTIVE_VOCAB_FLOOR)
  return logits


def project(params, cfg: ModelConfig, hidden: Array, at: Array | None = None) -> Array:
  """LM-head logits of final hidden states from `Transformer(..., head=False)`.

  Args:
    hidden: [B, T, D] final (normed) hidden states.
    at: optional [B, T_out] int indices into T: only those slots are projected (the head
      costs D * V per slot, the largest single matmul of a big-vocabulary model).
  Returns [B, T_out, V] float32 logits, equal to those `head=True` gives at the same slots
  (before Dream's shift, which the caller applies).
  """
  if at is not None:
    hidden = jnp.take_along_axis(hidden, at[..., None].astype(jnp.int32), axis=1)
  if cfg.tie_embeddings:
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.jnp_dtype,
                     param_dtype=cfg.jnp_param_dtype)
    logits = embed.apply({"params": params["embed"]}, hidden.astype(cfg.jnp_dtype),
                         method=nn.Embed.attend)
  else:
    logits = Dense(cfg.vocab_size, ("embed", "vocab"), cfg.jnp_dtype,
                   cfg.jnp_param_dtype).apply({"params": params["lm_head"]}, hidden)
  return _floor_inactive(cfg, logits.astype(jnp.float32))


def _check_inputs(cfg: ModelConfig, tokens, cache, write_len=None):
  """Static checks with errors that say what to change. A static int `write_len` bounds
  the slots the chunk writes (the rest, e.g. draft mask blocks, are read and dropped)."""
  if tokens.ndim != 2:
    raise ValueError(f"tokens must have shape [batch, length], got {tokens.shape}.")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(
        f"tokens must be integer ids, got dtype {tokens.dtype}; cast with .astype(jnp.int32).")
  batch, t = tokens.shape
  if t > cfg.max_seq_len:
    raise ValueError(
        f"sequence length {t} exceeds the model window max_seq_len={cfg.max_seq_len}; "
        "shorten the prompt/generation or build the model with a larger max_seq_len.")
  if cache is not None:
    if cache.batch_size != batch:
      raise ValueError(f"cache holds {cache.batch_size} rows but tokens have {batch}.")
    written = write_len if isinstance(write_len, (int, np.integer)) else t
    if written > cache.capacity:
      raise ValueError(
          f"a chunk writing {written} tokens cannot fit a cache of {cache.capacity} slots; "
          "allocate a larger cache with init_cache(..., capacity=...).")
    if cache.k.dtype != cfg.jnp_dtype:
      raise ValueError(
          f"cache dtype {cache.k.dtype} differs from the model compute dtype {cfg.dtype}; "
          "create it with init_cache(cfg, ...).")
    if not isinstance(cache.length, jax.core.Tracer):
      longest = int(np.max(np.asarray(cache.length))) + written
      if longest > cache.capacity:
        raise ValueError(
            f"cache overflow: {longest} slots needed but the cache holds {cache.capacity}; "
            "allocate a larger cache with init_cache(..., capacity=...).")
  return batch, t


def forward(params, cfg: ModelConfig, tokens: Array, *, attention: str = "causal",
            positions: Array | None = None, valid: Array | None = None,
            prompt_len: int | None = None, block_size: int | None = None, **kwargs):
  """Functional convenience: full-canvas forward with a named attention kind.

  `attention` is "causal", "bidirectional" or "block_causal" (needs prompt_len, block_size).
  Left-padded rows: pass `valid`; positions default to left-pad positions then.
  """
  masks.check_kind(attention)
  if positions is None:
    positions = (masks.left_pad_positions(valid) if valid is not None else
                 jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape))
  ids = masks.ids_for(attention, positions, prompt_len=prompt_len, block_size=block_size)
  return Transformer(cfg).apply({"params": params}, tokens, block_ids=ids,
                                positions=positions, valid=valid, **kwargs)


def init_params(cfg: ModelConfig, rng: jax.Array, seq_len: int = 8, *, mesh=None,
                rules=None):
  """Initialises a params tree (boxed logical-axis metadata removed).

  With a `mesh`, every leaf is created directly in its shards, as flax's lm1b does:
  `eval_shape` gives the logical axes, `parallel.mesh.param_shardings` (under `rules`, default
  `DEFAULT_RULES`) turns them into shardings, and the init is jitted with those
  `out_shardings`, so no device ever holds the whole model. The values are the same as
  without a mesh.
  """
  def init(key):
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    return Transformer(cfg).init(key, tokens,
                                 block_ids=jnp.zeros((1, seq_len), jnp.int32))["params"]

  if mesh is None:
    return nn.unbox(init(rng))
  rules = mesh_lib.rules_from_config(rules)
  shardings = mesh_lib.param_shardings(jax.eval_shape(init, rng), mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    return jax.jit(lambda key: nn.unbox(init(key)), out_shardings=shardings)(rng)


def abstract_params(cfg: ModelConfig):
  """Shapes and logical axes of the params tree, with no memory allocated."""
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  return jax.eval_shape(
      lambda t: Transformer(cfg).init(jax.random.key(0), t,
                                      block_ids=jnp.zeros((1, 8), jnp.int32))["params"],
      tokens)
