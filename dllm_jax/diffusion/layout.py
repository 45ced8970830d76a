"""The training batch contract and the block layout of its answer.

Every objective receives a dict of [B, L] arrays (numpy or jax):

  tokens       int   clean sequence x0: (left-padded) prompt, answer, EOS padding
  valid        bool  False only on the prompt's left padding
  prompt_mask  bool  True on prompt tokens
  loss_mask    bool  True where a token may be noised / trained on (SFT: answer + its EOS
                     padding; pretraining: every valid token)
  positions    int   RoPE positions (left-pad aware)

The *answer* of a row starts at its first valid non-prompt token (canvas index P for SFT/D2F
batches, whose prompts are left-padded to a fixed length P; 0 for pretraining text). Answer
blocks of k tokens are numbered 0, 1, ... from there; block `j` gets attention id `j + 1`
and the prompt (with its padding) id 0, matching `models.masks.block_causal_ids`.

Shapes: B batch, L canvas length, N = ceil(L / k) the most answer blocks a row can hold.
"""

from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp

BATCH_KEYS = {"tokens": "int", "valid": "bool", "prompt_mask": "bool", "loss_mask": "bool",
              "positions": "int"}


def check_batch(batch: Mapping) -> tuple[int, int]:
  """Checks the batch contract (keys, ranks, shapes, dtypes); returns (B, L)."""
  missing = sorted(set(BATCH_KEYS) - set(batch))
  if missing:
    raise ValueError(f"Batch is missing key(s) {missing}; an objective needs "
                     f"{sorted(BATCH_KEYS)} (all [batch, length]).")
  shape = tuple(batch["tokens"].shape)
  if len(shape) != 2:
    raise ValueError(f"batch['tokens'] must be [batch, length], got shape {shape}.")
  for key, kind in BATCH_KEYS.items():
    value = batch[key]
    if tuple(value.shape) != shape:
      raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)} but batch['tokens'] "
                       f"has {shape}; every batch array must be [batch, length].")
    is_int = jnp.issubdtype(value.dtype, jnp.integer)
    is_bool = value.dtype == jnp.bool_
    if (kind == "int" and not is_int) or (kind == "bool" and not is_bool):
      raise ValueError(f"batch[{key!r}] must have {kind} dtype, got {value.dtype}.")
  return shape


def answer_start(batch: Mapping) -> jnp.ndarray:
  """[B] canvas index of each row's first valid non-prompt token (L if there is none)."""
  body = jnp.asarray(batch["valid"]) & ~jnp.asarray(batch["prompt_mask"])
  length = body.shape[1]
  return jnp.where(body.any(axis=1), jnp.argmax(body, axis=1), length).astype(jnp.int32)


def num_blocks(length: int, block_size: int) -> int:
  """N: the most answer blocks of `block_size` an L-token canvas can hold (static)."""
  if block_size <= 0:
    raise ValueError(f"block_size must be positive, got {block_size}.")
  return -(-length // block_size)


def block_index(batch: Mapping, block_size: int) -> jnp.ndarray:
  """[B, L] answer block of each token (0, 1, ...), -1 on the prompt and its padding."""
  start = answer_start(batch)
  idx = jnp.arange(jnp.asarray(batch["tokens"]).shape[1], dtype=jnp.int32)[None, :]
  rel = idx - start[:, None]
  return jnp.where(rel >= 0, rel // block_size, -1).astype(jnp.int32)


def row_num_blocks(batch: Mapping, block_size: int) -> jnp.ndarray:
  """[B] number of answer blocks of each row: ceil((L - answer_start) / k)."""
  length = jnp.asarray(batch["tokens"]).shape[1]
  return (-(-(length - answer_start(batch)) // block_size)).astype(jnp.int32)


def block_causal_ids(batch: Mapping, block_size: int) -> jnp.ndarray:
  """[B, L] attention ids: 0 on the prompt, 1 + answer block after it (D2F student layout).

  For a fixed prompt length P this equals `models.masks.block_causal_ids(L, P, k)`.
  """
  return (block_index(batch, block_size) + 1).astype(jnp.int32)
