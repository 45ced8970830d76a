"""Fast-dLLM: confidence-threshold parallel decoding with approximate prefix / dual K/V caches.

Shape legend: B batch, P padded prompt length, G gen_length, T = P + G canvas, V vocab,
b block_length, N = G // b blocks, W chunk width, L layers, K kv heads, Dh head dim.

How it works, in full: docs/decoders.md, `decoding.fast_dllm`.
"""

from __future__ import annotations

import dataclasses
import sys

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, llada, protocol, sampling
from dllm_jax.models import kv_cache, masks
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer, project

Array = jnp.ndarray
RULES = ("threshold", "factor")
CACHE_MODES = ("none", "prefix", "dual")


@dataclasses.dataclass(frozen=True)
class FastDLLMOptions:
  """Decoding options; `split()` gives the static part (a jit argument) and the traced options.

  Attributes:
    gen_length: G response slots.
    block_length: b slots per block (must divide G; default 32, capped at G).
    rule: "threshold" or "factor".
    threshold: tau of the threshold rule (> 1 commits exactly one token per step).
    factor: f of the factor rule.
    cache: "none", "prefix" or "dual".
    temperature: Gumbel-max temperature of the token proposal (0 = argmax).
    early_stop: freeze rows whose answer is final and exit when all rows are.
    batch_invariant: rank confidences on `sampling.RANK_GRID` so a row gives the same tokens
      alone, in a batch and on a mesh; False (default) ranks the exact float32 scores, ties
      to the lowest slot, as Fast-dLLM's `generate` does (`sampling` module doc).
  """
  gen_length: int = base.GEN_LENGTH
  block_length: int | None = None
  rule: str = "threshold"
  threshold: float = 0.9
  factor: float = 1.0
  cache: str = "none"
  temperature: float = 0.0
  early_stop: bool = True
  batch_invariant: bool = False

  TRACED = {"threshold": 1.0, "factor": 1.0, "temperature": 0.0}

  def __post_init__(self):
    object.__setattr__(self, "early_stop", base.check_flag("early_stop", self.early_stop))
    g = self.gen_length
    if not isinstance(g, (int, np.integer)) or g <= 0:
      raise ValueError(f"gen_length must be a positive int, got {g!r}.")
    bl = base.resolve_block_length(self.block_length, g)
    object.__setattr__(self, "block_length", bl)
    if g % bl:
      raise ValueError(f"gen_length={g} must be a positive multiple of block_length={bl}; "
                       "pick a block_length that divides gen_length.")
    if self.rule not in RULES:
      raise ValueError(f"Unknown rule {self.rule!r}; use one of {RULES}.")
    if self.cache not in CACHE_MODES:
      raise ValueError(f"Unknown cache mode {self.cache!r}; use one of {CACHE_MODES}.")
    # threshold may be inf (above every probability: one token per step, the top one).
    base.check_number("threshold", self.threshold, low=0.0, low_open=True, allow_inf=True)
    base.check_number("factor", self.factor, low=0.0, low_open=True)
    base.check_number("temperature", self.temperature, low=0.0)
    object.__setattr__(self, "batch_invariant",
                       base.check_flag("batch_invariant", self.batch_invariant))

  def split(self):
    """(static options, {threshold, factor, temperature} [] arrays)."""
    return base.split_options(self, self.TRACED, {})

  @property
  def num_blocks(self) -> int:
    return self.gen_length // self.block_length


@flax.struct.dataclass
class FastState:
  """Loop carry, one row per prompt; every field has a static shape.

  Attributes:
    canvas, valid, positions: [B, T] tokens ([MASK] where undecided), real-slot mask, RoPE
      positions.
    cache: KVCache of T slots per row (None for cache="none").
    block: [B] int32 each row's current block (N once it filled them all).
    fresh: [B] bool the row's next forward starts its block (its cache refresh; cache
      "none" has nothing to refresh).
    step: [] int32 loop steps; nfe: [] int32 batched forward calls (one per step).
    forwards: [B] int32 forwards in which the row was live (its NFE decoding alone).
    block_forwards: [B, N] int32 of those, the forwards spent in each block (a lockstep
      batch, whose block advances when every row filled it, would run sum_n max_b of them).
    forward_slots: [] int32 slots the batched forwards carried per row (the most a row
      carried, when one row refreshes alone), summed over steps.
    committed: [B] int32 tokens committed; done: [B] bool answer final (row_done).
    rng: PRNG key, or [B] keys (one per row); traced: the traced options; finite: [B] bool
      logits always finite.
  """
  canvas: Array
  valid: Array
  positions: Array
  cache: kv_cache.KVCache | None
  block: Array
  fresh: Array
  step: Array
  nfe: Array
  forwards: Array
  block_forwards: Array
  forward_slots: Array
  committed: Array
  done: Array
  rng: Array
  traced: dict
  finite: Array


def init_state(params, cfg: ModelConfig, opts: FastDLLMOptions, tokens, valid,
               rng, traced: dict | None = None) -> FastState:
  """The all-masked canvas and an empty T-slot cache (no forward yet).

  `traced` are the traced options (default: `opts.split()[1]`)."""
  del params
  traced = opts.split()[1] if traced is None else traced
  canvas, cvalid, positions = base.init_canvas(tokens, valid, opts.gen_length, cfg.mask_token_id)
  b, t = canvas.shape
  cache = None if opts.cache == "none" else kv_cache.init_cache(cfg, b, t)
  # Distinct buffers: the state may be donated.
  zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
  return FastState(canvas=canvas, valid=cvalid, positions=positions, cache=cache,
                   block=zeros(b), fresh=jnp.ones((b,), bool), step=zeros(), nfe=zeros(),
                   forwards=zeros(b), block_forwards=zeros(b, opts.num_blocks),
                   forward_slots=zeros(), committed=zeros(b),
                   done=jnp.zeros((b,), bool), rng=rng, traced=traced,
                   finite=jnp.ones((b,), bool))


def live_rows(opts: FastDLLMOptions, state: FastState) -> Array:
  """[B] bool rows that run this step: blocks left and (with early stop) answer not final."""
  more = state.block < opts.num_blocks
  return more & ~state.done if opts.early_stop else more


def _lead(cfg: ModelConfig) -> int:
  """Slots a chunk starts before the block: 1 for shifted-logits models (Dream), whose
  prediction for the block's first slot is the output at the slot before it."""
  return int(cfg.shift_logits)


def _block_starts(opts: FastDLLMOptions, state: FastState) -> Array:
  """[B] canvas slot of each row's current block (T for a row past its last block)."""
  return state.canvas.shape[1] - opts.gen_length + state.block * opts.block_length


def _gather(x: Array, idx: Array) -> Array:
  """x[b, idx[b, j]] for [B, T] x and [B, W] idx (clipped into [0, T))."""
  return jnp.take_along_axis(x, jnp.clip(idx, 0, x.shape[1] - 1), axis=1)


def _chunk(state: FastState, first: Array, width: int, carried: int):
  """Each row's canvas slots [first, first + width) as forward inputs.

  Returns [B, W] tokens, positions and valid; a slot is valid when it is among the first
  `carried` and inside the canvas (so a row nearer the end carries fewer)."""
  off = jnp.arange(width, dtype=jnp.int32)[None]
  slot = first[:, None] + off
  ok = (off < carried) & (slot < state.canvas.shape[1])
  return (_gather(state.canvas, slot), _gather(state.positions, slot),
          ok & _gather(state.valid, slot))


def _project(params, cfg: ModelConfig, opts: FastDLLMOptions, hidden: Array, first_out):
  """[B, b, V] logits of the block from hidden states whose output `first_out[b]` (+ j)
  predicts the block's slot j (the slot itself, or the one before for shifted logits)."""
  at = first_out[:, None] + jnp.arange(opts.block_length, dtype=jnp.int32)[None]
  return project(params, cfg, hidden, jnp.clip(at, 0, hidden.shape[1] - 1))


def _full_logits(params, cfg, opts, state: FastState, start: Array) -> Array:
  """cache="none": a full canvas forward, the LM head on each row's block only."""
  hidden = Transformer(cfg).apply(
      {"params": params}, state.canvas, block_ids=jnp.zeros_like(state.canvas),
      positions=state.positions, valid=state.valid, head=False)
  return _project(params, cfg, opts, hidden, start - _lead(cfg))


def _after_refresh(opts: FastDLLMOptions, cache: kv_cache.KVCache, refresh: Array,
                   first: Array, lead: int) -> kv_cache.KVCache:
  """Hides, in refreshing rows' freshly written cache, the slots their chunks will carry:
  from the chunk's first slot on (prefix) or only the chunk (dual: the suffix stays)."""
  t = cache.capacity
  slot = jnp.arange(t, dtype=jnp.int32)[None]
  if opts.cache == "prefix":
    hide, length = slot >= first[:, None], first
  else:  # `length` counts the slots kept, so length + chunk fits the capacity
    hide = (slot >= first[:, None]) & (slot < first[:, None] + lead + opts.block_length)
    length = jnp.full_like(first, t - opts.block_length - lead)
  return cache.replace(
      block_ids=jnp.where(refresh[:, None] & hide, masks.NO_KEY, cache.block_ids),
      length=jnp.where(refresh, length, cache.length))


def _cached_logits(params, cfg, opts, state: FastState, live: Array, start: Array):
  """[B, b, V] logits of each row's block and the cache to carry (docs/decoders.md), and the
  [] slots per row the forward carried."""
  bl, g, t, lead = opts.block_length, opts.gen_length, state.canvas.shape[1], _lead(cfg)
  first = start - lead
  refresh = live & state.fresh
  model = Transformer(cfg)
  carried = bl + lead if opts.cache == "dual" else g + lead  # prefix: up to the end

  def chunk_only(width):
    def run(s):
      tokens, positions, valid = _chunk(s, first, width, carried)
      hidden, _ = model.apply({"params": params}, tokens, block_ids=jnp.zeros_like(tokens),
                              positions=positions, valid=valid, cache=s.cache, write_len=0,
                              head=False)
      return (_project(params, cfg, opts, hidden, jnp.zeros_like(first)), s.cache,
              jnp.asarray(width, jnp.int32))
    return run

  def with_refresh(s):
    r = refresh[:, None]
    tokens, positions, valid = _chunk(s, first, t, carried)
    tokens = jnp.where(r, s.canvas, tokens)
    positions = jnp.where(r, s.positions, positions)
    valid = jnp.where(r, s.valid, valid)
    # A refreshing row forgets its cache (the full forward must not see the old one) and
    # writes all T slots; the other rows read theirs and write nothing.
    cache = s.cache.replace(block_ids=jnp.where(r, masks.NO_KEY, s.cache.block_ids),
                            length=jnp.where(refresh, 0, s.cache.length))
    hidden, cache = model.apply({"params": params}, tokens, block_ids=jnp.zeros_like(tokens),
                                positions=positions, valid=valid, cache=cache,
                                write_len=jnp.where(refresh, t, 0), head=False)
    logits = _project(params, cfg, opts, hidden, jnp.where(refresh, first, 0))
    return logits, _after_refresh(opts, cache, refresh, first, lead), jnp.asarray(t, jnp.int32)

  if opts.cache == "dual":
    cached = chunk_only(bl + lead)
  else:  # prefix: the widest `block + suffix` among the rows, one static width per block
    nearest = jnp.min(jnp.where(live, state.block, opts.num_blocks - 1))
    branches = [chunk_only(g - n * bl + lead) for n in range(opts.num_blocks)]
    cached = lambda s: jax.lax.switch(jnp.minimum(nearest, opts.num_blocks - 1), branches, s)

  def refresh_one(s):
    # One row starts a block: it alone forwards the whole canvas (into a fresh one-row cache:
    # a refresh forgets the old one), and every row runs the cached chunk forward, whose
    # logits and (unwritten) cache the refreshing row's replace. A batch whose rows start
    # blocks at different steps so pays a row's refresh once, not once per batch row.
    logits, cache, width = cached(s)
    r = jnp.argmax(refresh)
    one = lambda x: jax.lax.dynamic_slice_in_dim(x, r, 1, axis=0)
    hidden, fresh = model.apply(
        {"params": params}, one(s.canvas), block_ids=jnp.zeros((1, t), jnp.int32),
        positions=one(s.positions), valid=one(s.valid),
        cache=kv_cache.init_cache(cfg, 1, t, s.cache.k.dtype), write_len=jnp.full((1,), t),
        head=False)
    fresh = _after_refresh(opts, fresh, jnp.ones((1,), bool), one(first), lead)
    put = lambda whole, row, axis: jax.lax.dynamic_update_slice_in_dim(whole, row, r, axis)
    cache = kv_cache.KVCache(k=put(cache.k, fresh.k, 1), v=put(cache.v, fresh.v, 1),
                             block_ids=put(cache.block_ids, fresh.block_ids, 0),
                             length=put(cache.length, fresh.length, 0))
    row_logits = _project(params, cfg, opts, hidden, one(first))
    return put(logits, row_logits.astype(logits.dtype), 0), cache, width + t

  count = jnp.sum(refresh, dtype=jnp.int32)
  if state.canvas.shape[0] == 1:  # one row: refreshing is the whole-batch refresh
    return jax.lax.cond(count > 0, with_refresh, cached, state)
  branch = jnp.where(count == 0, 0, jnp.where(count == 1, 1, 2))
  return jax.lax.switch(branch, [cached, refresh_one, with_refresh], state)


def step(params, cfg: ModelConfig, opts: FastDLLMOptions, state: FastState) -> FastState:
  """One batched forward; each live row commits the rule's slots of its own block."""
  b, t = state.canvas.shape
  bl = opts.block_length
  live = live_rows(opts, state)
  start = _block_starts(opts, state)
  if opts.cache == "none":
    logits, cache, width = _full_logits(params, cfg, opts, state, start), None, t
  else:
    logits, cache, width = _cached_logits(params, cfg, opts, state, live, start)
  finite = state.finite & (sampling.all_finite(logits) | ~live)
  logits = sampling.forbid(logits, (cfg.mask_token_id,))
  if sampling.is_row_keys(state.rng):  # one key per row (serving): fold_in(rng[b], forwards)
    keys = sampling.row_step_keys(state.rng, state.forwards)
  else:
    # fold_in(fold_in(rng, own forwards), global row): a row's draws follow its own clock,
    # and a data-parallel shard's rows keep their whole-batch index (row_offset).
    rows = sampling.row_indices(b, state.traced.get("row_offset", 0))
    keys = jax.vmap(lambda n, r: jax.random.fold_in(jax.random.fold_in(state.rng, n), r))(
        state.forwards, rows)
  temperature = base.traced_option(opts, state.traced, "temperature")
  x0 = sampling.map_rows(sampling.propose, (logits, keys), temperature=temperature)
  conf = sampling.confidence(logits, x0, "probability")

  slot = start[:, None] + jnp.arange(bl, dtype=jnp.int32)[None]            # [B, b]
  block = _gather(state.canvas, slot)
  candidates = (block == cfg.mask_token_id) & live[:, None]
  if opts.rule == "threshold":
    commit = sampling.threshold_mask(conf, candidates, state.traced["threshold"],
                                     invariant=opts.batch_invariant)
  else:
    commit = sampling.factor_mask(conf, candidates, state.traced["factor"],
                                  invariant=opts.batch_invariant)
  block = jnp.where(commit, x0, block)
  rows = jnp.arange(b)[:, None]
  canvas = state.canvas.at[rows, slot].set(block, mode="drop")  # past the canvas: no block

  new = state.replace(canvas=canvas, cache=cache, step=state.step + 1, nfe=state.nfe + 1,
                      forwards=state.forwards + live.astype(jnp.int32),
                      block_forwards=state.block_forwards + (live[:, None] & (
                          state.block[:, None] == jnp.arange(opts.num_blocks))).astype(jnp.int32),
                      forward_slots=state.forward_slots + width, finite=finite,
                      committed=state.committed + jnp.sum(commit, axis=1, dtype=jnp.int32))
  done = llada.row_done(cfg, *llada.response_view(cfg, opts, new))
  advance = live & jnp.all(block != cfg.mask_token_id, axis=1)
  return new.replace(done=done, block=state.block + advance.astype(jnp.int32),
                     fresh=jnp.where(live, advance, state.fresh))


def running(opts: FastDLLMOptions, state: FastState) -> Array:
  # `step < G` is a guard only: every step fills >= 1 slot of every live row, and a row is
  # live from the first step until it stops, so the loop runs max over rows of their forwards.
  return jnp.any(live_rows(opts, state)) & (state.step < opts.gen_length)


def response_view(cfg: ModelConfig, opts: FastDLLMOptions, state: FastState):
  """([B, G] response slots, [B, G] bool decided)."""
  return llada.response_view(cfg, opts, state)


def finish(cfg: ModelConfig, opts: FastDLLMOptions, state: FastState) -> base.DecodeOutput:
  return llada.finish(cfg, opts, state)


class FastDLLMDecoder(protocol.LoopDecoder):
  """Fast-dLLM: threshold / factor commits per block, with no, prefix or dual cache."""
  module = sys.modules[__name__]
  options = FastDLLMOptions

  @classmethod
  def run_defaults(cls, block: int) -> dict:
    return {"block_length": block}


def fast_dllm_generate(params, cfg: ModelConfig, prompt_tokens, prompt_valid=None, rng=None, *,
                       on_nonfinite: str = "raise", **options) -> base.DecodeOutput:
  """Fast-dLLM decoding of a left-padded prompt batch (one jitted while_loop).

  Args:
    params: model parameters (a bidirectional masked-diffusion LM).
    cfg: the model config (needs mask_token_id).
    prompt_tokens: [B, P] int left-padded prompts; prompt_valid: [B, P] bool (None: all real).
    rng: PRNG key for temperature > 0 (default key 0), or [B] keys, one per row (each row
      then draws from its own key only; docs/decoders.md).
    on_nonfinite: "raise" (NonFiniteLogitsError naming rows whose logits were NaN/inf) or
      "flag" (return them with `finite` False, lengths 0).
    **options: fields of `FastDLLMOptions` (unknown names raise ValueError).

  Returns the `DecodeOutput`; its `nfe` counts batched forward calls (= steps). Every row
  runs the forwards it would run alone (`FastState.forwards` of the streaming interface), so
  nfe is the largest of them.
  """
  return protocol.decode_batch(FastDLLMDecoder, params, cfg, prompt_tokens, prompt_valid,
                               rng, on_nonfinite=on_nonfinite, **options)


def check(cfg: ModelConfig, tokens, valid, opts: FastDLLMOptions) -> None:
  """Validates a prompt batch against the options (before anything is compiled)."""
  base.check_prompts(cfg, tokens, valid, opts.gen_length, block_length=opts.block_length)
