"""Attention patterns as data: one rule serves causal, bidirectional and block-causal.

Every token carries an integer *block id*. A query sees a key iff

    key_block_id <= query_block_id        (and the key is a real token)

so the three patterns the package needs are three ways of numbering tokens:

  causal          ids = position            -> token t sees tokens <= t
  bidirectional   ids = 0 everywhere        -> every token sees every token
  block_causal    ids = 0 on the prompt,    -> the prompt sees the prompt; answer block b
                  1 + (i - P) // k after       sees the prompt, blocks < b and itself

A chunk may also carry *branch* ids (0 = the shared trunk): a key on branch b > 0 is seen
only by queries on the same branch (still under the id rule), so one forward can hold
several sibling continuations of one prefix that never see each other (self-speculation's
mask blocks, one per acceptance outcome). Cached keys are always on the trunk.

Padding and empty cache slots get `NO_KEY` (int32 max): no query ever sees them. Because
the rule only compares ids, the same code attends over a K/V cache (whose slots keep the
ids they were written with) plus a chunk of new tokens, under any pattern.

Shapes: B batch, T query tokens, S key slots.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

NO_KEY = np.iinfo(np.int32).max
ATTENTION_KINDS = ("causal", "bidirectional", "block_causal")
# Finite so a query that sees nothing (a padding row) gets a uniform softmax, not NaN.
MASK_VALUE = -1e30


def check_kind(kind: str) -> str:
  if kind not in ATTENTION_KINDS:
    raise ValueError(f"Unknown attention kind {kind!r}; use one of {ATTENTION_KINDS}.")
  return kind


def causal_ids(positions: jnp.ndarray) -> jnp.ndarray:
  """[B, T] positions -> [B, T] ids for causal attention."""
  return positions.astype(jnp.int32)


def bidirectional_ids(shape) -> jnp.ndarray:
  """All-zero ids: every real token sees every real token."""
  return jnp.zeros(shape, jnp.int32)


def block_causal_ids(seq_len: int, prompt_len: int, block_size: int,
                     offset: int | jnp.ndarray = 0) -> jnp.ndarray:
  """[T] ids for a canvas `prompt (P) | block 1 (k) | block 2 (k) | ...`.

  Args:
    seq_len: T, the number of canvas slots described.
    prompt_len: P, canvas slots [0, P) form the prompt segment (id 0).
    block_size: k, answer blocks of k slots each get ids 1, 2, ...
    offset: canvas index of the first slot described (for a chunk that starts mid-canvas).
  """
  if block_size <= 0:
    raise ValueError(f"block_size must be positive, got {block_size}.")
  idx = jnp.arange(seq_len, dtype=jnp.int32) + offset
  return jnp.where(idx < prompt_len, 0, 1 + (idx - prompt_len) // block_size).astype(jnp.int32)


def ids_for(kind: str, positions: jnp.ndarray, *, prompt_len: int | None = None,
            block_size: int | None = None) -> jnp.ndarray:
  """Block ids of a full canvas [B, T] for a named attention kind."""
  check_kind(kind)
  if kind == "causal":
    return causal_ids(positions)
  if kind == "bidirectional":
    return bidirectional_ids(positions.shape)
  if prompt_len is None or block_size is None:
    raise ValueError("block_causal attention needs prompt_len and block_size.")
  ids = block_causal_ids(positions.shape[-1], prompt_len, block_size)
  return jnp.broadcast_to(ids, positions.shape)


def key_ids(block_ids: jnp.ndarray, valid: jnp.ndarray | None) -> jnp.ndarray:
  """Ids a token presents as a key: NO_KEY where it is padding."""
  if valid is None:
    return block_ids
  return jnp.where(valid, block_ids, NO_KEY).astype(jnp.int32)


def visibility(query_ids: jnp.ndarray, key_ids_: jnp.ndarray,
               query_branch: jnp.ndarray | None = None,
               key_branch: jnp.ndarray | None = None) -> jnp.ndarray:
  """[B, T] query ids, [B, S] key ids -> [B, T, S] bool, True where the key is visible.
  With branches ([B, T] and [B, S] ints, 0 = trunk), a key on branch b > 0 is visible only
  to queries on branch b."""
  visible = (key_ids_[:, None, :] <= query_ids[:, :, None]) & (key_ids_[:, None, :] != NO_KEY)
  if key_branch is None:
    return visible
  kb = key_branch[:, None, :]
  return visible & ((kb == 0) | (kb == query_branch[:, :, None]))


def left_pad_positions(valid: jnp.ndarray) -> jnp.ndarray:
  """RoPE positions for a left-padded batch: real tokens count 0, 1, ...; padding gets 0."""
  return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)
