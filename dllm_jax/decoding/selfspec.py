"""Self-speculative decoding with one network (TiDAR-style): each forward verifies the previous
draft causally AND drafts the next block by diffusion.

Shape legend: B batch, P padded prompt length, G gen_length, k draft_length, V vocab.

How it works, in full: docs/decoders.md, `decoding.selfspec`.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, protocol, sampling
from dllm_jax.decoding import speculative as spec
from dllm_jax.models import kv_cache as kvc
from dllm_jax.models import masks
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer, project

Array = jnp.ndarray


@dataclasses.dataclass(frozen=True)
class SelfSpecOptions:
  """Options (hashable: a jit static argument; `plan` traces the sampling,
  `spec.split_sampling`).

  Attributes:
    gen_length: G, the most tokens generated per row.
    draft_length: k, tokens drafted per forward (the mask block has k + 1 slots; train with
      selfspec_loss's block_size >= k + 1).
    temperature, top_k, top_p: sampling, as in `ar_generate`.
    early_stop: exit once every row is done.
  """
  gen_length: int = base.GEN_LENGTH
  draft_length: int = 3
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  early_stop: bool = True

  def __post_init__(self):
    object.__setattr__(self, "early_stop", base.check_flag("early_stop", self.early_stop))
    spec.check_draft_options(self)


@flax.struct.dataclass
class SelfSpecStats:
  """forwards: [] batched forwards; rounds, drafted, accepted: [B] rounds a row was live,
  drafts it verified, drafts it accepted."""
  forwards: Array
  rounds: Array
  drafted: Array
  accepted: Array


@flax.struct.dataclass
class SelfSpecState:
  """Loop carry. response [B, G]; draft [B, k]; n, prompt_len, has_draft, done, finite,
  stats [B].
  The cache holds prompt + response[:n - 1]."""
  response: Array
  n: Array
  prompt_len: Array
  cache: kvc.KVCache
  draft: Array
  has_draft: Array
  done: Array
  finite: Array
  rounds: Array
  drafted: Array
  accepted: Array
  step: Array
  rng: Array
  row_offset: Array  # [] the global index of row 0 (a data shard's first row)
  # The traced options: sampling ({temperature, top_k, top_p}: [] each, or [B] in a serving
  # lane's rows; `spec.sampling_options` reads them) and row_offset.
  traced: dict | None = None


def _forward(params, cfg: ModelConfig, clean, starts, cache, k: int):
  """One forward of clean slots (tokens, positions, valid) plus one block of k + 1 masks
  per entry of `starts` [B, N]: block j sits at positions starts[:, j] + [0, k], sees the
  clean prefix up to position starts[:, j] - 1 and itself (its own branch), and no other
  block. Returns (clean hidden [B, T, D], mask hidden [B, N, k + 1, D], cache with every
  clean slot written)."""
  tokens, positions, valid = clean
  b, t = tokens.shape
  n = starts.shape[1]
  offsets = jnp.arange(k + 1, dtype=jnp.int32)
  mpos = (starts[:, :, None] + offsets).reshape(b, n * (k + 1))
  mids = jnp.broadcast_to(starts[:, :, None] - 1, (b, n, k + 1)).reshape(b, n * (k + 1))
  branch = jnp.repeat(jnp.arange(1, n + 1, dtype=jnp.int32), k + 1)
  hidden, cache = Transformer(cfg).apply(
      {"params": params},
      jnp.concatenate([tokens, jnp.full((b, n * (k + 1)), cfg.mask_token_id, jnp.int32)], 1),
      block_ids=jnp.concatenate([positions, mids], 1),
      positions=jnp.concatenate([positions, mpos], 1),
      valid=jnp.concatenate([valid, jnp.ones((b, n * (k + 1)), bool)], 1), cache=cache,
      branch_ids=jnp.concatenate([jnp.zeros((t,), jnp.int32), branch]),
      write_len=t, head=False)
  return hidden[:, :t], hidden[:, t:].reshape(b, n, k + 1, -1), cache


def _round(params, cfg, opts, state: SelfSpecState, hidden, mask_hidden, cache, cache_len0,
           n_drafts, keys):
  """Acceptance, commit, rollback and the next draft from one forward's outputs: the next
  draft comes from the mask block of the outcome that happened (a accepted drafts: block a,
  or block 0 when the forward carried one block)."""
  k = opts.draft_length
  logits = project(params, cfg, hidden)
  read = jnp.arange(k + 1)[None] <= n_drafts[:, None]             # the clean slots verified
  temperature, top_k, top_p = spec.sampling_options(opts, state.traced, logits.shape[0])
  choice, accepted = spec.verify(logits, state.draft, n_drafts, keys, temperature=temperature,
                                 top_k=top_k, top_p=top_p, forbid_ids=(cfg.mask_token_id,))
  live = ~state.done
  accepted = jnp.where(live, accepted, 0)
  block = jnp.minimum(accepted, mask_hidden.shape[1] - 1)
  mask_logits = project(params, cfg, jnp.take_along_axis(
      mask_hidden, block[:, None, None, None], axis=1)[:, 0])        # [B, k + 1, V]
  ok = sampling.all_finite(logits, read) & sampling.all_finite(mask_logits)
  response, count, done = spec.commit(cfg, state.response, state.n, state.done, choice,
                                      accepted)
  # A done row's cache keeps its length: the engine steps finished and empty slots beside
  # live rows for as long as it runs, and their lengths stay bounded (what a forward writes
  # past the capacity is dropped, so this changes no output).
  cache = kvc.truncate(cache, jnp.where(live, cache_len0 + accepted, state.cache.length))
  draft = spec.greedy(mask_logits[:, 1:], (cfg.mask_token_id,))
  return state.replace(
      response=response, n=state.n + count, cache=cache,
      draft=jnp.where(live[:, None], draft, state.draft),
      has_draft=state.has_draft | live, done=done,
      finite=state.finite & (ok | ~live),
      rounds=state.rounds + live.astype(jnp.int32), drafted=state.drafted + n_drafts,
      accepted=state.accepted + accepted, step=state.step + 1)


def _init(params, prompt, valid, rng, *, cfg: ModelConfig, opts: SelfSpecOptions, offset=0,
          traced: dict | None = None):
  """The prompt's forward and round 0. `traced`: the traced sampling options ([] or [B];
  `spec.sampling_options`), or None (the options' own)."""
  b, p = prompt.shape
  g, k = opts.gen_length, opts.draft_length
  prompt_len = valid.sum(-1, dtype=jnp.int32)
  positions = masks.left_pad_positions(valid)
  cache = kvc.init_cache(cfg, b, _capacity(p, opts))
  hidden, mask_hidden, cache = _forward(params, cfg, (prompt.astype(jnp.int32), positions,
                                                       valid), prompt_len[:, None], cache, k)
  zeros = jnp.zeros((b,), jnp.int32)
  state = SelfSpecState(
      response=jnp.full((b, g), base.output_pad_id(cfg), jnp.int32), n=zeros,
      prompt_len=prompt_len, cache=cache, draft=jnp.zeros((b, k), jnp.int32),
      has_draft=jnp.zeros((b,), bool), done=jnp.zeros((b,), bool),
      finite=jnp.ones((b,), bool), rounds=zeros,
      drafted=zeros, accepted=zeros, step=jnp.zeros((), jnp.int32), rng=rng,
      row_offset=jnp.asarray(offset, jnp.int32), traced=traced)
  # Verify "no draft": slot 0 (the prompt's last token) gives the first token.
  slots = jnp.full((b, k + 1), p - 1, jnp.int32)
  return _round(params, cfg, opts, state, jnp.take_along_axis(hidden, slots[..., None], 1),
                mask_hidden, cache, jnp.full((b,), p, jnp.int32), zeros,
                spec.round_keys(rng, 0, zeros, 1, offset))


def _step(params, state: SelfSpecState, *, cfg: ModelConfig, opts: SelfSpecOptions):
  b, g = state.response.shape
  k = opts.draft_length
  live = ~state.done
  last_idx = jnp.maximum(state.n - 1, 0)
  last = jnp.take_along_axis(state.response, last_idx[:, None], axis=1)[:, 0]
  last_pos = state.prompt_len + last_idx
  n_drafts = jnp.where(live & state.has_draft, k, 0)
  positions = last_pos[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
  valid = (jnp.arange(k + 1)[None] <= n_drafts[:, None]) & live[:, None]
  tokens = jnp.concatenate([last[:, None], state.draft], 1)
  cache_len0 = state.cache.length
  # One mask block per acceptance outcome a (0..k): it starts after the last committed
  # token and a accepted drafts, so the next round drafts whatever this one accepts.
  starts = last_pos[:, None] + 1 + jnp.arange(k + 1, dtype=jnp.int32)[None]
  hidden, mask_hidden, cache = _forward(params, cfg, (tokens, positions, valid), starts,
                                        state.cache, k)
  return _round(params, cfg, opts, state, hidden, mask_hidden, cache, cache_len0 + 1, n_drafts,
                spec.round_keys(state.rng, state.step, state.rounds, 1, state.row_offset))


def forward_width(opts: SelfSpecOptions) -> int:
  """Slots of a round's forward: k + 1 clean slots and k + 1 mask blocks of k + 1."""
  return (opts.draft_length + 1) * (opts.draft_length + 2)


def _capacity(p: int, opts: SelfSpecOptions) -> int:
  """Cache slots: P + G (a forward writes its k + 1 <= G + 1 clean slots only)."""
  return p + opts.gen_length


def output(cfg: ModelConfig, opts: SelfSpecOptions, state: SelfSpecState):
  """(base.DecodeOutput, SelfSpecStats) of a finished state."""
  decided = jnp.arange(opts.gen_length)[None, :] < state.n[:, None]
  tokens, lengths, _ = base.finalize(state.response, decided, base.stop_ids(cfg),
                                     base.output_pad_id(cfg))
  out = base.decode_output(tokens, lengths, state.step, state.step, state.n, state.done,
                           state.finite, base.output_pad_id(cfg))
  return out, SelfSpecStats(forwards=state.step, rounds=state.rounds, drafted=state.drafted,
                            accepted=state.accepted)


def check_model(cfg: ModelConfig) -> None:
  """Raises ValueError unless `cfg` can run self-speculative decoding."""
  if cfg.mask_token_id is None:
    raise ValueError(f"model config {cfg.name!r} has no mask_token_id; self-speculative "
                     "decoding drafts with a block of [MASK] slots.")
  if cfg.shift_logits:
    raise ValueError("self-speculative decoding needs an unshifted model (output i "
                     "predicts token i + 1, as selfspec_loss trains); got shift_logits=True.")


def check(cfg: ModelConfig, tokens, valid, opts: SelfSpecOptions) -> None:
  """Validates the model and a prompt batch against the options (before compiling)."""
  check_model(cfg)
  base.check_prompts(cfg, tokens, valid, opts.gen_length, needs_mask=True)
  check_capacity(cfg, np.shape(tokens)[1], opts)


def check_capacity(cfg: ModelConfig, prompt_len: int, opts: SelfSpecOptions) -> None:
  """Raises ValueError unless a round's forward ((k + 1)(k + 2) slots) fits the model
  window."""
  del prompt_len  # the prompt and G are checked against the window with the prompts
  if forward_width(opts) > cfg.max_seq_len:
    raise ValueError(f"a self-speculative forward carries (draft_length + 1) * "
                     f"(draft_length + 2) = {forward_width(opts)} slots, more than "
                     f"max_seq_len={cfg.max_seq_len}; lower draft_length.")


# ----------------------------------------------------------------------------- the decoder

class SelfSpecDecoder(spec.RoundDecoder):
  """One network verifies the last draft causally and drafts the next block in one forward."""
  options = SelfSpecOptions
  finish = staticmethod(output)
  init_forwards = True   # the init's forward (prompt + mask block) commits the first token
  attention = "selfspec"

  @classmethod
  def plan(cls, cfg: ModelConfig, **options) -> protocol.Plan:
    check_model(cfg)
    _, static, traced = base.checked_options(SelfSpecOptions, options, spec.split_sampling)
    return protocol.Plan(cls(cfg, static), {"row_offset": np.int32(0), **traced})

  def check(self, tokens, valid) -> None:
    check(self.cfg, tokens, valid, self.opts)

  def init(self, params, tokens, valid, rng, traced, row_inputs=None):
    return _init(params, tokens, valid, rng, cfg=self.cfg, opts=self.opts,
                 offset=traced["row_offset"], traced=traced)

  def step(self, params, state):
    return _step(params, state, cfg=self.cfg, opts=self.opts)

  def check_window(self, prompt_len: int) -> None:
    base.check_window(self.cfg, prompt_len, self.gen_length)
    check_capacity(self.cfg, prompt_len, self.opts)

  def pad(self, state, prompt_len):
    # The cache is [prompt width | G]: prepend empty slots (positions are the row's own).
    extra = prompt_len - (state.cache.capacity - self.gen_length)
    return state.replace(cache=protocol.prepend_cache_slots(
        state.cache, extra, _capacity(prompt_len, self.opts)))

  def forwards(self, state):
    return state.rounds  # one forward a round



# ----------------------------------------------------------------------------- public API

def selfspec_generate(params, cfg: ModelConfig, prompt_tokens, prompt_valid=None, rng=None, *,
                      on_nonfinite: str = "raise", return_stats: bool = False, **options):
  """Self-speculative (TiDAR-style) decoding of a left-padded prompt batch.

  Args:
    params, cfg: one network trained with `selfspec_loss` (causal AR + masked block drafts).
    prompt_tokens, prompt_valid: [B, P] left-padded prompts; valid None means no padding.
    rng: PRNG key (temperature > 0; default key 0).
    on_nonfinite: "raise" (NonFiniteLogitsError naming rows whose logits were NaN/inf) or
      "flag" (return them with `finite` False, lengths 0).
    return_stats: also return `SelfSpecStats` (forwards, per-row rounds / drafts / accepts).
    **options: fields of `SelfSpecOptions` (gen_length, draft_length, temperature, ...);
      greedy output equals `ar_generate(params, cfg, ...)`.
  Returns:
    base.DecodeOutput (nfe = steps = forwards), and the stats when return_stats.
  """
  return protocol.decode_batch(SelfSpecDecoder, params, cfg, prompt_tokens, prompt_valid, rng,
                               on_nonfinite=on_nonfinite, with_stats=return_stats, **options)
