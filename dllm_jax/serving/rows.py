"""Per-row decoders: how the engine starts, inserts, steps and reads the rows of one method.

Shape legend: B slots (the engine's batch), A admitted rows, P the largest prompt bucket,
p this admission's bucket, G gen_length, L layers, K kv heads, Dh head dim.

A decoder module (`decoding/ar.py`, `d2f.py`, `fast_dllm.py`, `llada.py`, `speculative.py`)
keeps every cursor per row and, given per-row keys, draws a row's noise from its own key only;
so a batch row can be replaced by a fresh one while the others keep their state. A
`RowDecoder` adapts a module to the engine:

  make_options(cfg, options) -> opts           checked options (ValueError naming the fix);
      a method that ranks confidences gets batch_invariant=True (`invariant_options`)
  split(opts) -> (static, traced)               jit-static part, traced options
  traced_names(traced) -> the request options the traced part carries per row
  gen_length(static) -> G
  check(cfg, tokens, valid, opts)               the method's prompt checks (ValueError)
  lane_params(params, cfg, static, options, mesh, rules) -> the lane's params (default: the
      engine's; speculative: (target, drafter), its `lane_options` given to the engine only)
  check_window(cfg, static, P)                  the lane's window check (ValueError)
  mask_id(cfg, static) -> the id prompts must not hold (diffusion's [MASK]) or None
  init(params, cfg, static, traced, tokens [A, p], valid [A, p], keys [A], mesh, rules)
      -> state of A rows (traced: [A] leaves, each row's own options) (the method's batched init: AR prefill, D2F's first forward);
      a decoder with `row_options` also gets row_inputs [A] (`row_input` of each request)
  pad(cfg, static, state, P) -> the A-row state as if its prompts were padded to P
  step(params, cfg, static, state, mesh, rules) -> state   (one batched forward)
  with_traced(state, traced) -> state holding the traced options ([B] leaves, one per row)
  progress(static, state) -> (response [B, G], prefix [B], done [B], finite [B], nfe [B])
      prefix: leading response slots that are final (what may be streamed); nfe: forwards
      the row was live in.

Insertion is generic (`row_axes`, `scatter_rows`): every non-scalar leaf of a state is per
row on axis 0, except the K/V caches' k and v ([L, B, S, K, Dh]) on axis 1 (the caches are
the state fields a decoder names in `cache_fields`: `cache`, or speculative's and adaptive's
`tcache` and `dcache`); scalars (loop counters) are shared and kept. The traced options are
per row ([B] leaves: each row holds its request's values, `stack_traced`), so requests with
different temperatures, top_p or thresholds share one batch and one program. A decoder
whose state breaks that rule overrides `row_axes`.

Served decoders (`register(decoder_class, rows)` adds one, with no change to the engine; the
engine finds a method's adapter through `decoding.registry` and `for_method`):
  ar               `ARRows`: prefill admits a row; its cache is position-ordered, so `pad`
                   appends empty slots.
  d2f, block_diffusion
                   `D2FRows`: the first forward (prompt + block 0) admits a row; `pad`
                   left-pads the kept prompt and appends empty cache slots.
  fast_dllm        `FastDLLMRows`: rules threshold / factor, cache none / prefix / dual
                   (threshold, factor, temperature traced). A row joins with its all-masked
                   canvas [A, p + G] and no forward yet (its first step refreshes its block-0
                   cache); its cache holds the canvas slots in canvas order, so `pad`
                   prepends padding slots to canvas and cache (the state then equals one
                   built at P). Its static part (`FastStatic`) carries the [MASK] id by which
                   `progress` reads decided slots. Its state keeps the axis rule.
  llada, dream     `LLaDARows`: FastDLLMRows over `llada.py` (no cache; CFG, every
                   remasking and unmasking rule). Each row runs its own step schedule
                   (`row_step` [B]: block, count and keys per row); done when its answer
                   is final or its own S steps ran.
  speculative      `speculative_rows.SpeculativeRows`: a drafter ("ar", "d2f",
                   "block_diffusion", "selfspec") proposes k tokens, the AR target verifies
                   them; two caches per slot, per-row acceptance and rollback (see that
                   module).
  selfspec         `selfspec_rows.SelfSpecRows`: one network verifies the last draft and
                   drafts the next k tokens in one forward; one cache per slot.
  adaptive         `adaptive_rows.AdaptiveRows`: per row and round, the drafter's block
                   committed in parallel, verified by the AR target, or plain AR; a
                   request's `task` tag (a row option) may force its mode.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import ar, base, d2f, fast_dllm, llada, protocol, registry
from dllm_jax.models import masks
from dllm_jax.models.config import ModelConfig

Array = jnp.ndarray


def request_keys(seeds) -> Array:
  """[A] per-row PRNG keys of request seeds (uint32). Decoding one prompt alone with
  `rng=request_keys([seed])` reproduces the engine's output for that request."""
  return jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))


def invariant_options(method: str, options: dict) -> dict:
  """`options` with `batch_invariant=True`: a lane of a method that ranks confidences ranks
  them on the grid, so a row's output is the one it gives decoded alone whatever shares its
  batch (the engine's contract). ValueError if the lane or a request sets it False."""
  if not base.check_flag("batch_invariant", options.get("batch_invariant", True)):
    raise ValueError(f"batch_invariant=False: the serving engine's {method!r} lane always "
                     "ranks batch-invariantly (a row's output must not depend on what shares "
                     "its batch); drop the option or pass True.")
  return {**options, "batch_invariant": True}


def pad_axis(x: Array, axis: int, before: int, after: int, value) -> Array:
  if not before and not after:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (before, after)
  return jnp.pad(x, widths, constant_values=value)


def _pad_cache(cache, capacity: int):
  """A cache with `capacity` slots per row: new slots empty (NO_KEY), lengths unchanged."""
  extra = capacity - cache.capacity
  return cache.replace(k=pad_axis(cache.k, 2, 0, extra, 0),
                       v=pad_axis(cache.v, 2, 0, extra, 0),
                       block_ids=pad_axis(cache.block_ids, 1, 0, extra, masks.NO_KEY))


def prepend_cache_slots(cache, extra: int, capacity: int):
  """`extra` empty slots (NO_KEY) before every row's slots, lengths + extra, cut to
  `capacity`: a cache that holds each row's prompt in its first p slots and its response
  after them, re-padded to a prompt bucket p + extra (positions are the rows' own, so
  moving the slots changes no attention)."""
  if not extra:
    return cache
  return cache.replace(k=pad_axis(cache.k, 2, extra, 0, 0)[:, :, :capacity],
                       v=pad_axis(cache.v, 2, extra, 0, 0)[:, :, :capacity],
                       block_ids=pad_axis(cache.block_ids, 1, extra, 0,
                                           masks.NO_KEY)[:, :capacity],
                       length=cache.length + extra)


def _leading_true(mask: Array) -> Array:
  """[B, G] bool -> [B] int32 length of each row's leading run of True."""
  return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class RowDecoder:
  """Base of the per-row adapters (hashable: a jit static argument). `method` is the
  registry name the adapter serves (`for_method` sets it)."""
  method: str
  needs_mask: bool
  # Options fixed per lane, given once to the engine (e.g. a second model's params); a
  # request naming one is refused.
  lane_options = ()
  # State fields that are K/V caches: their k and v ([L, B, S, K, Dh]) are per row on axis 1.
  cache_fields = ("cache",)
  # Traced options whose zero is a program of its own (`base.ZERO_IS_STATIC`: temperature 0
  # compiles argmax with no sampling in it). A lane built sampling-capable (`Lane`) compiles
  # the sampling program and serves every value of these per row, zero included.
  sampling_options = ()
  # Request options that may differ from row to row of a lane (adaptive's `task` tag):
  # `row_input` turns a request's into one int32, and `init` receives the admitted rows'
  # as `row_inputs` [A] (only decoders that declare some).
  row_options = ()

  def traced_names(self, traced) -> tuple[str, ...]:
    """The request options `traced` (a lane's traced part) carries, one value per row: what a
    request may set for its own row without recompiling. Default: the keys of a traced dict
    (`base.split_options` keys it by option name); none for any other traced part."""
    return tuple(traced) if isinstance(traced, dict) else ()

  def row_input(self, opts, options: dict) -> int:
    """The int32 a request's `row_options` values give its row (ValueError naming the fix);
    `options` is empty for a request that sets none."""
    return 0

  def lane_params(self, params, cfg: ModelConfig, static, options: dict, mesh, rules):
    """The params the lane's programs take (the engine's, already placed on its mesh)."""
    return params

  def check_window(self, cfg: ModelConfig, static, prompt_len: int) -> None:
    """Raises ValueError unless the largest prompt bucket + gen_length fits the window."""
    base.check_window(cfg, prompt_len, self.gen_length(static),
                      getattr(static, "block_length", 1))

  def mask_id(self, cfg: ModelConfig, static):
    """The id a prompt must not hold (the [MASK] a diffusion model decodes), or None."""
    return cfg.mask_token_id if self.needs_mask else None

  def row_axes(self, state):
    """The row axis of every leaf (None: shared). See the module docstring."""
    def axis(path, leaf):
      if jnp.ndim(leaf) == 0:
        return None
      keys = [getattr(p, "name", getattr(p, "key", None)) for p in path]
      return 1 if (len(keys) >= 2 and keys[-2] in self.cache_fields
                   and keys[-1] in ("k", "v")) else 0
    return jax.tree_util.tree_map_with_path(axis, state)


class ARRows(RowDecoder):
  """Autoregressive rows: prefill admits a row, one token per forward."""

  sampling_options = ("temperature",)

  def __init__(self):
    super().__init__(method="", needs_mask=False)

  def make_options(self, cfg: ModelConfig, options: dict):
    return base.make_options(ar.AROptions, options)

  def split(self, opts):
    return opts.split()

  def gen_length(self, static) -> int:
    return static.gen_length

  def check(self, cfg, tokens, valid, opts):
    ar.check(cfg, tokens, valid, opts)

  def init(self, params, cfg, static, traced, tokens, valid, keys, mesh=None, rules=None):
    return ar.prefill(params, cfg, static, tokens, valid, keys, traced)

  def pad(self, cfg, static, state, prompt_len: int):
    return state.replace(cache=_pad_cache(state.cache, prompt_len + static.gen_length))

  def step(self, params, cfg, static, state, mesh=None, rules=None):
    return ar.step(params, cfg, static, state)

  def with_traced(self, state, traced):
    return state.replace(traced=traced)

  def progress(self, static, state):
    # A live row has committed response[:committed]; a done row's EOS is in it.
    return state.response, state.committed, state.done, state.finite, state.committed


# The options a D2F / block-diffusion plan's traced `Thresholds` are made of.
D2F_TRACED = ("temperature", "tau_add", "tau_act", "tau_conf", "entropy_bound")


class D2FRows(RowDecoder):
  """D2F / block-diffusion rows: the first forward (prompt + block 0) admits a row."""

  sampling_options = ("temperature",)

  def __init__(self):
    super().__init__(method="", needs_mask=True)

  def make_options(self, cfg: ModelConfig, options: dict):
    return registry.get(self.method).plan(cfg, **invariant_options(self.method, options))

  def split(self, plan):
    return plan.decoder.opts, plan.traced

  def traced_names(self, traced) -> tuple[str, ...]:
    # `Thresholds` holds tau_add / tau_act as counts: name the options they come from.
    names = set(protocol.option_names(self.method))
    return tuple(n for n in D2F_TRACED if n in names)

  def gen_length(self, static) -> int:
    return static.gen_length

  def check(self, cfg, tokens, valid, plan):
    plan.decoder.check(tokens, valid)

  def init(self, params, cfg, static, traced, tokens, valid, keys, mesh=None, rules=None):
    kw = {} if mesh is None else dict(mesh=mesh, rules=rules)
    return d2f._init(params, tokens, valid, keys, traced, cfg=cfg, opts=static, **kw)

  def pad(self, cfg, static, state, prompt_len: int):
    extra = prompt_len - state.prompt.shape[1]
    state = state.replace(prompt=pad_axis(state.prompt, 1, extra, 0, static.pad_id),
                          prompt_valid=pad_axis(state.prompt_valid, 1, extra, 0, False))
    if state.cache is not None:
      state = state.replace(cache=_pad_cache(state.cache, prompt_len + static.gen_length))
    return state

  def step(self, params, cfg, static, state, mesh=None, rules=None):
    kw = {} if mesh is None else dict(mesh=mesh, rules=rules)
    return d2f._step(params, state, cfg=cfg, opts=static, **kw)

  def with_traced(self, state, traced):
    return state.replace(traced=traced)

  def progress(self, static, state):
    return (state.response, _leading_true(state.decided), state.done, state.finite,
            state.forwards)


@dataclasses.dataclass(frozen=True)
class FastStatic:
  """A canvas decoder's jit-static part in the engine (Fast-dLLM, LLaDA / Dream): the static
  options and the model's [MASK] id, by which `progress` tells decided response slots (the
  options do not hold it)."""
  opts: object
  mask_id: int

  @property
  def gen_length(self) -> int:
    return self.opts.gen_length

  @property
  def block_length(self) -> int:
    """The block the engine's window check rounds gen_length to."""
    return self.opts.block_length


class FastDLLMRows(RowDecoder):
  """Fast-dLLM rows (rule threshold / factor, cache none / prefix / dual): a row joins with
  its all-masked canvas and no forward yet (its first step is its block-0 refresh).

  Written over the method's `protocol.LoopDecoder` module (`init_state`, `step`, `check`),
  its options class and defaults, so LLaDA / Dream rows (`LLaDARows`) share it."""

  sampling_options = ("temperature",)

  def __init__(self):
    super().__init__(method="", needs_mask=True)

  @property
  def module(self):
    return registry.get(self.method).module

  def make_options(self, cfg: ModelConfig, options: dict):
    if cfg.mask_token_id is None:
      raise ValueError(f"model config {cfg.name!r} has no mask_token_id; method "
                       f"{self.method!r} needs one (serve a masked-diffusion model).")
    decoder = registry.get(self.method)
    return FastStatic(base.make_options(
        decoder.options, {**decoder.defaults, **invariant_options(self.method, options)}),
                      cfg.mask_token_id)

  def split(self, opts: FastStatic):
    static, traced = opts.opts.split()
    return FastStatic(static, opts.mask_id), traced

  def gen_length(self, static) -> int:
    return static.gen_length

  def check(self, cfg, tokens, valid, opts):
    self.module.check(cfg, tokens, valid, opts.opts)

  def init(self, params, cfg, static, traced, tokens, valid, keys, mesh=None, rules=None):
    return self.module.init_state(params, cfg, static.opts, tokens, valid, keys, traced)

  def pad(self, cfg, static, state, prompt_len: int):
    # The canvas is prompt + G and the cache holds its slots in canvas order, so padding the
    # prompt prepends slots to both: a padding token (invalid, position 0, as init_canvas
    # writes it) and an empty cache slot. No forward ran yet, so cache lengths are 0 either way.
    extra = prompt_len - (state.canvas.shape[1] - static.gen_length)
    state = state.replace(canvas=pad_axis(state.canvas, 1, extra, 0, base.output_pad_id(cfg)),
                          valid=pad_axis(state.valid, 1, extra, 0, False),
                          positions=pad_axis(state.positions, 1, extra, 0, 0))
    if getattr(state, "cache", None) is not None:
      cache = state.cache
      state = state.replace(cache=cache.replace(
          k=pad_axis(cache.k, 2, extra, 0, 0), v=pad_axis(cache.v, 2, extra, 0, 0),
          block_ids=pad_axis(cache.block_ids, 1, extra, 0, masks.NO_KEY)))
    return state

  def step(self, params, cfg, static, state, mesh=None, rules=None):
    new = self.module.step(params, cfg, static.opts, state)
    # `done` stays set: a row the engine retired (done set by the host) must not run on.
    # Decoding alone it never unsets (a final answer stays final), so outputs are unchanged.
    return new.replace(done=new.done | state.done)

  def with_traced(self, state, traced):
    return state.replace(traced=traced)

  def progress(self, static, state):
    response = state.canvas[:, -static.gen_length:]
    return (response, _leading_true(response != static.mask_id), state.done, state.finite,
            state.forwards)


class LLaDARows(FastDLLMRows):
  """LLaDA / Dream rows: Fast-dLLM's canvas rows (all-masked canvas, no forward yet; `pad`
  prepends padding slots). Each row follows its own step count (`row_step` [B], also the
  forwards it was live in), so its block, count and keys do not depend on when it joined;
  it is done when its answer is final or its S steps ran."""

  sampling_options = ("temperature", "alg_temp")

  def progress(self, static, state):
    response = state.canvas[:, -static.gen_length:]
    return (response, _leading_true(response != static.mask_id), state.done, state.finite,
            state.row_step)


SERVED: dict[type, RowDecoder] = {}


def register(decoder_class: type, rows: RowDecoder) -> None:
  """Makes the methods whose decoder is `decoder_class` servable by every engine built
  afterwards, through the adapter `rows`."""
  SERVED[decoder_class] = rows


def for_method(method: str) -> RowDecoder | None:
  """The adapter serving `method` (a registry name), or None where it cannot be served."""
  rows = SERVED.get(registry.get(method))
  if rows is None:
    return None
  rows = copy.copy(rows)
  object.__setattr__(rows, "method", method)
  return rows


def serves_sampling(method: str) -> bool:
  """Whether a lane of `method` may be built `sampling=True`: it serves greedy and sampled
  rows, each at its own temperature, in one program (the hybrids' temperature is static)."""
  rows = for_method(method)
  return rows is not None and bool(rows.sampling_options)


def served_methods() -> list[str]:
  """The registered methods an engine can serve."""
  return sorted(m for m in registry.names() if registry.get(m) in SERVED)


register(ar.ARDecoder, ARRows())
register(d2f.D2FDecoder, D2FRows())
register(d2f.BlockDiffusionDecoder, D2FRows())
register(fast_dllm.FastDLLMDecoder, FastDLLMRows())
register(llada.LLaDADecoder, LLaDARows())
register(llada.DreamDecoder, LLaDARows())


def scatter_rows(decoder: RowDecoder, state, new, slots: Array):
  """`state` with rows `slots` [A] replaced by the A rows of `new` (an out-of-range slot,
  e.g. B for an unused admission row, is dropped). Shared scalars keep `state`'s values."""
  def put(axis, old, fresh):
    if axis is None:
      return old
    index = (slice(None),) * axis + (slots,)
    return old.at[index].set(fresh, mode="drop")
  return jax.tree_util.tree_map(put, decoder.row_axes(state), state, new,
                                is_leaf=lambda x: x is None)


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def stack_traced(traced: list):
  """The traced options of A rows ([] leaves each, e.g. one set per request) as one set of
  [A] leaves: what a lane's init takes, so every row decodes with its own values."""
  return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *traced)


def empty_like(shapes, decoder: RowDecoder, traced):
  """A state of the given abstract shapes with every row done (empty slots) and the lane's
  traced options in every row (an admission replaces a row's with its request's)."""
  def make(s):
    if _is_key(s):
      return jnp.broadcast_to(jax.random.key(0), s.shape)
    return jnp.zeros(s.shape, s.dtype)
  state = jax.tree_util.tree_map(make, shapes)
  b = state.done.shape[0]
  state = decoder.with_traced(state, jax.tree_util.tree_map(jnp.asarray,
                                                            stack_traced([traced] * b)))
  return state.replace(done=jnp.ones_like(state.done), finite=jnp.ones_like(state.finite))


def numpy_rows(x) -> np.ndarray:
  return np.asarray(jax.device_get(x))
