"""Task-adaptive decoding: per row and per round, commit a D2F draft in parallel, verify it
with the AR model, or decode plain AR.

Shape legend: B batch, P padded prompt length, G gen_length (also the most rounds), k
draft_length, V vocab.

How it works, in full: docs/decoders.md, `decoding.adaptive`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import ar as ar_lib
from dllm_jax.decoding import base, protocol, registry
# The modes and options live in their own module; re-exported here, where callers read them.
from dllm_jax.decoding.adaptive_options import (  # noqa: F401
    AR, MODE_CODES, NO_ROUND, PARALLEL, TAG_MODES, THRESHOLDS, VERIFY, AdaptiveOptions)
from dllm_jax.decoding import speculative as spec
from dllm_jax.decoding.drafters import diffusion_draft, unshifted
from dllm_jax.models import kv_cache as kvc
from dllm_jax.models import masks
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer, project

Array = jnp.ndarray
# What adaptive decoding drafts with (its PARALLEL rounds commit a diffusion block).
DRAFTER = ("a diffusion drafter", "a D2F student or block-diffusion model")


# ----------------------------------------------------------------------------- the rule

def initial_mode(confidence: Array, forced: Array, traced) -> Array:
  """[B] round-0 mode from [B] c0 (the drafter's first-block mean confidence)."""
  mode = jnp.where(confidence < traced["ar_confidence"], AR,
                   jnp.where(confidence >= traced["parallel_confidence"], PARALLEL, VERIFY))
  return jnp.where(forced >= 0, forced, mode).astype(jnp.int32)


def next_mode(mode: Array, forced: Array, drafted: Array, accepted: Array, streak: Array,
              traced) -> Array:
  """[B] mode for the next round, after a round's acceptance counts are added."""
  free = (mode == VERIFY) & (forced < 0)
  low = accepted.astype(jnp.float32) < traced["min_acceptance"] * drafted.astype(jnp.float32)
  trusted = (traced["trust_streak"] > 0) & (streak >= traced["trust_streak"])
  return jnp.where(free & low, AR, jnp.where(free & trusted, PARALLEL, mode)).astype(jnp.int32)


# ----------------------------------------------------------------------------- records

@flax.struct.dataclass
class AdaptiveOutput(base.DecodeOutput):
  """`base.DecodeOutput` plus the modes used (codes in the docs/decoders.md).

  modes: [B] the row's round-0 mode (the per-request decision).
  round_modes: [B, G] the mode of each round (round r = loop iteration r), -1 after the row
    finished."""
  modes: Array | None = None
  round_modes: Array | None = None

  ROW_FIELDS = ("modes", "round_modes")


@flax.struct.dataclass
class AdaptiveStats:
  """target_forwards, drafter_forwards: [] batched calls run. first_confidence: [B] c0.
  round_confidence: [B, G] mean drafter confidence of the round's draft (NaN where the row
  used no draft). round_accepted: [B, G] drafts accepted in a VERIFY round (-1 otherwise).
  round_committed: [B, G] tokens committed. drafted, accepted: [B] totals over VERIFY rounds."""
  target_forwards: Array
  drafter_forwards: Array
  first_confidence: Array
  round_confidence: Array
  round_accepted: Array
  round_committed: Array
  drafted: Array
  accepted: Array


@flax.struct.dataclass
class AdaptiveState:
  """Loop carry: response [B, G]; n, prompt_len, mode, forced, drafted, accepted, streak,
  done, finite, rounds (rounds the row was live), forwards (the forwards a one-row decode of
  the row counts: its target forwards + its drafter's) [B]; the per-round records [B, G],
  column i the row's own round i; both caches (see speculative.SpeculativeState); traced, the
  rule's thresholds and the target's sampling options (`spec.sampling_options`) ({name: []};
  a serving lane's rows: {name: [B]})."""
  response: Array
  n: Array
  prompt_len: Array
  tcache: kvc.KVCache
  dcache: kvc.KVCache
  mode: Array
  forced: Array
  drafted: Array
  accepted: Array
  streak: Array
  done: Array
  finite: Array
  first_confidence: Array
  round_modes: Array
  round_confidence: Array
  round_accepted: Array
  round_committed: Array
  rounds: Array
  forwards: Array
  step: Array
  target_forwards: Array
  drafter_forwards: Array
  rng: Array
  traced: dict


# ----------------------------------------------------------------------------- one round

def _forbid(tcfg: ModelConfig, dcfg: ModelConfig):
  return tuple(sorted({i for i in (tcfg.mask_token_id, dcfg.mask_token_id) if i is not None}))


def _target(tparams, tcfg, k, chunk, out_from, tcache):
  """One causal target forward over `chunk` -> ([B, k + 1, V] logits from out_from, cache);
  a chunk narrower than out_from + k + 1 repeats its one logit slot (AR rows read slot 0)."""
  tokens, positions, valid = chunk
  hidden, tcache = Transformer(unshifted(tcfg)).apply(
      {"params": tparams}, tokens, block_ids=positions, positions=positions, valid=valid,
      cache=tcache, head=False)
  logits = project(tparams, tcfg, hidden[:, out_from:out_from + k + 1]).astype(jnp.float32)
  if logits.shape[1] < k + 1:
    logits = jnp.broadcast_to(logits[:, :1], (logits.shape[0], k + 1, logits.shape[2]))
  return logits, tcache


def _round(state: AdaptiveState, mode, drafts, conf, logits, tcache, dcache, t_keep,
           *, tcfg, opts, ran_target, ran_drafter, first: bool) -> AdaptiveState:
  """Commits one round: the row's mode picks the draft (PARALLEL) or the target's verdict
  (VERIFY, AR); updates caches, counts, records and the next mode."""
  b, g = state.response.shape
  k = opts.draft_length
  live = ~state.done
  verifying = live & (mode == VERIFY)
  n_drafts = jnp.where(verifying, k, 0)
  keys = spec.round_keys(state.rng, state.step, state.rounds, 1,
                         state.traced.get("row_offset", 0))
  temperature, top_k, top_p = spec.sampling_options(opts, state.traced, b)
  choice, a = spec.verify(logits, drafts, n_drafts, keys, temperature=temperature,
                          top_k=top_k, top_p=top_p, forbid_ids=(tcfg.mask_token_id,))
  parallel = mode == PARALLEL
  tokens = jnp.where(parallel[:, None], jnp.concatenate([drafts, drafts[:, -1:]], 1), choice)
  acc = jnp.where(parallel, k - 1, jnp.where(verifying, a, 0))
  response, count, done = spec.commit(tcfg, state.response, state.n, state.done, tokens, acc)
  used_target = live & ~parallel
  tcache = kvc.truncate(tcache, jnp.where(used_target, t_keep + acc + (0 if first else 1),
                                          tcache.length if first else t_keep))
  # Finite: the logits a row's commit (or its mode decision) read.
  slots_ok = jnp.isfinite(logits).all(-1)                                    # [B, k + 1]
  target_ok = jnp.where(verifying, slots_ok.all(-1), slots_ok[:, 0])
  finite = state.finite & jnp.where(used_target, target_ok, True)
  drafter_ok = jnp.isfinite(conf).all(-1)
  finite = finite & jnp.where(live & (mode != AR) | (first & (state.forced != AR)),
                              drafter_ok, True)
  a_v = jnp.where(verifying, a, 0)
  drafted = state.drafted + n_drafts
  accepted = state.accepted + a_v
  streak = jnp.where(verifying, jnp.where(a == k, state.streak + 1, 0), state.streak)
  new_mode = jnp.where(live, next_mode(mode, state.forced, drafted, accepted, streak,
                                       state.traced),
                       mode)
  c = jnp.mean(conf, -1)
  s = state.step
  # Column: the row's own round (= s for rows that started together; a done row rewrites
  # its first idle column with the idle values it already holds).
  rec = lambda arr, val: arr.at[jnp.arange(b), state.rounds].set(val.astype(arr.dtype),
                                                                mode="drop")
  # The forwards this row alone would have run: the drafter's where it drafted (round 0: any
  # row not tagged AR drafts, for its c0), the target's where it did not commit in parallel.
  drafted_row = (state.forced != AR) if first else (live & (mode != AR))
  row_forwards = used_target.astype(jnp.int32) + jnp.where(drafted_row, opts.steps, 0)
  return state.replace(
      response=response, n=state.n + count, tcache=tcache, dcache=dcache, mode=new_mode,
      drafted=drafted, accepted=accepted, streak=streak, done=done, finite=finite,
      round_modes=rec(state.round_modes, jnp.where(live, mode, NO_ROUND)),
      round_confidence=rec(state.round_confidence,
                           jnp.where(live & (mode != AR), c, jnp.nan)),
      round_accepted=rec(state.round_accepted, jnp.where(verifying, a, -1)),
      round_committed=rec(state.round_committed, count),
      rounds=state.rounds + live.astype(jnp.int32), forwards=state.forwards + row_forwards,
      step=s + 1, target_forwards=state.target_forwards + ran_target.astype(jnp.int32),
      drafter_forwards=state.drafter_forwards + jnp.where(ran_drafter, opts.steps, 0))


def _no_draft(b, k, dcache):
  return jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32), dcache


def _init(tparams, dparams, prompt, valid, forced, rng, traced, *, tcfg, dcfg,
          opts: AdaptiveOptions) -> AdaptiveState:
  b, p = prompt.shape
  g, k = opts.gen_length, opts.draft_length
  prompt = prompt.astype(jnp.int32)
  prompt_len = valid.sum(-1, dtype=jnp.int32)
  ppos = masks.left_pad_positions(valid)
  forbid = _forbid(tcfg, dcfg)
  dcache = kvc.init_cache(dcfg, b, drafter_capacity(p, opts))
  context = (prompt, jnp.zeros_like(prompt), ppos, valid, jnp.full((b,), p, jnp.int32),
             jnp.full((b,), p - 1, jnp.int32))
  ran_drafter = jnp.any(forced != AR)
  drafts, conf, dcache = jax.lax.cond(
      ran_drafter,
      lambda c: diffusion_draft(dparams, dcfg, opts, forbid, context, c,
                                jnp.ones((b,), jnp.int32), prompt_len),
      functools.partial(_no_draft, b, k), dcache)
  c0 = jnp.mean(conf, -1)
  mode = initial_mode(c0, forced, traced)
  ran_target = jnp.any(mode != PARALLEL)
  chunk = (jnp.concatenate([prompt, drafts], 1),
           jnp.concatenate([ppos, prompt_len[:, None] + jnp.arange(k, dtype=jnp.int32)], 1),
           jnp.concatenate([valid, jnp.ones((b, k), bool)], 1))
  prompt_only = tuple(x[:, :p] for x in chunk)  # AR rows read slot p - 1 only
  tcache = kvc.init_cache(tcfg, b, p + g)
  branch = jnp.where(jnp.any(mode == VERIFY), 2, jnp.where(ran_target, 1, 0))
  logits, tcache = jax.lax.switch(branch, [
      lambda c: (jnp.zeros((b, k + 1, tcfg.vocab_size), jnp.float32), c),
      lambda c: _target(tparams, tcfg, k, prompt_only, p - 1, c),
      lambda c: _target(tparams, tcfg, k, chunk, p - 1, c)], tcache)
  zeros = jnp.zeros((b,), jnp.int32)
  state = AdaptiveState(
      response=jnp.full((b, g), base.output_pad_id(tcfg), jnp.int32), n=zeros,
      prompt_len=prompt_len, tcache=tcache, dcache=dcache, mode=mode, forced=forced,
      drafted=zeros, accepted=zeros, streak=zeros, done=jnp.zeros((b,), bool),
      finite=jnp.ones((b,), bool), first_confidence=jnp.where(ran_drafter, c0, jnp.nan),
      round_modes=jnp.full((b, g), NO_ROUND, jnp.int32),
      round_confidence=jnp.full((b, g), jnp.nan, jnp.float32),
      round_accepted=jnp.full((b, g), -1, jnp.int32), round_committed=jnp.zeros((b, g),
                                                                                jnp.int32),
      rounds=zeros, forwards=zeros, step=jnp.zeros((), jnp.int32),
      target_forwards=jnp.zeros((), jnp.int32), drafter_forwards=jnp.zeros((), jnp.int32),
      rng=rng, traced=traced)
  return _round(state, mode, drafts, conf, logits, tcache, dcache, jnp.full((b,), p, jnp.int32),
                tcfg=tcfg, opts=opts, ran_target=ran_target, ran_drafter=ran_drafter,
                first=True)


def drafter_capacity(p: int, opts) -> int:
  """Slots of the drafter's cache: P + G, or its widest chunk (2k + 1) if larger."""
  return max(p + opts.gen_length, 2 * opts.draft_length + 1)


def _step(tparams, dparams, state: AdaptiveState, *, tcfg, dcfg,
          opts: AdaptiveOptions, only_ar: bool = False) -> AdaptiveState:
  """One round. `only_ar` (static): every live row decodes AR, so the round is the target's
  one-slot forward with no conditional around it (the same computation as the general round
  takes for such a batch; `_generate` switches to it once no live row needs the drafter)."""
  b, g = state.response.shape
  k = opts.draft_length
  live, mode = ~state.done, state.mode
  n = jnp.maximum(state.n, 1)
  take = lambda idx: jnp.take_along_axis(state.response, jnp.clip(idx, 0, g - 1), axis=1)
  last = take((n - 1)[:, None])[:, 0]
  last_pos = state.prompt_len + n - 1
  if only_ar:
    targeted = live & (mode == AR)
    narrow = (last[:, None], last_pos[:, None], targeted[:, None])
    drafts, conf, dcache = _no_draft(b, k, state.dcache)
    t0 = state.tcache.length
    logits, tcache = _target(tparams, tcfg, k, narrow, 0, state.tcache)
    return _round(state, mode, drafts, conf, logits, tcache, dcache, t0, tcfg=tcfg,
                  opts=opts, ran_target=jnp.any(targeted), ran_drafter=jnp.zeros((), bool),
                  first=False)

  # Drafter: rows in PARALLEL / VERIFY feed their committed-but-uncached tokens (<= k + 1).
  drafting = live & (mode != AR)
  ran_drafter = jnp.any(drafting)
  p = state.tcache.capacity - g
  cached = state.dcache.length - p
  j = cached[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
  write = jnp.where(drafting, state.n - cached, 0)
  context = (take(j), 1 + j, state.prompt_len[:, None] + j,
             (j < state.n[:, None]) & drafting[:, None], write, jnp.maximum(write - 1, 0))
  drafts, conf, dcache = jax.lax.cond(
      ran_drafter,
      lambda c: diffusion_draft(dparams, dcfg, opts, _forbid(tcfg, dcfg), context, c,
                                1 + state.n, state.prompt_len + state.n),
      functools.partial(_no_draft, b, k), state.dcache)

  # Target: rows in VERIFY / AR; one slot wide when no row verifies.
  targeted = live & (mode != PARALLEL)
  chunk = (jnp.concatenate([last[:, None], drafts], 1),
           last_pos[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None],
           jnp.broadcast_to(targeted[:, None], (b, k + 1)))
  narrow = tuple(x[:, :1] for x in chunk)
  branch = jnp.where(jnp.any(live & (mode == VERIFY)), 2, jnp.where(jnp.any(targeted), 1, 0))
  t0 = state.tcache.length
  logits, tcache = jax.lax.switch(branch, [
      lambda c: (jnp.zeros((b, k + 1, tcfg.vocab_size), jnp.float32), c),
      lambda c: _target(tparams, tcfg, k, narrow, 0, c),
      lambda c: _target(tparams, tcfg, k, chunk, 0, c)], state.tcache)
  return _round(state, mode, drafts, conf, logits, tcache, dcache, t0, tcfg=tcfg,
                opts=opts, ran_target=branch > 0, ran_drafter=ran_drafter, first=False)


def output(cfg: ModelConfig, opts: AdaptiveOptions, state: AdaptiveState):
  """(AdaptiveOutput, AdaptiveStats) of a finished state."""
  out = spec.round_output(cfg, opts, state)
  out = AdaptiveOutput(**{f.name: getattr(out, f.name) for f in dataclasses.fields(out)},
                       modes=state.round_modes[:, 0], round_modes=state.round_modes)
  stats = AdaptiveStats(
      target_forwards=state.target_forwards, drafter_forwards=state.drafter_forwards,
      first_confidence=state.first_confidence, round_confidence=state.round_confidence,
      round_accepted=state.round_accepted, round_committed=state.round_committed,
      drafted=state.drafted, accepted=state.accepted)
  return out, stats


def _rounds_output(out: base.DecodeOutput, rounds: Array, mode: int) -> AdaptiveOutput:
  """`out` as an AdaptiveOutput whose every row ran its [B] `rounds` in `mode`."""
  g = out.tokens.shape[1]
  live = jnp.arange(g)[None, :] < rounds[:, None]
  round_modes = jnp.where(live, mode, NO_ROUND).astype(jnp.int32)
  return AdaptiveOutput(**{f.name: getattr(out, f.name) for f in dataclasses.fields(out)},
                        modes=round_modes[:, 0], round_modes=round_modes)


def _plain_verify(params, tokens, valid, rng, traced, *, tcfg: ModelConfig,
                  dcfg: ModelConfig, opts: AdaptiveOptions) -> AdaptiveOutput:
  """The AdaptiveOutput of a greedy batch whose every row is forced VERIFY, decoded by the
  speculative decoder's own loop with the same drafter, k and drafter forwards per block:
  the same drafts, verdicts, tokens, forwards and rounds as the adaptive loop (whose round
  also carries the rule's branches and records)."""
  sopts = spec.SpeculativeOptions(
      gen_length=opts.gen_length, drafter="d2f", draft_length=opts.draft_length,
      draft_steps=opts.draft_steps, early_stop=opts.early_stop,
      batch_invariant=opts.batch_invariant)
  static, sampling = spec.split_sampling(sopts)
  straced = {"row_offset": traced.get("row_offset", np.int32(0)), **sampling}
  out, stats = spec.SpeculativeDecoder(tcfg, static, dcfg).decode(
      params, tokens, valid, rng, straced, with_stats=True)
  return _rounds_output(out, stats.rounds, VERIFY)


def _plain_ar(tparams, tokens, valid, rng, *, tcfg: ModelConfig, opts: AdaptiveOptions):
  """(AdaptiveOutput, AdaptiveStats) of a greedy batch whose every row is tagged AR, decoded
  by AR's own loop: the same tokens, forwards (one per round) and rounds as the adaptive
  loop; the records are those the loop writes for AR rows."""
  static, traced = ar_lib.AROptions(gen_length=opts.gen_length,
                                   early_stop=opts.early_stop).split()
  out = ar_lib.ARDecoder(tcfg, static).decode(tparams, tokens, valid, rng, traced)
  b, g = out.tokens.shape
  live = jnp.arange(g)[None, :] < out.committed[:, None]
  adaptive_out = _rounds_output(out, out.committed, AR)
  zeros = jnp.zeros((b,), jnp.int32)
  stats = AdaptiveStats(
      target_forwards=out.nfe, drafter_forwards=jnp.zeros((), jnp.int32),
      first_confidence=jnp.full((b,), jnp.nan, jnp.float32),
      round_confidence=jnp.full((b, g), jnp.nan, jnp.float32),
      round_accepted=jnp.full((b, g), -1, jnp.int32), round_committed=live.astype(jnp.int32),
      drafted=zeros, accepted=zeros)
  return adaptive_out, stats


# ----------------------------------------------------------------------------- the decoder

@dataclasses.dataclass(frozen=True)
class AdaptiveDecoder(spec.DraftedDecoder):
  """Per row and round: the drafter's block committed in parallel, verified by the AR
  target, or plain AR. `opts` is the static `AdaptiveOptions` (thresholds traced, task map
  resolved by `plan` into per-row forced modes, the `row_inputs`). `plain`: AR or VERIFY
  when the batch is greedy and its every row is tagged that mode (a prompt router's batch
  of one, say), which `decode` runs as that mode's own decoder (AR's loop, speculative's);
  NO_ROUND otherwise."""
  drafter_cfg: ModelConfig = None
  plain: int = NO_ROUND

  finish = staticmethod(output)
  init_forwards = True
  uses_drafter = True
  row_options = ("tasks",)
  attention = "causal"
  drafter_attention = "block_causal"
  # Served: a lane has one tag map; a request names its own `task` (a row option).
  lane_options = spec.DraftedDecoder.lane_options + ("task_modes",)
  lane_row_options = ("task",)

  @classmethod
  def lane_plan(cls, cfg: ModelConfig, options: dict) -> protocol.Plan:
    if "tasks" in options:
      raise ValueError("tasks= is generate's list of one tag per prompt; a request names its "
                       "own tag with task=<tag> (one of the lane's task_modes).")
    return super().lane_plan(cfg, options)

  def row_input(self, options: dict, request: dict) -> int:
    """The mode code the request's `task` forces (-1: none; the rule decides)."""
    opts = base.make_options(AdaptiveOptions, {k: v for k, v in options.items()
                                               if k not in self.lane_options[:2]})
    return int(opts.forced_modes([request.get("task")], 1)[0])

  def drafter_capacity(self, prompt_len: int) -> int:
    return drafter_capacity(prompt_len, self.opts)

  def abstract_params(self):
    if self.plain == AR:  # the plan holds no drafter params (`plan`)
      from dllm_jax.models.transformer import abstract_params  # pylint: disable=import-outside-toplevel
      return abstract_params(self.cfg), None
    return super().abstract_params()

  def prompt_mask_id(self):
    return self.drafter_cfg.mask_token_id  # the diffusion drafter's blank

  @classmethod
  def option_names(cls) -> tuple[str, ...]:
    return ("drafter_params", "drafter_cfg", "tasks") + tuple(
        f.name for f in dataclasses.fields(AdaptiveOptions))

  @classmethod
  def plan(cls, cfg: ModelConfig, *, drafter_params=None, drafter_cfg=None, tasks=None,
           **options) -> protocol.Plan:
    opts, static, traced = base.checked_options(AdaptiveOptions, options)
    spec.check_drafter(cfg, drafter_params, drafter_cfg, cls.name or registry.name_of(cls),
                       *DRAFTER)
    forced = None if tasks is None else opts.forced_modes(
        tasks, len(tasks) if isinstance(tasks, Sequence) and not isinstance(tasks, str) else -1)
    plain = NO_ROUND
    if static.temperature == 0.0 and forced is not None and len(forced):
      first = int(forced[0])
      plain = first if first in (AR, VERIFY) and bool(np.all(forced == first)) else NO_ROUND
    if plain == AR:  # AR's own loop reads neither the rule, the tags nor the drafter
      return protocol.Plan(cls(cfg, static, drafter_cfg, plain), {})
    # Plain VERIFY keeps them all: asked for stats, it runs the loop.
    return protocol.Plan(cls(cfg, static, drafter_cfg, plain), traced, drafter_params, forced)

  def check(self, tokens, valid) -> None:
    dcfg = self.drafter_cfg
    base.check_prompts(self.cfg, tokens, valid, self.gen_length, needs_mask=False)
    if self.plain == AR:  # the drafter never runs
      return
    spec.check_drafter_prompts(dcfg, tokens, valid, self.gen_length, needs_mask=True)
    spec.check_drafter_capacity(dcfg, self.opts,
                                drafter_capacity(np.shape(tokens)[1], self.opts))

  @property
  def _kw(self) -> dict:
    return dict(tcfg=self.cfg, dcfg=self.drafter_cfg, opts=self.opts)

  def init(self, params, tokens, valid, rng, traced, row_inputs=None):
    forced = jnp.full((tokens.shape[0],), -1, jnp.int32) if row_inputs is None else row_inputs
    return _init(*params, tokens, valid, forced, rng, traced, **self._kw)

  def step(self, params, state):
    return _step(*params, state, **self._kw)

  def loop(self, params, state):
    # AR is final: once no live row needs the drafter, the rest is the drafter-free round.
    mixed = lambda s: self.running(s) & jnp.any(~s.done & (s.mode != AR))
    state = jax.lax.while_loop(mixed, functools.partial(self.step, params), state)
    return jax.lax.while_loop(self.running, functools.partial(
        _step, *params, **self._kw, only_ar=True), state)

  def decode(self, params, tokens, valid, rng, traced, row_inputs=None, with_stats=False):
    if self.plain == AR:
      out, stats = _plain_ar(params[0], tokens, valid, rng, tcfg=self.cfg, opts=self.opts)
      return (out, stats) if with_stats else out
    if self.plain == VERIFY and not with_stats:  # the stats' per-round records: the loop's
      return _plain_verify(params, tokens, valid, rng, traced, **self._kw)
    return super().decode(params, tokens, valid, rng, traced, row_inputs, with_stats)


# ----------------------------------------------------------------------------- public API

def adaptive_generate(target_params, target_cfg: ModelConfig, prompt_tokens, prompt_valid=None,
                      rng=None, *, on_nonfinite: str = "raise", return_stats: bool = False,
                      **options):
  """Task-adaptive decoding of a left-padded prompt batch (docs/decoders.md).

  Args:
    target_params, target_cfg: the AR (causal) model that verifies and decodes AR rows.
    prompt_tokens, prompt_valid: [B, P] left-padded prompts; valid None means no padding.
    rng: PRNG key (temperature > 0; default key 0).
    on_nonfinite: "raise" (NonFiniteLogitsError) or "flag".
    return_stats: also return an `AdaptiveStats`.
    **options: `drafter_params`, `drafter_cfg` (the block-causal diffusion drafter sharing
      the target's tokenizer, with a mask_token_id), `tasks` ([B] tags or None, each in
      task_modes) and the fields of `AdaptiveOptions` (thresholds traced, task_modes,
      the target's sampling, ...).
  Returns:
    AdaptiveOutput (a DecodeOutput with `modes` [B] and `round_modes` [B, G]; nfe = target +
    drafter forwards; steps = rounds), and the AdaptiveStats when return_stats.
  """
  return protocol.decode_batch(AdaptiveDecoder, target_params, target_cfg, prompt_tokens,
                               prompt_valid, rng, on_nonfinite=on_nonfinite,
                               with_stats=return_stats, **options)
