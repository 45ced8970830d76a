"""Drafters for speculative decoding, and the token distributions drafts and checks share.

Shape legend: B batch, T forwarded context slots, k draft_length, V vocab, D model width.

How it works, in full: docs/decoders.md, `decoding.drafters`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.decoding import sampling
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer, project

Array = jnp.ndarray
NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------- distributions

def per_row(temperature) -> bool:
  """True for sampling options given one per row ([B] arrays), False for static numbers."""
  return jnp.ndim(temperature) == 1


def _filtered_rows(logits: Array, temperature, top_k, top_p) -> Array:
  """`filtered_logits` with [B] options ([B, ..., V] logits): the same k-th largest and
  nucleus cutoffs, found by one sort; a row at temperature 0 is left unscaled (its greedy
  choice is taken elsewhere)."""
  v, n = logits.shape[-1], logits.ndim
  sorted_logits = sampling.sort_descending(logits)
  k = jnp.broadcast_to(sampling.by_row(top_k, n), logits.shape[:-1] + (1,))
  kth = jnp.take_along_axis(sorted_logits, jnp.clip(k - 1, 0, v - 1), axis=-1)
  logits = jnp.where((k <= 0) | (k >= v) | (logits >= kth), logits, NEG_INF)
  top_p = sampling.by_row(top_p, n)
  sorted_logits = sampling.sort_descending(logits)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  cutoff_idx = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True) - 1
  cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
  logits = jnp.where((top_p >= 1.0) | (logits >= cutoff), logits, NEG_INF)
  t = sampling.by_row(temperature, n)
  return logits / jnp.where(t == 0.0, 1.0, t)


def filtered_logits(logits: Array, temperature: float, top_k: int, top_p: float,
              forbid_ids) -> Array:
  """Logits of the distribution `ar_generate` samples ([..., V]); greedy: the argmax's."""
  ids = [i for i in forbid_ids if i is not None]
  if ids:
    logits = logits.at[..., jnp.asarray(sorted(set(ids)))].set(NEG_INF)
  if per_row(temperature):
    return _filtered_rows(logits, temperature, top_k, top_p)
  if temperature == 0.0:
    return logits
  if top_k and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, NEG_INF, logits)
  if top_p < 1.0:
    sorted_logits = sampling.sort_descending(logits)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cutoff_idx = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
    logits = jnp.where(logits < cutoff, NEG_INF, logits)
  return logits / temperature


def probabilities(logits: Array, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  forbid_ids=()) -> Array:
  """[..., V] logits -> the sampling distribution of `ar_generate` (float32, temperature > 0)."""
  return jax.nn.softmax(filtered_logits(logits.astype(jnp.float32), temperature, top_k, top_p,
                                  forbid_ids), axis=-1)


def greedy(logits: Array, forbid_ids=()) -> Array:
  """[..., V] -> [...] argmax with `forbid_ids` excluded (first index on ties, like AR)."""
  return jnp.argmax(filtered_logits(logits, 0.0, 0, 1.0, forbid_ids), axis=-1).astype(jnp.int32)


def unshifted(cfg: ModelConfig) -> ModelConfig:
  """Causal chunks: the raw output at slot t predicts t + 1 (Dream's shift only re-indexes)."""
  return cfg.replace(shift_logits=False) if cfg.shift_logits else cfg


# ----------------------------------------------------------------------------- drafters

def ar_draft(dparams, cfg: ModelConfig, opts, forbid, first_chunk, cache, next_pos, keys,
             sampling_options=None):
  """k drafts from a causal drafter: one forward on `first_chunk`, then k - 1 single tokens.

  first_chunk: (tokens [B, T], positions [B, T], valid [B, T], write_len [B], out_slot [B]):
  out_slot is the slot whose logits predict draft 1. next_pos [B]: position of draft 1.
  opts: anything with draft_length, temperature, top_k, top_p (`speculative.SpeculativeOptions`);
  `sampling_options` (temperature, top_k, top_p), when given, replace its sampling ones
  (numbers, or [B] arrays: one per row).
  Returns ([B, k] drafts, [B, k, V] q or None, cache, [B] bool: every logit the drafts were
  chosen from was finite).
  """
  model = Transformer(unshifted(cfg))
  tokens, positions, valid, write_len, out_slot = first_chunk
  hidden, cache = model.apply({"params": dparams}, tokens, block_ids=positions,
                              positions=positions, valid=valid, cache=cache,
                              write_len=write_len, head=False)
  logits = project(dparams, cfg, hidden, out_slot[:, None])[:, 0]

  temperature, top_k, top_p = sampling_options or (opts.temperature, opts.top_k, opts.top_p)

  def choose(logits, i):
    if not per_row(temperature) and temperature == 0.0:
      return greedy(logits, forbid), None
    q = probabilities(logits, temperature, top_k, top_p, forbid)
    d = jax.vmap(lambda kk, qq: jax.random.categorical(jax.random.fold_in(kk, i), jnp.log(qq)))(
        keys, q).astype(jnp.int32)
    if per_row(temperature):
      d = jnp.where(temperature == 0.0, greedy(logits, forbid), d)
    return d, q

  first, q0 = choose(logits, 0)
  finite = jnp.isfinite(logits).all(-1)

  def one(carry, i):
    cache, token, ok = carry
    pos = (next_pos + i - 1)[:, None]
    lg, cache = model.apply({"params": dparams}, token[:, None], block_ids=pos, positions=pos,
                            cache=cache, write_len=1)
    d, q = choose(lg[:, 0], i)
    return (cache, d, ok & jnp.isfinite(lg[:, 0]).all(-1)), (d, q)

  if opts.draft_length == 1:
    drafts, qs = first[:, None], (None if q0 is None else q0[:, None])
    return drafts, qs, cache, finite
  (cache, _, finite), (rest, rest_q) = jax.lax.scan(one, (cache, first, finite),
                                                    jnp.arange(1, opts.draft_length))
  drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
  qs = None if q0 is None else jnp.concatenate([q0[:, None], rest_q.transpose(1, 0, 2)], 1)
  return drafts, qs, cache, finite


def diffusion_draft(dparams, cfg: ModelConfig, opts, forbid, context, cache,
                    block_id, block_pos):
  """k drafts from a block-causal diffusion drafter in `opts.steps` forwards.

  context: (tokens [B, T], ids [B, T], positions [B, T], valid [B, T], write_len [B],
  last_slot [B]) clean tokens forwarded (and written) in front of the block; last_slot is the
  last valid one (shifted-logits models read the prediction for block slot 0 there).
  block_id [B]: the block's shared id; block_pos [B]: position of block slot 0.
  opts: anything with `draft_length` (k) and `steps` (forwards, 1..k); its
  `batch_invariant` (default False) ranks on the grid (`sampling.rank_scores`).
  Returns ([B, k] drafts, [B, k] float32 confidence: each slot's top probability at the
  forward that committed it, cache with the context written).
  """
  k, steps, mask_id = opts.draft_length, opts.steps, cfg.mask_token_id
  tokens, ids, positions, valid, write_len, last_slot = context
  t = tokens.shape[1]
  b = tokens.shape[0]
  bids = jnp.broadcast_to(block_id[:, None], (b, k)).astype(jnp.int32)
  bpos = block_pos[:, None] + jnp.arange(k, dtype=jnp.int32)[None]
  model = Transformer(cfg)
  hidden, cache = model.apply(
      {"params": dparams}, jnp.concatenate([tokens, jnp.full((b, k), mask_id, jnp.int32)], 1),
      block_ids=jnp.concatenate([ids, bids], 1), positions=jnp.concatenate([positions, bpos], 1),
      valid=jnp.concatenate([valid, jnp.ones((b, k), bool)], 1), cache=cache,
      write_len=write_len, head=False)
  before = hidden[jnp.arange(b), last_slot][:, None]                        # [B, 1, D]

  def block_logits(block_hidden):  # [B, k, D] -> [B, k, V]: the prediction for each slot
    if cfg.shift_logits:
      block_hidden = jnp.concatenate([before, block_hidden[:, :-1]], axis=1)
    return project(dparams, cfg, block_hidden)

  block = jnp.full((b, k), mask_id, jnp.int32)
  decided = jnp.zeros((b, k), bool)
  confidence = jnp.zeros((b, k), jnp.float32)
  logits = block_logits(hidden[:, t:])
  for i in range(steps):
    if i:
      h = model.apply({"params": dparams}, block, block_ids=bids, positions=bpos, cache=cache,
                      write_len=0, head=False)[0]
      logits = block_logits(h)
    x0 = greedy(logits, forbid)
    conf = jnp.max(jax.nn.softmax(filtered_logits(logits, 0.0, 0, 1.0, forbid), -1), -1)
    count = k // steps + (i < k % steps)
    score = jnp.where(decided, NEG_INF, conf)
    ranked = sampling.rank_scores(score, getattr(opts, "batch_invariant", False))
    ranks = jnp.argsort(jnp.argsort(-ranked, axis=-1, stable=True), axis=-1)
    chosen = (ranks < count) & ~decided if i < steps - 1 else ~decided
    block = jnp.where(chosen, x0, block)
    confidence = jnp.where(chosen, conf.astype(jnp.float32), confidence)
    decided = decided | chosen
  return block, confidence, cache
