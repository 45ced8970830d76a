"""Forward (noising) process of masked diffusion: diffusion times, mask ratios, masking.

Every function is pure and jit-able and takes an explicit PRNG key; the same key always
gives the same corruption. Tokens are only ever masked where `maskable` is True (the batch's
`loss_mask`, minus the prompt in SFT), so the prompt and left padding stay clean.

Shapes: B batch, L canvas length, N = ceil(L / k) answer blocks of k tokens (static bound).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from dllm_jax.diffusion import layout

# D2F's per-block mask ratios (SJTU-DENG-Lab/Discrete-Diffusion-Forcing,
# D2F-train/utils/util.py `generate_monotonic_pmasks`).
D2F_FIRST_LOW = 0.2
D2F_FIRST_HIGH = 0.7
D2F_MAX_RATIO = 0.7


def uniform(rng: jax.Array, shape: tuple[int, ...], *, antithetic: bool = False) -> jnp.ndarray:
  """u in [0, 1) of `shape`; i.i.d., or stratified `(u0 + i / n) mod 1` over the n entries.

  The stratified (antithetic / low-discrepancy) draw puts exactly one sample in each of the n
  intervals [i/n, (i+1)/n) up to a common shift, which lowers the variance of the ELBO's
  Monte-Carlo estimate over t (MDLM, VDM).
  """
  if not antithetic:
    return jax.random.uniform(rng, shape, jnp.float32)
  n = 1
  for s in shape:
    n *= s
  u0 = jax.random.uniform(rng, (), jnp.float32)
  u = jnp.mod(u0 + jnp.arange(n, dtype=jnp.float32) / n, 1.0)
  return u.reshape(shape)


def sample_times(rng: jax.Array, shape: tuple[int, ...], *, t_min: float = 0.0,
                 antithetic: bool = False) -> jnp.ndarray:
  """Diffusion times t = t_min + (1 - t_min) * u in [t_min, 1), u from `uniform`.

  With the linear schedule and t_min = eps this is LLaDA's `p_mask = (1 - eps) * u + eps`.
  """
  if not 0.0 <= t_min < 1.0:
    raise ValueError(f"t_min must be in [0, 1), got {t_min}.")
  return t_min + (1.0 - t_min) * uniform(rng, shape, antithetic=antithetic)


def per_token(values: jnp.ndarray, blk: jnp.ndarray, fill: float = 0.0) -> jnp.ndarray:
  """Spreads per-row [B] or per-block [B, N] values to tokens [B, L]; `fill` where blk < 0."""
  if values.ndim == 1:
    return jnp.where(blk >= 0, values[:, None], fill)
  gathered = jnp.take_along_axis(values, jnp.clip(blk, 0, values.shape[1] - 1), axis=1)
  return jnp.where(blk >= 0, gathered, fill)


def mask_bernoulli(rng: jax.Array, tokens: jnp.ndarray, maskable: jnp.ndarray,
                   mask_prob: jnp.ndarray, mask_id: int):
  """Masks each maskable token independently with probability `mask_prob` ([B, L] or [B, 1]).

  Returns (x_t [B, L], masked [B, L] bool).
  """
  u = jax.random.uniform(rng, tokens.shape, jnp.float32)
  masked = maskable & (u < mask_prob)
  return jnp.where(masked, jnp.asarray(mask_id, tokens.dtype), tokens), masked


def mask_exact_per_block(rng: jax.Array, tokens: jnp.ndarray, maskable: jnp.ndarray,
                         blk: jnp.ndarray, ratios: jnp.ndarray, mask_id: int):
  """Masks exactly round(ratio_j * m_j) of the m_j maskable tokens of each block j.

  blk: [B, L] answer block index (-1 outside the answer); ratios: [B, N]. Which tokens is
  uniform among the block's maskable tokens; rounding is to nearest, ties to even.
  Returns (x_t [B, L], masked [B, L] bool).
  """
  n = ratios.shape[1]
  group = jnp.where(maskable & (blk >= 0), blk, n).astype(jnp.int32)  # n: never masked
  u = jax.random.uniform(rng, tokens.shape, jnp.float32)
  order = jnp.lexsort((u, group), axis=-1)  # by group, then by random score
  rank = jnp.argsort(order, axis=-1)  # position of each token in that order
  counts = jax.vmap(lambda g: jax.ops.segment_sum(jnp.ones_like(g), g, n + 1))(group)
  starts = jnp.cumsum(counts, axis=1) - counts
  rank_in_block = rank - jnp.take_along_axis(starts, group, axis=1)
  n_mask = jnp.round(ratios * counts[:, :n]).astype(jnp.int32)
  n_mask = jnp.concatenate([n_mask, jnp.zeros_like(n_mask[:, :1])], axis=1)
  masked = rank_in_block < jnp.take_along_axis(n_mask, group, axis=1)
  return jnp.where(masked, jnp.asarray(mask_id, tokens.dtype), tokens), masked


def check_d2f_bounds(first_low: float, first_high: float, max_ratio: float):
  if not 0.0 < first_low <= first_high <= max_ratio <= 1.0:
    raise ValueError(
        "D2F mask-ratio bounds need 0 < first_low <= first_high <= max_ratio <= 1, got "
        f"first_low={first_low}, first_high={first_high}, max_ratio={max_ratio}.")


def d2f_block_ratios(rng: jax.Array, row_blocks: jnp.ndarray, max_blocks: int, *,
                     first_low: float = D2F_FIRST_LOW, first_high: float = D2F_FIRST_HIGH,
                     max_ratio: float = D2F_MAX_RATIO) -> jnp.ndarray:
  """D2F's monotonically non-decreasing per-block mask ratios, [B, max_blocks].

  Row b with n_b = row_blocks[b] answer blocks: r_0 ~ U[first_low, first_high), then each
  later block adds an increment ~ U[0, (max_ratio - r_0) / (n_b - 1)), and the running sum is
  capped at max_ratio (the sum of n_b - 1 increments cannot exceed it anyway). The reference
  draws n from the longest row of the batch; with a fixed prompt length the two agree.
  Entries beyond a row's n_b continue the same recursion and are never used.
  """
  check_d2f_bounds(first_low, first_high, max_ratio)
  b = row_blocks.shape[0]
  k_first, k_inc = jax.random.split(rng)
  first = jax.random.uniform(k_first, (b, 1), jnp.float32, first_low, first_high)
  steps = jnp.maximum(row_blocks.astype(jnp.float32) - 1.0, 1.0)[:, None]
  inc = jax.random.uniform(k_inc, (b, max_blocks - 1), jnp.float32) * (max_ratio - first) / steps
  ratios = jnp.concatenate([first, first + jnp.cumsum(inc, axis=1)], axis=1)
  return jnp.minimum(ratios, max_ratio)


def d2f_corrupt(rng: jax.Array, batch: Mapping, block_size: int, mask_id: int, *,
                exact: bool = False, first_low: float = D2F_FIRST_LOW,
                first_high: float = D2F_FIRST_HIGH, max_ratio: float = D2F_MAX_RATIO):
  """D2F forward process: per-block monotone ratios, then per-token (or exact-count) masks.

  Returns (x_t [B, L], masked [B, L] bool, token_ratio [B, L] (0 outside the answer),
  ratios [B, N]).
  """
  tokens = jnp.asarray(batch["tokens"])
  maskable = trainable_positions(batch, sft=True)
  blk = layout.block_index(batch, block_size)
  n = layout.num_blocks(tokens.shape[1], block_size)
  k_ratio, k_mask = jax.random.split(rng)
  ratios = d2f_block_ratios(k_ratio, layout.row_num_blocks(batch, block_size), n,
                            first_low=first_low, first_high=first_high, max_ratio=max_ratio)
  token_ratio = per_token(ratios, blk)
  if exact:
    x_t, masked = mask_exact_per_block(k_mask, tokens, maskable, blk, ratios, mask_id)
  else:
    x_t, masked = mask_bernoulli(k_mask, tokens, maskable, token_ratio, mask_id)
  return x_t, masked, token_ratio, ratios


def trainable_positions(batch: Mapping, *, sft: bool) -> jnp.ndarray:
  """[B, L] positions that may be masked: loss_mask & valid, and never the prompt in SFT."""
  maskable = jnp.asarray(batch["loss_mask"]) & jnp.asarray(batch["valid"])
  if sft:
    maskable = maskable & ~jnp.asarray(batch["prompt_mask"])
  return maskable
