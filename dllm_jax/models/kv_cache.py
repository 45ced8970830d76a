"""Static-shape K/V cache shared by every decoder.

Layout (a decision recorded in docs/design.md): keys and values of all layers are stacked,
stored *after* RoPE, in slots that are filled left to right per row:

  k, v       [L, B, S, K, Dh]   L layers, S slots, K kv heads
  block_ids  [B, S]  int32      the id each slot was written with (masks.py); NO_KEY = empty
  length     [B]     int32      slots filled so far; the next write of row b starts there

Because keys are stored rotated and visibility only compares ids, slot order carries no
meaning: a chunk attends to `cache slots ++ its own tokens`, then the first `n_b` chunk
tokens of row b are written at `length[b]`. Rows advance independently (D2F needs that).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from dllm_jax.models import masks
from dllm_jax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  k: jnp.ndarray
  v: jnp.ndarray
  block_ids: jnp.ndarray
  length: jnp.ndarray

  @property
  def capacity(self) -> int:
    return self.k.shape[2]

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=None) -> KVCache:
  """An empty cache of `capacity` slots per row."""
  if capacity <= 0:
    raise ValueError(f"cache capacity must be positive, got {capacity}.")
  if capacity > cfg.max_seq_len:
    raise ValueError(
        f"cache capacity {capacity} exceeds max_seq_len={cfg.max_seq_len}; lower the "
        "generation length or build the model with a larger max_seq_len.")
  dtype = cfg.jnp_dtype if dtype is None else dtype
  shape = (cfg.n_layers, batch_size, capacity, cfg.n_kv_heads, cfg.resolved_head_dim)
  return KVCache(
      k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
      block_ids=jnp.full((batch_size, capacity), masks.NO_KEY, jnp.int32),
      length=jnp.zeros((batch_size,), jnp.int32))


def write(cache: KVCache, new_k: jnp.ndarray, new_v: jnp.ndarray, new_ids: jnp.ndarray,
          write_len: jnp.ndarray) -> KVCache:
  """Writes the first `write_len[b]` of T new tokens of each row at slot `length[b]`.

  Args:
    new_k, new_v: [L, B, T, K, Dh] keys/values of the chunk (after RoPE).
    new_ids: [B, T] key ids of the chunk (NO_KEY for padding).
    write_len: [B] int32, 0 <= write_len <= T.
  Slots past the capacity are dropped; callers validate lengths before compiling.
  """
  b, t = new_ids.shape
  offs = jnp.arange(t, dtype=jnp.int32)[None, :]
  slots = cache.length[:, None] + offs
  slots = jnp.where(offs < write_len[:, None], slots, cache.capacity)  # out of range -> dropped
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  k = cache.k.at[:, rows, slots].set(new_k.astype(cache.k.dtype), mode="drop")
  v = cache.v.at[:, rows, slots].set(new_v.astype(cache.v.dtype), mode="drop")
  ids = cache.block_ids.at[rows, slots].set(new_ids, mode="drop")
  return KVCache(k=k, v=v, block_ids=ids, length=cache.length + write_len)


def truncate(cache: KVCache, length: jnp.ndarray) -> KVCache:
  """Forgets slots >= length[b] (used by approximate caches that are refreshed)."""
  keep = jnp.arange(cache.capacity)[None, :] < length[:, None]
  return cache.replace(block_ids=jnp.where(keep, cache.block_ids, masks.NO_KEY),
                       length=length.astype(jnp.int32))


def sharding_axes() -> KVCache:
  """Logical axis names of each cache field (for `parallel.mesh`)."""
  kv = ("layers", "batch", "cache_len", "kv_heads", "head_dim")
  return KVCache(k=kv, v=kv, block_ids=("batch", "cache_len"), length=("batch",))


def tree_size_bytes(cache: KVCache) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
