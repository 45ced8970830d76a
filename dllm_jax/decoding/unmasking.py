"""Decode-time unmasking schedules: how many masked slots each denoising step commits.

Shape legend: R ranked rows (batch rows, or rows x blocks), W slots of one block, k slots
per block, s steps per block.

How it works, in full: docs/decoders.md, `decoding.unmasking`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, sampling

Array = jnp.ndarray
SCHEDULES = ("even", "cosine", "entropy_bound")
FIXED = ("even", "cosine")           # static counts per step
DEFAULT_ENTROPY_BOUND = 0.1          # nats; the EB sampler reference's default gamma
_EPS = 1e-9


def check(unmasking, entropy_bound) -> None:
  """ValueError naming the option unless the schedule is known and the bound is >= 0 (inf
  allowed: commit the whole block at once)."""
  if not isinstance(unmasking, str) or unmasking not in SCHEDULES:
    raise ValueError(f"Unknown unmasking schedule {unmasking!r}; use one of {SCHEDULES}.")
  base.check_number("entropy_bound", entropy_bound, low=0.0, allow_inf=True)


def counts(unmasking: str, block_length: int, steps: int) -> np.ndarray:
  """[s] int32 slots committed by each step of a block of k = block_length masks (even or
  cosine; docs/decoders.md). Requires 1 <= s <= k; the counts are >= 1 and sum to k."""
  k, s = int(block_length), int(steps)
  if not 1 <= s <= k:
    raise ValueError(f"steps per block ({s}) must lie in [1, block_length={k}]: each step "
                     "commits at least one token.")
  if unmasking == "even":
    base_count, extra = divmod(k, s)
    return (base_count + (np.arange(s) < extra)).astype(np.int32)
  if unmasking == "cosine":
    remaining, out = k, []
    for j in range(s):
      target = math.floor(k * math.cos(math.pi / 2 * (j + 1) / s) + _EPS)
      left = min(target, remaining - 1)
      out.append(remaining - left)
      remaining = left
    return np.asarray(out, np.int32)
  raise ValueError(f"unmasking={unmasking!r} has no fixed count per step; counts() takes "
                   f"one of {FIXED}.")


def predictive_entropy(logits: Array) -> Array:
  """[..., V] logits -> [...] float32 entropy in nats (forbidden -inf ids contribute 0)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  p = jnp.exp(logp)
  return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)


def order_scores(scores: Array, candidates: Array, order_temp, rng: Array) -> Array:
  """[W] scores of one row as the commit order compares them: Gumbel-perturbed `scores /
  order_temp` when order_temp > 0 (Dream's alg_temp; the same draw as
  `sampling.sample_order_mask` with this row's key), else the scores. Non-candidates -inf."""
  s = jnp.where(candidates, scores, sampling.NEG_INF)

  def sampled(x):
    noise = sampling._gumbel(rng, (1,) + x.shape)[0]  # pylint: disable=protected-access
    return jnp.where(x > sampling.NEG_INF, x / order_temp + noise, sampling.NEG_INF)
  if isinstance(order_temp, (int, float)):
    return s if order_temp == 0.0 else sampled(s)
  return jax.lax.cond(order_temp == 0.0, lambda x: x, sampled, s)


def commit_order(scores: Array, candidates: Array, demoted: Array | None = None, *,
                 invariant: bool = False) -> Array:
  """[R, W] slot indices in commit order: candidates first (non-demoted before demoted, each
  by `sampling.rank_scores` descending, ties to the lowest slot; `invariant`: on its grid),
  then non-candidates."""
  ranked = sampling.rank_scores(jnp.where(candidates, scores, sampling.NEG_INF), invariant)
  by_score = jnp.argsort(-ranked, axis=-1, stable=True)
  tier = jnp.where(candidates, 0, 2)
  if demoted is not None:
    tier = jnp.where(candidates & demoted, 1, tier)
  by_tier = jnp.argsort(jnp.take_along_axis(tier, by_score, -1), axis=-1, stable=True)
  return jnp.take_along_axis(by_score, by_tier, -1)


def bounded_count(entropy: Array, order: Array, candidates: Array, bound) -> Array:
  """[R] slots the entropy-bound rule commits: the longest prefix of `order` over the
  candidates with sum - max of its entropies <= bound, clipped to [min(1, n), n] for n
  candidates ([R, W] entropy / order / candidates)."""
  n = jnp.sum(candidates, axis=-1, dtype=jnp.int32)
  in_prefix = jnp.arange(order.shape[-1], dtype=jnp.int32)[None] < n[:, None]
  e = jnp.where(in_prefix, jnp.take_along_axis(entropy, order, -1), 0.0)
  spread = jnp.cumsum(e, axis=-1) - jax.lax.cummax(e, axis=e.ndim - 1)
  count = jnp.sum(in_prefix & (spread <= sampling.by_row(bound, 2)), axis=-1, dtype=jnp.int32)
  return jnp.clip(count, jnp.minimum(n, 1), n)


def entropy_bound_mask(scores: Array, entropy: Array, candidates: Array, bound,
                       demoted: Array | None = None, *, invariant: bool = False) -> Array:
  """[R, W] bool: the slots the entropy-bound rule commits, in the order of `scores` (higher
  first, `commit_order`, exact or with `invariant` on the rank grid); [R, W] scores /
  entropy / candidates / demoted."""
  order = commit_order(scores, candidates, demoted, invariant=invariant)
  count = bounded_count(entropy, order, candidates, bound)
  ranks = jnp.argsort(order, axis=-1)
  return candidates & (ranks < count[:, None])
