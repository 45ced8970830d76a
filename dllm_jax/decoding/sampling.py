"""Token choice, confidence scores and ranking shared by every decoder.

Shape legend: B batch, T canvas positions, V vocab. All functions are pure and jit-able;
randomness comes from an explicit key (fold it in per step: `fold_in(rng, step)`).

How it works, in full: docs/decoders.md, `decoding.sampling`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray
NEG_INF = -jnp.inf
CONFIDENCE_KINDS = ("probability", "margin", "entropy", "random")
# Ranking grid: far above cross-batch / cross-mesh float noise on scores (<~1e-6), far below
# the gaps that decide a ranking in a trained model.
RANK_GRID = 2.0 ** -12


def _is_number(x) -> bool:
  return isinstance(x, (int, float))


def by_row(value, ndim: int):
  """A traced option as it broadcasts against a [B, ...] array of `ndim` dims: a [B] value
  (one per row) becomes [B, 1, ...]; a number or [] value is returned as is."""
  if jnp.ndim(value) != 1:
    return value
  return jnp.reshape(value, (-1,) + (1,) * (ndim - 1))


def map_rows(fn, rows: tuple, **options):
  """`fn(*row_args, **options)` for every row: vmapped over the rows of `rows` (each [B, ...])
  and of the [B] options (one value per row); the others (numbers, [] values) are passed to
  every row unchanged, so a decode with shared options compiles what it did before."""
  per_row = {k: v for k, v in options.items() if jnp.ndim(v) == 1}
  shared = {k: v for k, v in options.items() if k not in per_row}
  return jax.vmap(lambda args, mapped: fn(*args, **shared, **mapped))(rows, per_row)


def forbid(logits: Array, token_ids) -> Array:
  """Sets the logits of `token_ids` (ints, possibly empty) to -inf; e.g. never emit [MASK]."""
  ids = [i for i in token_ids if i is not None]
  if not ids:
    return logits
  v = logits.shape[-1]
  ids = [i + v if -v <= i < 0 else i for i in ids]  # as indexing reads a negative id
  vocab = jnp.arange(v, dtype=jnp.int32)
  hit = vocab == ids[0]
  for i in ids[1:]:
    hit = hit | (vocab == i)
  # A select, not a scatter: it fuses with whatever reads the logits next (argmax, softmax).
  return jnp.where(hit, NEG_INF, logits)


def all_finite(logits: Array, valid: Array | None = None) -> Array:
  """[B] bool: every logit of the row is finite ([B, ..., V] logits; `valid` [B, ...] marks
  the slots that count). One reduction over logits the decoder computed anyway."""
  ok = jnp.isfinite(logits)
  if valid is not None:
    ok = ok | ~valid[..., None]
  return jnp.all(ok.reshape(ok.shape[0], -1), axis=1)


def scale(logits: Array, temperature) -> Array:
  """logits / T, or the logits unchanged at T == 0 (static or traced T)."""
  if _is_number(temperature):
    return logits if temperature == 0.0 else logits / temperature
  temperature = by_row(temperature, logits.ndim)
  return jnp.where(temperature == 0.0, logits, logits / jnp.where(temperature == 0.0, 1.0,
                                                                   temperature))


def key_batch_shape(rng) -> tuple[int, ...]:
  """The batch shape of a key array: () for one key (typed, or a raw uint32 [2] key)."""
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return tuple(rng.shape)
  return tuple(rng.shape[:-1])


def is_row_keys(rng) -> bool:
  """True for a [B] batch of keys (one per row: typed [B] or raw uint32 [B, 2])."""
  return rng is not None and len(key_batch_shape(rng)) == 1


def keyed_noise(rng: Array, shape, draw) -> Array:
  """`draw(key, shape)` with one key, or, for a key array of batch shape `shape[:n]`, each
  leading position drawn from its own key: `draw(rng[i], shape[n:])` stacked."""
  batch = key_batch_shape(rng)
  if not batch:
    return draw(rng, shape)
  n = len(batch)
  if tuple(shape[:n]) != batch:
    raise ValueError(f"a key array of batch shape {batch} cannot draw noise of shape {shape}: "
                     "its shape must lead the noise shape.")
  flat = rng.reshape((-1,) + tuple(rng.shape[n:]))
  return jax.vmap(lambda k: draw(k, tuple(shape[n:])))(flat).reshape(shape)


def row_step_keys(row_rng: Array, row_step: Array) -> Array:
  """[B] keys `fold_in(row_rng[b], row_step[b])`: a row's key for its own step count."""
  return jax.vmap(jax.random.fold_in)(row_rng, row_step.astype(jnp.int32))


def slot_keys(row_rng: Array, slots: Array) -> Array:
  """[B] keys, [B, T] int slots -> [B, T] keys `fold_in(row_rng[b], slots[b, t])`."""
  return jax.vmap(lambda k, s: jax.vmap(lambda i: jax.random.fold_in(k, i))(s))(
      row_rng, slots.astype(jnp.int32))


def _uniform(rng: Array, shape, minval=0.0) -> Array:
  return keyed_noise(rng, shape, lambda k, s: jax.random.uniform(
      k, s, jnp.float32, minval=minval, maxval=1.0))


def _gumbel(rng: Array, shape) -> Array:
  u = _uniform(rng, shape, minval=1e-20)
  return -jnp.log(-jnp.log(u))


def _argmax(logits: Array) -> Array:
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def gumbel_argmax(logits: Array, temperature, rng: Array | None) -> Array:
  """argmax(logits / T + Gumbel) (temperature 0: plain argmax). [..., V] -> [...].

  Equal in distribution to LLaDA's `argmax(exp(logits) / (-log u) ** T)`.
  """
  sampled = lambda lg: _argmax(lg / temperature + _gumbel(rng, lg.shape))
  if _is_number(temperature):
    return _argmax(logits) if temperature == 0.0 else sampled(logits)
  return jax.lax.cond(temperature == 0.0, _argmax, sampled, logits)


def propose(logits: Array, rng: Array | None, *, temperature) -> Array:
  """`gumbel_argmax` with the key second and the temperature by name (for `map_rows`)."""
  return gumbel_argmax(logits, temperature, rng)


def sort_descending(x: Array, axis: int = -1) -> Array:
  """`jnp.sort(x, axis)[..., ::-1]`'s values on NaN-free input (equal values such as -0.0 and
  0.0 may trade places; NaNs go last, not first), found without the reversal: reversing an
  axis the mesh shards (the vocabulary over `tensor`) is a collective permute, and under
  `shard_map` the data shards' loops run different trip counts, so a collective over every
  device in a loop body deadlocks (XLA:CPU's permute waits for all of them)."""
  return -jnp.sort(-x, axis=axis)


def filter_top_k(logits: Array, top_k) -> Array:
  """Keeps the k largest logits per row (0 = keep all)."""
  v = logits.shape[-1]
  if _is_number(top_k):
    if not top_k or top_k >= v:
      return logits
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    return jnp.where(logits < kth, NEG_INF, logits)
  top_k = jnp.asarray(top_k, jnp.int32)
  sorted_desc = sort_descending(logits)
  kth = jax.lax.dynamic_index_in_dim(sorted_desc, jnp.clip(top_k - 1, 0, v - 1), axis=-1)
  keep_all = (top_k <= 0) | (top_k >= v)
  return jnp.where(keep_all | (logits >= kth), logits, NEG_INF)


def filter_top_p(logits: Array, top_p) -> Array:
  """Nucleus filtering: keeps the smallest set of tokens whose probability reaches top_p."""
  if _is_number(top_p) and top_p >= 1.0:
    return logits
  sorted_logits = sort_descending(logits)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  # A token is kept when the mass strictly before it is < top_p (the top token always is).
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  cutoff_idx = jnp.sum(mass_before < top_p, axis=-1, keepdims=True) - 1
  cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
  filtered = jnp.where(logits < cutoff, NEG_INF, logits)
  return filtered if _is_number(top_p) else jnp.where(top_p >= 1.0, logits, filtered)


def sample(logits: Array, rng: Array | None, *, temperature=0.0, top_k=0, top_p=1.0) -> Array:
  """AR-style sampling: greedy at temperature 0, else top-k / top-p filtered Gumbel-max."""
  def sampled(lg):
    lg = filter_top_p(filter_top_k(lg, top_k), top_p)
    return _argmax(lg / temperature + _gumbel(rng, lg.shape))
  if _is_number(temperature):
    return _argmax(logits) if temperature == 0.0 else sampled(logits)
  return jax.lax.cond(temperature == 0.0, _argmax, sampled, logits)


def confidence(logits: Array, x0: Array, kind: str, rng: Array | None = None) -> Array:
  """Per-position confidence in the proposal `x0` ([..., V], [...] -> [...], float32).

  probability: softmax probability of x0 (LLaDA `low_confidence`, Dream `maskgit_plus`).
  margin: top-1 minus top-2 probability (Dream `topk_margin`).
  entropy: negative entropy of the predictive distribution (Dream `entropy`).
  random: uniform noise (LLaDA `random`, Dream `origin`).
  """
  if kind == "random":
    return _uniform(rng, x0.shape)
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


def rank_scores(scores: Array, invariant: bool) -> Array:
  """Scores as every ranking compares them: unchanged (invariant=False: the references'
  exact order), or rounded to `RANK_GRID` (invariant=True; -inf stays -inf).

  `invariant` is a static Python bool. Rank with a stable descending sort / first-max argmax
  on these, so equal scores go to the lowest slot; rounded, the order is the same for a row
  alone, in a batch and on a mesh.
  """
  if not isinstance(invariant, (bool, np.bool_)):
    raise TypeError(f"invariant must be a static Python bool (the batch_invariant option), "
                    f"got {invariant!r}.")
  if not invariant:
    return scores
  return jnp.where(jnp.isfinite(scores), jnp.round(scores / RANK_GRID) * RANK_GRID, scores)


def best_mask(scores: Array, candidates: Array, *, invariant: bool = False) -> Array:
  """[..., T] bool: the top-ranked candidate (lowest slot among equal ranked scores,
  `rank_scores`) of every row that has a candidate."""
  ranked = rank_scores(jnp.where(candidates, scores, NEG_INF), invariant)
  best = jax.nn.one_hot(jnp.argmax(ranked, axis=-1), scores.shape[-1], dtype=jnp.bool_)
  return best & jnp.any(candidates, axis=-1, keepdims=True)


def top_k_mask(scores: Array, k: Array, *, invariant: bool = False) -> Array:
  """Marks the k[b] highest scores of each row ([B, T], [B] -> [B, T] bool).

  Scores are compared as `rank_scores` gives them (exact, or on the grid with `invariant`);
  ties go to the lower index (a stable descending sort). Entries at -inf are never chosen,
  so a row with fewer candidates than k commits only its candidates.
  """
  return (descending_ranks(rank_scores(scores, invariant)) < k[:, None]) & (scores > NEG_INF)


PAIRWISE_RANK_WIDTH = 256  # widest row ranked by comparing all pairs (T * T per row)


def descending_ranks(scores: Array) -> Array:
  """[..., T] -> [..., T] int32: each entry's place in a stable descending sort (equal scores
  keep slot order; NaN places after every number, as `jnp.sort` puts it).

  Rows of up to `PAIRWISE_RANK_WIDTH` count, per entry, the entries ranked before it (one
  fused pass over T * T pairs, where two sorts cost a sort thunk each); wider rows invert a
  stable argsort. The two give the same places for every entry but NaN ones, which no
  caller selects (they fail `scores > NEG_INF`)."""
  t = scores.shape[-1]
  if t > PAIRWISE_RANK_WIDTH:
    return jnp.argsort(jnp.argsort(-scores, axis=-1, stable=True), axis=-1).astype(jnp.int32)
  mine, other = scores[..., :, None], scores[..., None, :]                 # [..., T, T]
  slot = jnp.arange(t, dtype=jnp.int32)
  earlier = slot[None, :] < slot[:, None]                                  # [T, T]: j < i
  before = (other > mine) | ((other == mine) & earlier)
  return jnp.sum(before, axis=-1, dtype=jnp.int32)


def sample_order_mask(scores: Array, k: Array, temperature, rng: Array, *,
                      invariant: bool = False) -> Array:
  """Dream's `alg_temp`: picks k positions by sampling ∝ softmax(scores / T) without replacement.

  Gumbel-top-k: adding Gumbel noise to scores / T and taking the top k samples without
  replacement. temperature 0 (static or traced) is the deterministic top-k. `invariant`:
  as in `top_k_mask`.
  """
  top = lambda s: top_k_mask(s, k, invariant=invariant)

  def sampled(s):
    return top(jnp.where(s > NEG_INF, s / temperature + _gumbel(rng, s.shape), NEG_INF))
  if _is_number(temperature):
    return top(scores) if temperature == 0.0 else sampled(scores)
  return jax.lax.cond(temperature == 0.0, top, sampled, scores)


def threshold_mask(conf: Array, candidates: Array, tau, *, invariant: bool = False) -> Array:
  """Fast-dLLM/D2F threshold rule: candidates with confidence > tau, and at least the most
  confident candidate of every row that has one (`best_mask`). [B, T] -> [B, T] bool."""
  above = candidates & (jnp.where(candidates, conf, NEG_INF) > by_row(tau, conf.ndim))
  return above | best_mask(conf, candidates, invariant=invariant)


def factor_mask(conf: Array, candidates: Array, factor, *, invariant: bool = False) -> Array:
  """Fast-dLLM factor rule: sort confidences descending and commit the largest n with
  c_n >= 1 - factor / (n + 1) (n counted from 1), at least one per row with candidates;
  which n is `top_k_mask`'s choice."""
  conf = jnp.where(candidates, conf, NEG_INF)
  sorted_conf = sort_descending(conf)
  n = jnp.arange(1, conf.shape[-1] + 1, dtype=jnp.float32)
  ok = sorted_conf >= 1.0 - by_row(factor, conf.ndim) / (n + 1.0)
  # The largest n whose prefix all satisfies the rule.
  count = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
  count = jnp.maximum(count, jnp.any(candidates, axis=-1).astype(jnp.int32))
  return top_k_mask(conf, count, invariant=invariant)


def row_indices(batch: int, offset=0) -> Array:
  """[B] int32 global row indices: `offset + arange(B)` for a [] `offset` (the global index of
  row 0, e.g. a data-parallel shard's first row), or `offset` itself when it is [B] (each
  row's own index, which travels with the row when a compacted loop moves it:
  `compaction`)."""
  offset = jnp.asarray(offset, jnp.int32)
  if offset.ndim == 1:
    return offset
  return jnp.arange(batch, dtype=jnp.int32) + offset


def row_keys(rng: Array, step, batch: int, offset=0) -> Array:
  """[B] keys `fold_in(fold_in(rng, step), row)`: a row's randomness depends only on its own
  index, so padding a batch (e.g. to split it over devices) never changes the other rows.

  `offset` ([] int, may be traced) is the global index of row 0: a data-parallel shard of
  a batch passes its first row's index so its keys equal the whole batch's; a [B] `offset`
  is each row's own index (`row_indices`)."""
  step_key = jax.random.fold_in(rng, step)
  return jax.vmap(lambda r: jax.random.fold_in(step_key, r))(row_indices(batch, offset))
