"""Token choice and confidence scores shared by every decoder.

Shape legend: B batch, T canvas positions, V vocab. All functions are pure and jit-able;
randomness comes from an explicit key (fold it in per step: `fold_in(rng, step)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jnp.ndarray
NEG_INF = -jnp.inf
CONFIDENCE_KINDS = ("probability", "margin", "entropy", "random")


def forbid(logits: Array, token_ids) -> Array:
  """Sets the logits of `token_ids` (ints, possibly empty) to -inf; e.g. never emit [MASK]."""
  ids = [i for i in token_ids if i is not None]
  if not ids:
    return logits
  return logits.at[..., jnp.asarray(ids)].set(NEG_INF)


def gumbel_argmax(logits: Array, temperature: float, rng: Array | None) -> Array:
  """argmax(logits / T + Gumbel) (temperature 0: plain argmax). [..., V] -> [...].

  Equal in distribution to LLaDA's `argmax(exp(logits) / (-log u) ** T)`.
  """
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  u = jax.random.uniform(rng, logits.shape, jnp.float32, minval=1e-20, maxval=1.0)
  gumbel = -jnp.log(-jnp.log(u))
  return jnp.argmax(logits / temperature + gumbel, axis=-1).astype(jnp.int32)


def filter_top_k(logits: Array, top_k: int) -> Array:
  """Keeps the k largest logits per row (0 = keep all)."""
  if not top_k or top_k >= logits.shape[-1]:
    return logits
  kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
  return jnp.where(logits < kth, NEG_INF, logits)


def filter_top_p(logits: Array, top_p: float) -> Array:
  """Nucleus filtering: keeps the smallest set of tokens whose probability reaches top_p."""
  if top_p >= 1.0:
    return logits
  sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  # A token is kept when the mass strictly before it is < top_p (the top token always is).
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  cutoff_idx = jnp.sum(mass_before < top_p, axis=-1, keepdims=True) - 1
  cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
  return jnp.where(logits < cutoff, NEG_INF, logits)


def sample(logits: Array, rng: Array | None, *, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0) -> Array:
  """AR-style sampling: greedy at temperature 0, else top-k / top-p filtered Gumbel-max."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = filter_top_p(filter_top_k(logits, top_k), top_p)
  return gumbel_argmax(logits, temperature, rng)


def confidence(logits: Array, x0: Array, kind: str, rng: Array | None = None) -> Array:
  """Per-position confidence in the proposal `x0` ([..., V], [...] -> [...], float32).

  probability: softmax probability of x0 (LLaDA `low_confidence`, Dream `maskgit_plus`).
  margin: top-1 minus top-2 probability (Dream `topk_margin`).
  entropy: negative entropy of the predictive distribution (Dream `entropy`).
  random: uniform noise (LLaDA `random`, Dream `origin`).
  """
  if kind == "random":
    return jax.random.uniform(rng, x0.shape, jnp.float32)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  if kind == "probability":
    return jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
  if kind == "margin":
    top2 = jax.lax.top_k(probs, 2)[0]
    return top2[..., 0] - top2[..., 1]
  if kind == "entropy":
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1)
  raise ValueError(f"Unknown confidence kind {kind!r}; use one of {CONFIDENCE_KINDS}.")


def top_k_mask(scores: Array, k: Array) -> Array:
  """Marks the k[b] highest scores of each row ([B, T], [B] -> [B, T] bool).

  Ties go to the lower index (like a stable descending sort). Entries at -inf are never
  chosen, so a row with fewer candidates than k commits only its candidates.
  """
  order = jnp.argsort(-scores, axis=-1, stable=True)
  ranks = jnp.argsort(order, axis=-1)
  return (ranks < k[:, None]) & (scores > NEG_INF)


def sample_order_mask(scores: Array, k: Array, temperature: float, rng: Array) -> Array:
  """Dream's `alg_temp`: picks k positions by sampling ∝ softmax(scores / T) without replacement.

  Gumbel-top-k: adding Gumbel noise to scores / T and taking the top k samples without
  replacement. temperature 0 is the deterministic top-k.
  """
  if temperature == 0.0:
    return top_k_mask(scores, k)
  u = jax.random.uniform(rng, scores.shape, jnp.float32, minval=1e-20, maxval=1.0)
  noisy = jnp.where(scores > NEG_INF, scores / temperature - jnp.log(-jnp.log(u)), NEG_INF)
  return top_k_mask(noisy, k)


def threshold_mask(conf: Array, candidates: Array, tau: float) -> Array:
  """Fast-dLLM/D2F threshold rule: candidates with confidence > tau, and at least the most
  confident candidate of every row that has one. [B, T] -> [B, T] bool."""
  conf = jnp.where(candidates, conf, NEG_INF)
  above = candidates & (conf > tau)
  best = jax.nn.one_hot(jnp.argmax(conf, axis=-1), conf.shape[-1], dtype=jnp.bool_)
  return above | (best & jnp.any(candidates, axis=-1, keepdims=True))


def factor_mask(conf: Array, candidates: Array, factor: float) -> Array:
  """Fast-dLLM factor rule: sort confidences descending and commit the largest n with
  c_n >= 1 - factor / (n + 1) (n counted from 1), at least one per row with candidates."""
  conf = jnp.where(candidates, conf, NEG_INF)
  sorted_conf = jnp.sort(conf, axis=-1)[..., ::-1]
  n = jnp.arange(1, conf.shape[-1] + 1, dtype=jnp.float32)
  ok = sorted_conf >= 1.0 - factor / (n + 1.0)
  # The largest n whose prefix all satisfies the rule.
  count = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
  count = jnp.maximum(count, jnp.any(candidates, axis=-1).astype(jnp.int32))
  return top_k_mask(conf, count)


def row_keys(rng: Array, step, batch: int) -> Array:
  """[B] keys `fold_in(fold_in(rng, step), row)`: a row's randomness depends only on its own
  index, so padding a batch (e.g. to split it over devices) never changes the other rows."""
  step_key = jax.random.fold_in(rng, step)
  return jax.vmap(lambda r: jax.random.fold_in(step_key, r))(jnp.arange(batch))
