"""Fast-dLLM: confidence-threshold parallel decoding with approximate prefix / dual K/V caches.

Shape legend: B batch, P padded prompt length, G gen_length, T = P + G canvas, V vocab,
b block_length, N = G // b blocks, L layers, K kv heads, Dh head dim.

Blocks are decoded left to right. Every step commits, in each unfinished row, the masked slots
of the current block chosen by the rule: `threshold` (confidence > tau, at least the most
confident one) or `factor` (largest n with c_n >= 1 - f / (n + 1)), so every step commits at
least one token per unfinished row and the loop ends within G steps. [MASK] is never proposed
(its logit is -inf), so a model that predicts [MASK] cannot stall it. The block advances when
every unfinished row has filled it; a row that is ahead waits unchanged, so a batch gives each
row exactly its one-prompt result.

Cache modes (both approximate for a bidirectional model; refreshed once per block):
  none    every step is a full forward over the T-slot canvas.
  prefix  the block's first step is a full forward that writes K/V of all T slots; later steps
          forward only `current block + suffix` ([B, G - n*b] rows, one static shape per block,
          picked by `lax.switch`) attending to the cached prefix (prompt + finished blocks).
  dual    as prefix, but the suffix K/V is kept too and later steps forward only the [B, b]
          block.
The cache holds all T slots in canvas order; the forwarded slots are hidden (block id NO_KEY)
so the chunk attends to `visible cache ++ itself`, at its canvas positions, writing nothing.
For shifted-logits models (Dream) the chunk also re-forwards the slot before the block, whose
output predicts the block's first slot.

NFE counts forwards (full or chunk). Early stop as in `llada.py`: a row whose answer is final
stops committing; that cannot change any output.

threshold, factor and temperature are traced (`FastDLLMOptions.split`): sweeping them never
recompiles. A row whose block logits are ever non-finite is flagged (`DecodeOutput.finite`).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, llada, sampling
from dllm_jax.models import kv_cache, masks
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer

Array = jnp.ndarray
RULES = ("threshold", "factor")
CACHE_MODES = ("none", "prefix", "dual")


@dataclasses.dataclass(frozen=True)
class FastDLLMOptions:
  """Decoding options; `split()` gives the static part (a jit argument) and the traced knobs.

  Attributes:
    gen_length: G response slots.
    block_length: b slots per block (must divide G; default 32, capped at G).
    rule: "threshold" or "factor".
    threshold: tau of the threshold rule (> 1 commits exactly one token per step).
    factor: f of the factor rule.
    cache: "none", "prefix" or "dual".
    temperature: Gumbel-max temperature of the token proposal (0 = argmax).
    early_stop: freeze rows whose answer is final and exit when all rows are.
  """
  gen_length: int = base.GEN_LENGTH
  block_length: int | None = None
  rule: str = "threshold"
  threshold: float = 0.9
  factor: float = 1.0
  cache: str = "none"
  temperature: float = 0.0
  early_stop: bool = True

  TRACED = {"threshold": 1.0, "factor": 1.0, "temperature": 0.0}

  def __post_init__(self):
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

  def split(self):
    """(static options, {threshold, factor, temperature} [] arrays)."""
    return base.split_options(self, self.TRACED, {})

  @property
  def num_blocks(self) -> int:
    return self.gen_length // self.block_length


@flax.struct.dataclass
class FastState:
  """Loop carry. canvas/valid/positions [B, T]; cache of T slots (None without cache);
  block/fresh/step/nfe []; committed/done [B]."""
  canvas: Array
  valid: Array
  positions: Array
  cache: kv_cache.KVCache | None
  block: Array
  fresh: Array
  step: Array
  nfe: Array
  committed: Array
  done: Array
  rng: Array
  knobs: dict
  finite: Array


def init_state(params, cfg: ModelConfig, opts: FastDLLMOptions, tokens, valid,
               rng, knobs: dict | None = None) -> FastState:
  """The all-masked canvas and an empty T-slot cache (no forward yet).

  `knobs` are the traced options (default: `opts.split()[1]`)."""
  del params
  knobs = opts.split()[1] if knobs is None else knobs
  canvas, cvalid, positions = base.init_canvas(tokens, valid, opts.gen_length, cfg.mask_token_id)
  b, t = canvas.shape
  cache = None if opts.cache == "none" else kv_cache.init_cache(cfg, b, t)
  zero = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the state may be donated
  return FastState(canvas=canvas, valid=cvalid, positions=positions, cache=cache, block=zero(),
                   fresh=jnp.ones((), bool), step=zero(), nfe=zero(),
                   committed=jnp.zeros((b,), jnp.int32), done=jnp.zeros((b,), bool), rng=rng,
                   knobs=knobs, finite=jnp.ones((b,), bool))


def _block_start(opts: FastDLLMOptions, state: FastState) -> Array:
  return state.canvas.shape[1] - opts.gen_length + state.block * opts.block_length


def _block_logits(logits: Array, start, bl: int) -> Array:
  return jax.lax.dynamic_slice_in_dim(logits, start, bl, axis=1)


def _refresh(params, cfg, opts, state: FastState):
  """Full forward writing K/V of all T slots; hides the slots later chunks will forward."""
  t = state.canvas.shape[1]
  start = _block_start(opts, state)
  # Forget every slot: the full forward must not see the previous block's cache.
  empty = kv_cache.truncate(state.cache, jnp.zeros_like(state.cache.length))
  logits, cache = Transformer(cfg).apply(
      {"params": params}, state.canvas, block_ids=jnp.zeros_like(state.canvas),
      positions=state.positions, valid=state.valid, cache=empty, write_len=t)
  b, bl = state.canvas.shape[0], opts.block_length
  first = start - _lead(cfg)
  if opts.cache == "prefix":  # forget the block and the suffix
    cache = kv_cache.truncate(cache, jnp.full((b,), first, jnp.int32))
  else:  # hide the block; `length` counts the slots kept, so length + chunk fits capacity
    slot = jnp.arange(t)[None, :]
    hide = (slot >= first) & (slot < start + bl)
    cache = cache.replace(block_ids=jnp.where(hide, masks.NO_KEY, cache.block_ids),
                          length=jnp.full((b,), t - bl - _lead(cfg), jnp.int32))
  return _block_logits(logits, start, bl), cache


def _lead(cfg: ModelConfig) -> int:
  """Slots a chunk starts before the block: 1 for shifted-logits models (Dream), whose
  prediction for the block's first slot is the output at the slot before it."""
  return int(cfg.shift_logits)


def _chunk_logits(params, cfg, state: FastState, first: int, width: int) -> Array:
  """Forwards canvas slots [first, first + width) against the cache, writing nothing."""
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, first, width, axis=1)
  chunk = take(state.canvas)
  logits, _ = Transformer(cfg).apply(
      {"params": params}, chunk, block_ids=jnp.zeros_like(chunk), positions=take(state.positions),
      cache=state.cache, write_len=0)
  return logits


def _cached_step_logits(params, cfg, opts, state: FastState):
  """[B, b, V] logits of the current block and the cache to carry."""
  bl, g, lead = opts.block_length, opts.gen_length, _lead(cfg)
  p = state.canvas.shape[1] - g
  if opts.cache == "dual":
    def chunk(s):
      logits = _chunk_logits(params, cfg, s, _block_start(opts, s) - lead, bl + lead)
      return logits[:, lead:], s.cache
  else:  # prefix: block + suffix, one static width per block.
    def branch(n):
      def run(s):
        logits = _chunk_logits(params, cfg, s, p + n * bl - lead, g - n * bl + lead)
        return logits[:, lead:lead + bl], s.cache
      return run
    chunk = lambda s: jax.lax.switch(s.block, [branch(n) for n in range(opts.num_blocks)], s)
  return jax.lax.cond(state.fresh, lambda s: _refresh(params, cfg, opts, s), chunk, state)


def step(params, cfg: ModelConfig, opts: FastDLLMOptions, state: FastState) -> FastState:
  """One forward; commits the rule's slots of the current block in every unfinished row."""
  b = state.canvas.shape[0]
  bl = opts.block_length
  start = _block_start(opts, state)
  if opts.cache == "none":
    logits = llada.bidirectional_logits(params, cfg, state.canvas, state.valid, state.positions)
    logits, cache = _block_logits(logits, start, bl), None
  else:
    logits, cache = _cached_step_logits(params, cfg, opts, state)
  finite = state.finite & (sampling.all_finite(logits) | state.done)
  logits = sampling.forbid(logits, (cfg.mask_token_id,))
  keys = sampling.row_keys(state.rng, state.step, b, state.knobs.get("row_offset", 0))
  temperature = state.knobs["temperature"]
  x0 = jax.vmap(lambda lg, k: sampling.gumbel_argmax(lg, temperature, k))(logits, keys)
  conf = sampling.confidence(logits, x0, "probability")

  block = jax.lax.dynamic_slice_in_dim(state.canvas, start, bl, axis=1)
  active = ~state.done if opts.early_stop else jnp.ones((b,), bool)
  candidates = (block == cfg.mask_token_id) & active[:, None]
  if opts.rule == "threshold":
    commit = sampling.threshold_mask(conf, candidates, state.knobs["threshold"])
  else:
    commit = sampling.factor_mask(conf, candidates, state.knobs["factor"])
  block = jnp.where(commit, x0, block)
  canvas = jax.lax.dynamic_update_slice_in_dim(state.canvas, block, start, axis=1)

  new = state.replace(canvas=canvas, cache=cache, step=state.step + 1, nfe=state.nfe + 1,
                      finite=finite,
                      committed=state.committed + jnp.sum(commit, axis=1, dtype=jnp.int32))
  done = llada.row_done(cfg, *llada.response_view(cfg, opts, new))
  filled = jnp.all(block != cfg.mask_token_id, axis=1)
  advance = jnp.all(filled | (done if opts.early_stop else False))
  return new.replace(done=done, block=state.block + advance.astype(jnp.int32), fresh=advance)


def running(opts: FastDLLMOptions, state: FastState) -> Array:
  # `step < G` is a guard only: every step fills >= 1 slot per unfinished row.
  more = (state.block < opts.num_blocks) & (state.step < opts.gen_length)
  return more & ~jnp.all(state.done) if opts.early_stop else more


def response_view(cfg: ModelConfig, opts: FastDLLMOptions, state: FastState):
  """([B, G] response slots, [B, G] bool decided)."""
  return llada.response_view(cfg, opts, state)


def finish(cfg: ModelConfig, opts: FastDLLMOptions, state: FastState) -> base.DecodeOutput:
  return llada.finish(cfg, opts, state)


@functools.partial(jax.jit, static_argnames=("cfg", "opts"))
def _generate(params, tokens, valid, rng, knobs, *, cfg, opts):
  state = init_state(params, cfg, opts, tokens, valid, rng, knobs)
  state = jax.lax.while_loop(functools.partial(running, opts),
                             functools.partial(step, params, cfg, opts), state)
  return finish(cfg, opts, state)


_jit_init = jax.jit(init_state, static_argnums=(1, 2))
_jit_step = jax.jit(step, static_argnums=(1, 2), donate_argnums=(3,))


def jit_init_state(params, cfg: ModelConfig, opts: FastDLLMOptions, tokens, valid, rng):
  """Jitted `init_state`; compiled once per static part of `opts` (knobs ride in the state)."""
  static, knobs = opts.split()
  return _jit_init(params, cfg, static, tokens, valid, rng, knobs)


def jit_step(params, cfg: ModelConfig, opts: FastDLLMOptions, state: FastState) -> FastState:
  """Jitted `step` with the state donated; reads the traced options from `state.knobs`."""
  return _jit_step(params, cfg, opts.split()[0], state)


def fast_dllm_generate(params, cfg: ModelConfig, prompt_tokens, prompt_valid=None, rng=None, *,
                       on_nonfinite: str = "raise", **options) -> base.DecodeOutput:
  """Fast-dLLM decoding of a left-padded prompt batch (one jitted while_loop).

  Args:
    params: model parameters (a bidirectional masked-diffusion LM).
    cfg: the model config (needs mask_token_id).
    prompt_tokens: [B, P] int left-padded prompts; prompt_valid: [B, P] bool (None: all real).
    rng: PRNG key for temperature > 0 (default key 0).
    on_nonfinite: "raise" (NonFiniteLogitsError naming rows whose logits were NaN/inf) or
      "flag" (return them with `finite` False, lengths 0).
    **options: fields of `FastDLLMOptions` (unknown names raise ValueError).
  """
  base.check_on_nonfinite(on_nonfinite)
  opts = base.make_options(FastDLLMOptions, options)
  check(cfg, prompt_tokens, prompt_valid, opts)
  rng = jax.random.key(0) if rng is None else rng
  tokens, valid = base.prompt_inputs(prompt_tokens, prompt_valid)
  static, knobs = opts.split()
  out = _generate(params, tokens, valid, rng, knobs, cfg=cfg, opts=static)
  return base.raise_if_nonfinite(out, on_nonfinite)


def check(cfg: ModelConfig, tokens, valid, opts: FastDLLMOptions) -> None:
  """Validates a prompt batch against the options (before anything is compiled)."""
  base.check_prompts(cfg, tokens, valid, opts.gen_length, block_length=opts.block_length)
