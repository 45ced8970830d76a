"""Speculative decoding: a drafter proposes k tokens, an AR target verifies them in one forward.

Shape legend: B batch, P padded prompt length, G gen_length, k draft_length, V vocab,
D model width.

How it works, in full: docs/decoders.md, `decoding.speculative`.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, protocol, registry, sampling
# The distributions are re-exported: `speculative.greedy` / `.probabilities` are public.
from dllm_jax.decoding.drafters import (ar_draft, diffusion_draft, greedy, per_row,
                                       probabilities, unshifted)
from dllm_jax.models import kv_cache as kvc
from dllm_jax.models import masks
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer, project

Array = jnp.ndarray
DRAFTERS = ("ar", "d2f", "block_diffusion", "selfspec")
# Diffusion drafters whose clean tokens are causal (ids = positions), not block-causal.
CAUSAL_CONTEXT = ("selfspec",)


class VocabMismatchError(ValueError):
  """The drafter and the target do not share a tokenizer (vocabulary or special ids)."""


def check_draft_options(opts) -> None:
  """The checks speculative and self-speculative options share: gen_length, draft_length
  and the target's sampling (temperature, top_k, top_p); ValueError naming the fix."""
  if not isinstance(opts.gen_length, (int, np.integer)) or opts.gen_length <= 0:
    raise ValueError(f"gen_length must be a positive int, got {opts.gen_length!r}.")
  k = opts.draft_length
  if not isinstance(k, (int, np.integer)) or not 1 <= k <= opts.gen_length:
    raise ValueError(f"draft_length must be an int in [1, gen_length={opts.gen_length}], "
                     f"got {k!r}.")
  base.check_number("temperature", opts.temperature, low=0.0)
  if isinstance(opts.top_k, bool) or not isinstance(opts.top_k, (int, np.integer)) or \
      not 0 <= opts.top_k < 2 ** 31:
    raise ValueError(f"top_k must be an int in [0, 2**31) (0 keeps all tokens), got "
                     f"{opts.top_k!r}.")
  base.check_number("top_p", opts.top_p, low=0.0, low_open=True, high=1.0)


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
  """Options (hashable: a jit static argument; `plan` traces the target's sampling,
  `split_sampling`).

  Attributes:
    gen_length: G, the most tokens generated per row.
    drafter: "ar", "d2f", "block_diffusion" or "selfspec" (see the docs/decoders.md).
    draft_length: k, tokens drafted and verified per round (1 <= k <= G).
    draft_steps: forwards a diffusion drafter spends on a block (1..k; 0 = its default:
      1 for "d2f" and "selfspec", k for "block_diffusion"); must be 0 for "ar".
    temperature, top_k, top_p: the target's sampling, as in `ar_generate`.
    early_stop: exit once every row is done.
    batch_invariant: a diffusion drafter with draft_steps > 1 ranks its slots on
      `sampling.RANK_GRID`, so its drafts (and with them a sampled output, and the forward
      counts) are the same for a row alone and in a batch; False (default) ranks the exact
      scores. Greedy output is the target's either way.
  """
  gen_length: int = base.GEN_LENGTH
  drafter: str = "d2f"
  draft_length: int = 4
  draft_steps: int = 0
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  early_stop: bool = True
  batch_invariant: bool = False

  def __post_init__(self):
    object.__setattr__(self, "early_stop", base.check_flag("early_stop", self.early_stop))
    check_draft_options(self)
    object.__setattr__(self, "batch_invariant",
                       base.check_flag("batch_invariant", self.batch_invariant))
    if self.drafter not in DRAFTERS:
      raise ValueError(f"Unknown drafter {self.drafter!r}; use one of {DRAFTERS}.")
    k = self.draft_length
    if self.drafter == "ar" and self.draft_steps:
      raise ValueError("draft_steps applies to diffusion drafters only; an AR drafter "
                       "always spends draft_length forwards. Leave draft_steps=0.")
    if not 0 <= self.draft_steps <= k:
      raise ValueError(f"draft_steps={self.draft_steps} must lie in [1, draft_length={k}] "
                       "(or 0 for the drafter's default).")

  @property
  def steps(self) -> int:
    """Drafter forwards per block of a diffusion drafter."""
    if self.draft_steps:
      return self.draft_steps
    return self.draft_length if self.drafter == "block_diffusion" else 1


@flax.struct.dataclass
class SpeculativeStats:
  """Forward counts and acceptance. target_forwards, drafter_forwards: [] batched calls;
  rounds, drafted, accepted: [B] rounds a row was live, drafts verified, drafts accepted."""
  target_forwards: Array
  drafter_forwards: Array
  rounds: Array
  drafted: Array
  accepted: Array


@flax.struct.dataclass
class SpeculativeState:
  """Loop carry. response [B, G]; n (committed), prompt_len, pending, done, finite, stats [B].

  The target cache holds prompt + response[:n - 1] (the last committed token is fed next
  round). The AR drafter's cache holds the same, minus response[n - 2] when `pending` (the
  previous round accepted all k drafts, the last of which it never fed); a diffusion
  drafter's cache may lag further (it catches up in its next forward).
  """
  response: Array
  n: Array
  prompt_len: Array
  tcache: kvc.KVCache
  dcache: kvc.KVCache
  pending: Array
  done: Array
  finite: Array
  rounds: Array
  drafted: Array
  accepted: Array
  step: Array
  target_forwards: Array
  drafter_forwards: Array
  rng: Array
  row_offset: Array  # [] the global index of row 0 (a data shard's first row)
  # The traced options: the target's sampling ({temperature, top_k, top_p}: [] each, or [B]
  # in a serving lane's rows; `sampling_options` reads them) and row_offset.
  traced: dict | None = None


# ----------------------------------------------------------------------------- acceptance

def _leading(ok: Array) -> Array:
  """[B, k] bool -> [B] length of the all-True prefix."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify(logits: Array, drafts: Array, n_drafts: Array, keys: Array, *,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, forbid_ids=(),
           draft_probs: Array | None = None):
  """The speculative acceptance rule (see the docs/decoders.md).

  Args:
    logits: [B, k + 1, V] target logits; slot j predicts the token after draft j (slot 0:
      after the last accepted token; slot k: the bonus).
    drafts: [B, k] drafted tokens; only the first n_drafts[b] are checked.
    n_drafts: [B] int, drafts offered per row (k, or 0 for a row without a draft).
    keys: [B] PRNG keys (temperature > 0).
    temperature, top_k, top_p: numbers, or [B] arrays (one per row: a row at temperature 0
      takes the greedy rule).
    draft_probs: [B, k, V] the drafter's distribution q each draft was sampled from; None
      means a deterministic draft (q = point mass at the draft).
  Returns ([B, k + 1] tokens: the first `accepted + 1` are committed, [B] accepted drafts).
  """
  k = drafts.shape[1]
  live = jnp.arange(k)[None, :] < n_drafts[:, None]
  rows = per_row(temperature)  # [B] options: a row at temperature 0 takes the greedy rule
  if rows or temperature == 0.0:
    choice = greedy(logits, forbid_ids)
    greedy_rule = choice, _leading((drafts == choice[:, :k]) & live)
    if not rows:
      return greedy_rule
  p = probabilities(logits, temperature, top_k, top_p, forbid_ids)          # [B, k+1, V]
  q = (jax.nn.one_hot(drafts, p.shape[-1], dtype=p.dtype) if draft_probs is None
       else draft_probs.astype(p.dtype))                                     # [B, k, V]
  pick = lambda a, t: jnp.take_along_axis(a, t[..., None], axis=-1)[..., 0]
  p_d, q_d = pick(p[:, :k], drafts), pick(q, drafts)

  def row(key, p_row, q_row, p_d_row, q_d_row, live_row, drafts_row):
    k_acc, k_res = jax.random.split(key)
    u = jax.random.uniform(k_acc, (k,), jnp.float32)
    ok = (u * q_d_row < p_d_row) & live_row          # u < p/q without dividing by q
    a = _leading(ok[None])[0]
    residual = jnp.maximum(p_row[:k] - q_row, 0.0)
    rejected = a < jnp.sum(live_row)
    dist = jnp.where(rejected, residual[jnp.minimum(a, k - 1)], p_row[a])
    dist = jnp.where(jnp.sum(dist) > 0, dist, p_row[a])  # p == q exactly: never rejected
    token = jax.random.categorical(k_res, jnp.log(dist)).astype(jnp.int32)
    out = jnp.concatenate([drafts_row, drafts_row[-1:]])
    return jnp.where(jnp.arange(k + 1) == a, token, out), a

  choice, accepted = jax.vmap(row)(keys, p, q, p_d, q_d, live, drafts)
  if rows:
    zero = temperature == 0.0
    choice = jnp.where(zero[:, None], greedy_rule[0], choice)
    accepted = jnp.where(zero, greedy_rule[1], accepted)
  return choice, accepted


def row_keys(rng: Array, step, tag: int, batch: int, offset=0) -> Array:
  """[B] keys fold_in(fold_in(fold_in(rng, step), tag), row): a row's randomness depends
  only on its own global index (`offset` + its index in the batch, or a [B] `offset` of
  each row's index: `sampling.row_indices`), so batching and data shards never change it."""
  key = jax.random.fold_in(jax.random.fold_in(rng, step), tag)
  return jax.vmap(lambda r: jax.random.fold_in(key, r))(sampling.row_indices(batch, offset))


def round_keys(rng: Array, step, rounds: Array, tag: int, offset=0) -> Array:
  """[B] keys of one round. One key: `row_keys(rng, step, tag, B)`. [B] keys (one per row,
  e.g. per request: `serving.request_keys`): fold_in(fold_in(rng[b], rounds[b]), tag), the
  row's own key at its own round count, so a row decodes as it would alone with
  `rng=rng[b:b + 1]` whenever it joined the batch (the serving engine's rows)."""
  if sampling.is_row_keys(rng):
    return jax.vmap(lambda key, r: jax.random.fold_in(jax.random.fold_in(key, r), tag))(
        rng, rounds.astype(jnp.int32))
  return row_keys(rng, step, tag, rounds.shape[0], offset)


def commit(cfg: ModelConfig, response: Array, n: Array, done: Array, tokens: Array,
           accepted: Array):
  """Writes each live row's `accepted + 1` tokens at response[n:], cut at G and after the
  first stop token. Returns (response, [B] tokens committed, [B] new done)."""
  b, g = response.shape
  j = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
  is_stop = jnp.zeros(tokens.shape, bool)
  for s in base.stop_ids(cfg):
    is_stop = is_stop | (tokens == s)
  is_stop = is_stop & (j <= accepted[:, None])
  first_stop = jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1), tokens.shape[1])
  count = jnp.minimum(jnp.minimum(accepted + 1, first_stop + 1), g - n)
  count = jnp.where(done, 0, count)
  slots = jnp.where(j < count[:, None], n[:, None] + j, g)
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], slots.shape)
  response = response.at[rows, slots].set(tokens, mode="drop")
  stopped = first_stop < count
  return response, count, done | stopped | (n + count >= g)


# ----------------------------------------------------------------------------- checks

def check_pair(target_cfg: ModelConfig, drafter_cfg: ModelConfig) -> None:
  """Raises VocabMismatchError unless both models read the same token ids."""
  if target_cfg.vocab_size != drafter_cfg.vocab_size:
    raise VocabMismatchError(
        f"the drafter's vocabulary ({drafter_cfg.vocab_size} ids) differs from the target's "
        f"({target_cfg.vocab_size}); speculative decoding needs a drafter that shares the "
        "target's tokenizer.")
  for name in ("eos_token_id", "eot_token_id"):
    if getattr(target_cfg, name) != getattr(drafter_cfg, name):
      raise VocabMismatchError(
          f"drafter {name}={getattr(drafter_cfg, name)} differs from the target's "
          f"{getattr(target_cfg, name)}; the two models do not share a tokenizer.")


# ----------------------------------------------------------------------------- the loop

def _forbid(tcfg: ModelConfig, dcfg: ModelConfig):
  return tuple(sorted({i for i in (tcfg.mask_token_id, dcfg.mask_token_id) if i is not None}))


def _verify_and_commit(tparams, tcfg, opts, state: SpeculativeState, chunk, out_from, drafts, q,
                       keys, tcache):
  """Target forward on `chunk` (tokens, positions, valid), acceptance, commit. Also returns
  [B] whether the k + 1 logits the round read were finite."""
  tokens, positions, valid = chunk
  k = opts.draft_length
  hidden, tcache = Transformer(unshifted(tcfg)).apply(
      {"params": tparams}, tokens, block_ids=positions, positions=positions, valid=valid,
      cache=tcache, head=False)
  logits = project(tparams, tcfg, hidden[:, out_from:out_from + k + 1])
  live = ~state.done
  n_drafts = jnp.where(live, k, 0)
  temperature, top_k, top_p = sampling_options(opts, state.traced, live.shape[0])
  choice, accepted = verify(logits, drafts, n_drafts, keys, temperature=temperature,
                            top_k=top_k, top_p=top_p, forbid_ids=(tcfg.mask_token_id,),
                            draft_probs=q)
  response, count, done = commit(tcfg, state.response, state.n, state.done, choice, accepted)
  return tcache, accepted, response, count, done, jnp.isfinite(logits).all((1, 2))


# The target's sampling options, traced ([] each in a plan; [B], one per row, in a serving
# lane's rows): a sweep of temperatures > 0, top_k or top_p compiles one program, while
# temperature 0 keeps its own draw-free one (`base.ZERO_IS_STATIC`).
SAMPLING = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}


def split_sampling(opts):
  """(opts with the canonical sampling options, {temperature, top_k, top_p} [] arrays): the
  split every hybrid's `plan` makes (`base.split_options`)."""
  return base.split_options(opts, SAMPLING, {"top_k": np.int32})


def sampling_options(opts, traced: dict | None, batch: int):
  """(temperature, top_k, top_p) a round of `batch` rows samples with: [B] arrays from
  `traced` (a plan's [] value is every row's; `split_sampling`), or the static options'
  numbers where the static temperature is 0 (the greedy program, which holds no sampling) or
  `traced` holds none (options not split: one program per value)."""
  if traced is None or "temperature" not in traced or opts.temperature == 0.0:
    return opts.temperature, opts.top_k, opts.top_p
  return tuple(jnp.broadcast_to(traced[name], (batch,)) for name in SAMPLING)


def _init(tparams, dparams, prompt, valid, rng, *, tcfg, dcfg, opts: SpeculativeOptions,
          offset=0, traced: dict | None = None) -> SpeculativeState:
  """Round 0. `traced`: the traced sampling options ({temperature, top_k, top_p}: [] or [B];
  `sampling_options`), or None (the options' own)."""
  b, p = prompt.shape
  g, k = opts.gen_length, opts.draft_length
  prompt = prompt.astype(jnp.int32)
  prompt_len = valid.sum(-1, dtype=jnp.int32)
  ppos = masks.left_pad_positions(valid)
  forbid = _forbid(tcfg, dcfg)
  tcache = kvc.init_cache(tcfg, b, p + g)
  dcache = kvc.init_cache(dcfg, b, _drafter_capacity(p, opts))
  write_p = jnp.full((b,), p, jnp.int32)
  zeros = jnp.zeros((b,), jnp.int32)
  if opts.drafter == "ar":
    first = (prompt, ppos, valid, write_p, jnp.full((b,), p - 1, jnp.int32))
    drafts, q, dcache, d_ok = ar_draft(dparams, dcfg, opts, forbid, first, dcache, prompt_len,
                                       round_keys(rng, 0, zeros, 0, offset),
                                       sampling_options(opts, traced, b))
    d_forwards = k
  else:
    context = (prompt, _context_ids(opts, ppos, jnp.zeros_like(prompt)), ppos, valid,
               write_p, jnp.full((b,), p - 1, jnp.int32))
    drafts, conf, dcache = diffusion_draft(dparams, dcfg, opts, forbid, context, dcache,
                                           _context_ids(opts, prompt_len, 1), prompt_len)
    q, d_forwards, d_ok = None, opts.steps, jnp.isfinite(conf).all(-1)
  chunk = (jnp.concatenate([prompt, drafts], 1),
           jnp.concatenate([ppos, prompt_len[:, None] + jnp.arange(k, dtype=jnp.int32)], 1),
           jnp.concatenate([valid, jnp.ones((b, k), bool)], 1))
  state = SpeculativeState(
      response=jnp.full((b, g), base.output_pad_id(tcfg), jnp.int32), n=zeros,
      prompt_len=prompt_len, tcache=tcache, dcache=dcache, pending=jnp.zeros((b,), bool),
      done=jnp.zeros((b,), bool), finite=jnp.ones((b,), bool), rounds=zeros, drafted=zeros,
      accepted=zeros, step=jnp.zeros((), jnp.int32), target_forwards=jnp.zeros((), jnp.int32),
      drafter_forwards=jnp.zeros((), jnp.int32), rng=rng,
      row_offset=jnp.asarray(offset, jnp.int32), traced=traced)
  tcache, accepted, response, count, done, t_ok = _verify_and_commit(
      tparams, tcfg, opts, state, chunk, p - 1, drafts, q, round_keys(rng, 0, zeros, 1, offset),
      tcache)
  d_len = (jnp.full((b,), p, jnp.int32) + jnp.minimum(accepted, k - 1)
           if opts.drafter == "ar" else dcache.length)
  return state.replace(
      response=response, n=count, tcache=kvc.truncate(tcache, p + accepted),
      dcache=kvc.truncate(dcache, d_len), pending=(accepted == k) & (opts.drafter == "ar"),
      done=done, finite=d_ok & t_ok, rounds=jnp.ones((b,), jnp.int32),
      drafted=jnp.full((b,), k, jnp.int32),
      accepted=accepted, step=jnp.ones((), jnp.int32), target_forwards=jnp.ones((), jnp.int32),
      drafter_forwards=jnp.asarray(d_forwards, jnp.int32))


def _context_ids(opts: SpeculativeOptions, positions, block_causal):
  """A diffusion drafter's block ids: its positions for a causal-context drafter
  (CAUSAL_CONTEXT: the prompt causal too, the mask block at its first slot's position),
  else the block-causal layout's ids (prompt 0, response token j 1 + j, the block 1 + n)."""
  ids = positions if opts.drafter in CAUSAL_CONTEXT else block_causal
  return jnp.broadcast_to(jnp.asarray(ids, jnp.int32), jnp.shape(positions))


def _drafter_capacity(p: int, opts: SpeculativeOptions) -> int:
  """Slots of the drafter's cache: P + G, or a diffusion drafter's widest chunk if larger."""
  width = 2 * opts.draft_length + 1 if opts.drafter != "ar" else 2
  return max(p + opts.gen_length, width)


def _step(tparams, dparams, state: SpeculativeState, *, tcfg, dcfg, opts: SpeculativeOptions) -> SpeculativeState:
  b, g = state.response.shape
  k = opts.draft_length
  forbid = _forbid(tcfg, dcfg)
  live = ~state.done
  n = jnp.maximum(state.n, 1)
  last_idx = n - 1
  take = lambda idx: jnp.take_along_axis(state.response, jnp.clip(idx, 0, g - 1), axis=1)
  last = take(last_idx[:, None])[:, 0]
  last_pos = state.prompt_len + last_idx
  d0 = state.dcache.length
  if opts.drafter == "ar":
    prev = take((last_idx - 1)[:, None])[:, 0]
    pend = state.pending & live
    tokens = jnp.where(pend[:, None], jnp.stack([prev, last], 1), jnp.stack([last, last], 1))
    positions = jnp.where(pend[:, None], jnp.stack([last_pos - 1, last_pos], 1),
                          jnp.stack([last_pos, last_pos], 1))
    valid = jnp.stack([jnp.ones((b,), bool), pend], 1)
    write = 1 + pend.astype(jnp.int32)
    first = (tokens, positions, valid, write, pend.astype(jnp.int32))
    drafts, q, dcache, d_ok = ar_draft(dparams, dcfg, opts, forbid, first, state.dcache,
                                       last_pos + 1,
                                       round_keys(state.rng, state.step, state.rounds, 0, state.row_offset),
                                       sampling_options(opts, state.traced, b))
    d_forwards = k
  else:
    p = state.tcache.capacity - g
    cached = d0 - p                                              # response tokens in dcache
    j = cached[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
    valid = (j < state.n[:, None]) & live[:, None]
    write = jnp.where(live, state.n - cached, 0)
    pos = state.prompt_len[:, None] + j
    context = (take(j), _context_ids(opts, pos, 1 + j), pos, valid, write,
               jnp.maximum(write - 1, 0))
    block_pos = state.prompt_len + state.n
    drafts, conf, dcache = diffusion_draft(dparams, dcfg, opts, forbid, context, state.dcache,
                                           _context_ids(opts, block_pos, 1 + state.n),
                                           block_pos)
    q, d_forwards, d_ok = None, opts.steps, jnp.isfinite(conf).all(-1)
  chunk_pos = last_pos[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
  chunk = (jnp.concatenate([last[:, None], drafts], 1), chunk_pos,
           jnp.broadcast_to(live[:, None], (b, k + 1)))
  t0 = state.tcache.length
  tcache, accepted, response, count, done, t_ok = _verify_and_commit(
      tparams, tcfg, opts, state, chunk, 0, drafts, q,
      round_keys(state.rng, state.step, state.rounds, 1, state.row_offset), state.tcache)
  accepted = jnp.where(live, accepted, 0)
  tcache = kvc.truncate(tcache, jnp.where(live, t0 + accepted + 1, t0))
  if opts.drafter == "ar":
    d_len = jnp.where(live, d0 + write + jnp.minimum(accepted, k - 1), d0)
    pending = jnp.where(live, accepted == k, state.pending)
  else:
    d_len, pending = dcache.length, state.pending
  return state.replace(
      response=response, n=state.n + count, tcache=tcache, dcache=kvc.truncate(dcache, d_len),
      pending=pending, done=done, finite=state.finite & (d_ok & t_ok | ~live),
      rounds=state.rounds + live.astype(jnp.int32),
      drafted=state.drafted + jnp.where(live, k, 0), accepted=state.accepted + accepted,
      step=state.step + 1, target_forwards=state.target_forwards + 1,
      drafter_forwards=state.drafter_forwards + d_forwards)


def rounds_left(opts, state) -> Array:
  """The while_loop condition of a round-based hybrid (speculative, adaptive): rounds left,
  and (with early_stop) a row still decoding."""
  more = state.step < opts.gen_length
  return more & ~jnp.all(state.done) if opts.early_stop else more


def round_output(cfg: ModelConfig, opts, state) -> base.DecodeOutput:
  """The DecodeOutput of a finished round-based hybrid state: its first `n` response slots,
  cut at a stop id; nfe counts the target's and the drafter's forwards."""
  decided = jnp.arange(opts.gen_length)[None, :] < state.n[:, None]
  tokens, lengths, _ = base.finalize(state.response, decided, base.stop_ids(cfg),
                                     base.output_pad_id(cfg))
  return base.decode_output(tokens, lengths, state.target_forwards + state.drafter_forwards,
                            state.step, state.n, state.done, state.finite,
                            base.output_pad_id(cfg))


def output(cfg: ModelConfig, opts: SpeculativeOptions, state: SpeculativeState):
  """(base.DecodeOutput, SpeculativeStats) of a finished state."""
  out = round_output(cfg, opts, state)
  stats = SpeculativeStats(target_forwards=state.target_forwards,
                    drafter_forwards=state.drafter_forwards, rounds=state.rounds,
                    drafted=state.drafted, accepted=state.accepted)
  return out, stats


# ----------------------------------------------------------------------------- the decoder

class RoundDecoder(protocol.Decoder):
  """A hybrid: each round commits a prefix of `n` tokens per row, and its module's
  `output(cfg, opts, state)` gives (DecodeOutput, stats) (speculative, selfspec, adaptive).
  The target's sampling (temperature, top_k, top_p) is traced (`split_sampling`): one program
  for every temperature > 0, and served, one lane's rows each sample with their own."""
  finish = None  # the module's output function, a staticmethod

  def running(self, state):
    return rounds_left(self.opts, state)

  def view(self, state):
    return state.response, jnp.arange(self.gen_length)[None, :] < state.n[:, None]

  def output(self, state):
    return self.finish(self.cfg, self.opts, state)[0]

  def stats(self, state):
    return self.finish(self.cfg, self.opts, state)[1]


class DraftedDecoder(RoundDecoder):
  """A round-based hybrid of an AR target and a drafter (speculative, adaptive): served, the
  drafter is a lane option and each row has a target cache `tcache` ([L, B, P + G, K, Dh])
  and a drafter cache `dcache`, both holding the prompt in their first p slots."""
  lane_options = ("drafter_params", "drafter_cfg")
  cache_fields = ("tcache", "dcache")

  def drafter_capacity(self, prompt_len: int) -> int:
    """The drafter cache's slots at prompt width `prompt_len`."""
    raise NotImplementedError

  def check_window(self, prompt_len: int) -> None:
    base.check_window(self.cfg, prompt_len, self.gen_length)
    base.check_window(self.drafter_cfg, prompt_len, self.gen_length)
    check_drafter_capacity(self.drafter_cfg, self.opts, self.drafter_capacity(prompt_len))

  def pad(self, state, prompt_len):
    # Both caches hold the prompt first: prepend empty slots (positions are the row's own).
    g = self.gen_length
    extra = prompt_len - (state.tcache.capacity - g)
    return state.replace(
        tcache=protocol.prepend_cache_slots(state.tcache, extra, prompt_len + g),
        dcache=protocol.prepend_cache_slots(state.dcache, extra,
                                            self.drafter_capacity(prompt_len)))

  def abstract_params(self):
    from dllm_jax.models.transformer import abstract_params  # pylint: disable=import-outside-toplevel
    return abstract_params(self.cfg), abstract_params(self.drafter_cfg)


@dataclasses.dataclass(frozen=True)
class SpeculativeDecoder(DraftedDecoder):
  """A drafter proposes, the AR target verifies: `opts` is the `SpeculativeOptions`; the state and
  `params` hold both models ((target, drafter) params)."""
  drafter_cfg: ModelConfig = None

  finish = staticmethod(output)
  init_forwards = True   # the init runs round 0 (drafts and the verifying prefill)
  uses_drafter = True
  attention = "causal"
  drafter_attention = "block_causal"   # the default drafter, "d2f"

  @classmethod
  def option_names(cls) -> tuple[str, ...]:
    return ("drafter_params", "drafter_cfg") + tuple(
        f.name for f in dataclasses.fields(SpeculativeOptions))

  @classmethod
  def plan(cls, cfg: ModelConfig, *, drafter_params=None, drafter_cfg=None,
           **options) -> protocol.Plan:
    _, static, traced = base.checked_options(SpeculativeOptions, options, split_sampling)
    check_drafter(cfg, drafter_params, drafter_cfg, cls.name or registry.name_of(cls))
    return protocol.Plan(cls(cfg, static, drafter_cfg), {"row_offset": np.int32(0), **traced},
                         drafter_params)

  def check(self, tokens, valid) -> None:
    opts, dcfg = self.opts, self.drafter_cfg
    base.check_prompts(self.cfg, tokens, valid, opts.gen_length, needs_mask=False)
    check_drafter_prompts(dcfg, tokens, valid, opts.gen_length, needs_mask=opts.drafter != "ar")
    check_drafter_capacity(dcfg, opts, _drafter_capacity(np.shape(tokens)[1], opts))

  def init(self, params, tokens, valid, rng, traced, row_inputs=None):
    return _init(*params, tokens, valid, rng, tcfg=self.cfg, dcfg=self.drafter_cfg,
                 opts=self.opts, offset=traced["row_offset"], traced=traced)

  def step(self, params, state):
    return _step(*params, state, tcfg=self.cfg, dcfg=self.drafter_cfg, opts=self.opts)

  def drafter_capacity(self, prompt_len: int) -> int:
    return _drafter_capacity(prompt_len, self.opts)

  def prompt_mask_id(self):
    # A diffusion drafter reads [MASK] as a blank; the AR target has no such id.
    return None if self.opts.drafter == "ar" else self.drafter_cfg.mask_token_id

  def forwards(self, state):
    # A row's rounds, each one target forward and the drafter's forwards (k for an AR
    # drafter, `steps` for a diffusion one), as a one-row decode counts.
    per_round = self.opts.draft_length if self.opts.drafter == "ar" else self.opts.steps
    return state.rounds * (1 + per_round)


def check_drafter(target_cfg: ModelConfig, drafter_params, drafter_cfg, method: str,
                  drafter: str = "a drafter",
                  kinds: str = "a small AR model, or a D2F / block-diffusion model") -> None:
  """Raises ValueError unless a drafter is given and shares the target's tokenizer;
  `drafter` and `kinds` say what the method drafts with."""
  if drafter_params is None or drafter_cfg is None:
    raise ValueError(f"{method} decoding needs {drafter}: pass drafter_params and drafter_cfg "
                     f"({kinds}, sharing the target's tokenizer; Sampler.load(..., "
                     "drafter_model=<dir>) loads one).")
  check_pair(target_cfg, drafter_cfg)


def check_drafter_prompts(dcfg: ModelConfig, tokens, valid, gen_length: int, *,
                          needs_mask: bool) -> None:
  """The drafter's prompt checks beyond the target's (`base.check_prompts` ran on the
  target, and `check_pair` made the two vocabularies equal): its window and, for a diffusion
  drafter, mask ids."""
  base.check_window(dcfg, np.shape(tokens)[1], gen_length)
  if needs_mask:
    base.check_mask_free(dcfg, tokens, valid)


def check_drafter_capacity(dcfg: ModelConfig, opts, capacity: int) -> None:
  """Raises ValueError if the drafter's cache (`capacity` slots at this prompt width: the
  widest chunk, 2k + 1, where that exceeds P + G) does not fit its window."""
  if capacity > dcfg.max_seq_len:
    raise ValueError(f"a diffusion drafter forwards 2 * draft_length + 1 = "
                     f"{2 * opts.draft_length + 1} slots, more than its window max_seq_len="
                     f"{dcfg.max_seq_len}; lower draft_length.")


# ----------------------------------------------------------------------------- public API

def speculative_generate(target_params, target_cfg: ModelConfig, prompt_tokens,
                         prompt_valid=None, rng=None, *, on_nonfinite: str = "raise",
                         return_stats: bool = False, **options):
  """Speculative decoding of a left-padded prompt batch: drafter proposes, AR target verifies.

  Args:
    target_params, target_cfg: the AR (causal) target model.
    prompt_tokens, prompt_valid: [B, P] left-padded prompts (`base.pad_prompts`); valid None
      means no padding.
    rng: PRNG key (temperature > 0; default key 0), or [B] keys, one per row (row b's
      round i draws from fold_in(rng[b], i): it decodes as alone with rng[b:b + 1], the
      serving engine's per-request keys; `round_keys`).
    on_nonfinite: "raise" (NonFiniteLogitsError naming the rows for which a forward of
      either model gave NaN/inf logits) or "flag" (return them with `finite` False,
      lengths 0).
    return_stats: also return a `SpeculativeStats` (target / drafter forwards, per-row acceptance).
    **options: `drafter_params`, `drafter_cfg` (the drafter, required: it must share the
      target's tokenizer, VocabMismatchError otherwise; a diffusion drafter needs a
      mask_token_id) and the fields of `SpeculativeOptions` (drafter kind, draft_length,
      draft_steps, the target's temperature / top_k / top_p, ...).
  Returns:
    base.DecodeOutput (nfe = target + drafter forwards; steps = rounds), and the SpeculativeStats
    when return_stats.
  """
  return protocol.decode_batch(SpeculativeDecoder, target_params, target_cfg, prompt_tokens,
                               prompt_valid, rng, on_nonfinite=on_nonfinite,
                               with_stats=return_stats, **options)
