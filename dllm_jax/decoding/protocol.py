"""The decoder protocol: one object per method, behind every driver.

Shape legend: B batch, P padded prompt length, G gen_length.

A decoder is a frozen, hashable dataclass holding the model config and the method's
*static* options (shapes and program structure: a jit static argument). `Decoder.plan(cfg,
**options)` checks the user's options (a ValueError naming the fix) and returns a `Plan`:
the decoder, its *traced* options (a pytree of [] arrays riding in the state, so sweeping them
never recompiles) and, for the hybrids, the drafter's params. The drivers written once over
this interface are `api.generate` (one jitted `lax.while_loop`, in stages that finished rows
leave for a batch: `run_batch`, `compaction`), `streaming.stream` (one
jitted step per event), `data_parallel.decode` (one loop per data shard) and, through
`serving.rows`, the serving lanes.

    plan = registry.get("d2f").plan(cfg, gen_length=64, tau_conf=0.8)
    plan.decoder.check(tokens, valid)                  # host-side prompt checks
    params = plan.params(params)                       # hybrids: (target, drafter)
    state = plan.decoder.init(params, tokens, valid, rng, plan.traced)
    while plan.decoder.running(state):
      state = plan.decoder.step(params, state)
    out = plan.decoder.output(state)                   # a base.DecodeOutput

The interface every decoder provides (all but `check` are traceable):

  init(params, tokens [B, P], valid [B, P], rng, traced, row_inputs=None) -> state
  step(params, state) -> state                   one loop iteration (one forward, or a
                                                 hybrid's round: its drafter forwards + one
                                                 verifying forward)
  done(state) -> [B] bool                        the row's answer is final
  running(state) -> [] bool                      the while_loop condition
  view(state) -> ([B, G] response, [B, G] bool decided)   the committed-so-far view
  output(state) -> DecodeOutput
  with_offset(traced, offset) -> traced          row r draws its keys as global row
                                                 offset + r (a data shard's rows)
  abstract_params() -> the params' abstract tree (what `plan.params` returns, as shapes)

and as class attributes: `name` (set by `registry.register`), `init_forwards` (the init
already runs a forward, so a stream's first event comes before any step), `uses_drafter`
(the hybrids that take drafter_params / drafter_cfg), `row_options` (options with one entry
per prompt, such as adaptive's task tags), `attention` / `drafter_attention` (the attention
pattern the decoded model and its drafter are trained with) and `options` (the options
dataclass whose fields are the option names; or override `option_names`).

The serving lane (`serving.rows`, one adapter for every decoder) also reads hooks declared
here with defaults: `cache_fields` / `row_axes`, `pad` (re-pad a state to a larger prompt
bucket), `progress` / `forwards` (per-row response, final prefix, done, finite, NFE),
`lane_plan`, `lane_options`, `lane_row_options` / `row_input`, `sampling_options`,
`check_window` and `prompt_mask_id`.

Adding a decoder is one class and one `registry.register` call
(docs/adding_a_decoder.md walks through one).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, compaction, registry, sampling
from dllm_jax.models import masks
from dllm_jax.models.config import ModelConfig
from dllm_jax.parallel import mesh as mesh_lib
from dllm_jax.parallel import sharding

Array = jnp.ndarray


@dataclasses.dataclass(frozen=True)
class Plan:
  """A checked decode: the decoder (static), its traced options, a hybrid's drafter params
  and per-row inputs (adaptive's forced modes, [B] int32, or None)."""
  decoder: "Decoder"
  traced: Any
  drafter_params: Any = None
  row_inputs: Any = None

  def params(self, params):
    """What the decoder's `init` / `step` take: `params`, or (params, drafter) for hybrids."""
    return (params, self.drafter_params) if self.decoder.uses_drafter else params


@dataclasses.dataclass(frozen=True)
class Decoder:
  """Base of every decoder: the model config and the static options (hashable)."""
  cfg: ModelConfig
  opts: Any

  name: ClassVar[str] = ""
  options: ClassVar[type | None] = None
  defaults: ClassVar[dict] = {}
  init_forwards: ClassVar[bool] = False
  uses_drafter: ClassVar[bool] = False
  row_options: ClassVar[tuple[str, ...]] = ()
  # The attention pattern of the model the method decodes ("causal", "bidirectional",
  # "block_causal", or "selfspec": causal context with a mask block, as `selfspec_loss`
  # trains), and of its drafter: what a model must be trained with to decode well (the demo
  # picks its models by these).
  attention: ClassVar[str] = "bidirectional"
  drafter_attention: ClassVar[str | None] = None

  # --------------------------------------------------------------- building (host side)

  @classmethod
  def option_names(cls) -> tuple[str, ...]:
    """The options `plan` accepts (besides on_nonfinite, which the drivers own)."""
    return tuple(f.name for f in dataclasses.fields(cls.options))

  @classmethod
  def plan(cls, cfg: ModelConfig, **options) -> Plan:
    """Checks `options` and splits them into the static decoder and the traced options."""
    _, static, traced = base.checked_options(cls.options, {**cls.defaults, **options})
    return Plan(cls(cfg, static), traced)

  @classmethod
  def run_defaults(cls, block: int) -> dict:
    """Options a training run whose data uses `block`-slot blocks gives this method."""
    del block
    return {}

  @property
  def gen_length(self) -> int:
    return self.opts.gen_length

  def check(self, tokens, valid) -> None:
    """Raises ValueError naming the fix when the prompt batch does not fit the options."""
    base.check_prompts(self.cfg, tokens, valid, self.gen_length)

  # --------------------------------------------------------------- the loop (traceable)

  def init(self, params, tokens, valid, rng, traced, row_inputs=None):
    raise NotImplementedError

  def step(self, params, state):
    raise NotImplementedError

  def done(self, state) -> Array:
    return state.done

  def running(self, state) -> Array:
    raise NotImplementedError

  def view(self, state) -> tuple[Array, Array]:
    raise NotImplementedError

  def output(self, state) -> base.DecodeOutput:
    raise NotImplementedError

  def loop(self, params, state):
    """Runs `step` while `running` (one `lax.while_loop`; a decoder may split it)."""
    return jax.lax.while_loop(self.running, functools.partial(self.step, params), state)

  @property
  def compacts(self) -> bool:
    """Whether a batch decode may drop finished rows from the forward (`compaction`): true
    when a finished row's state never changes again, so not stepping it changes nothing, and
    the loop is the plain `running` / `step` one. Default: the options' `early_stop` where
    they have one (without it finished rows run on), else True."""
    plain = type(self).loop is Decoder.loop and type(self).decode is Decoder.decode
    return plain and bool(getattr(self.opts, "early_stop", True))

  def with_row_ids(self, state):
    """`state` with its [] `row_offset` (row r draws its keys as global row `row_offset + r`)
    replaced by the [B] global index of each row, which moves with the row when a compacted
    decode gathers rows (`sampling.row_indices`)."""
    rows = self.done(state).shape[0]
    return _map_row_offset(state, lambda offset: sampling.row_indices(rows, offset))

  def without_row_ids(self, state):
    """`with_row_ids` undone on a state whose rows are back in their batch order: the [B]
    ids -> the [] index of row 0 (what `output` and `stats` then show)."""
    return _map_row_offset(state, lambda ids: ids[0])

  def decode(self, params, tokens, valid, rng, traced, row_inputs=None,
             with_stats: bool = False):
    """init, loop, output (and `stats`): what `run` compiles (a decoder may take a
    shortcut)."""
    state = self.loop(params, self.init(params, tokens, valid, rng, traced, row_inputs))
    return (self.output(state), self.stats(state)) if with_stats else self.output(state)

  def stats(self, state):
    """The method's own record of a finished decode (the hybrids' forward counts and
    acceptance); `*_generate(..., return_stats=True)` returns it."""
    raise ValueError(f"method {self.name!r} keeps no stats beyond its DecodeOutput.")

  def with_offset(self, traced, offset):
    return dict(traced, row_offset=offset)

  def abstract_params(self):
    from dllm_jax.models.transformer import abstract_params  # pylint: disable=import-outside-toplevel
    return abstract_params(self.cfg)

  def on_mesh(self, mesh, rules) -> "Decoder":
    """The decoder to run as one SPMD program on `mesh` (default: itself; a decoder that
    pins its state's sharding returns a copy that knows the mesh)."""
    del mesh, rules
    return self

  # --------------------------------------------------------------- serving (serving.rows)
  # A served state keeps every cursor per row and a [B] `done` and `finite`, so a slot's row
  # can be replaced while the others decode on. `cache_fields`: the state fields that are
  # K/V caches (their k and v, [L, B, S, K, Dh], are per row on axis 1); `lane_options`:
  # options given once per lane (a second model), which a request may not name;
  # `lane_row_options`: request options that may differ between a lane's rows (`row_input`
  # turns them into the row's `row_inputs` entry); `sampling_options`: traced options whose
  # zero is a program of its own (`base.ZERO_IS_STATIC`), served per row by a sampling lane.
  cache_fields: ClassVar[tuple[str, ...]] = ("cache",)
  lane_options: ClassVar[tuple[str, ...]] = ()
  lane_row_options: ClassVar[tuple[str, ...]] = ()
  sampling_options: ClassVar[tuple[str, ...]] = ("temperature",)

  @classmethod
  def per_row_options(cls, traced) -> tuple[str, ...]:
    """The options a lane's traced part holds per row (a request may set them): default,
    the traced dict's keys that are option names."""
    return tuple(k for k in traced if k in cls.option_names()) if isinstance(traced, dict) else ()

  @classmethod
  def lane_plan(cls, cfg: ModelConfig, options: dict) -> Plan:
    """The plan of a serving lane's (or request's) options (default: `plan`)."""
    return cls.plan(cfg, **options)

  def row_input(self, options: dict, request: dict) -> int:
    """The int32 a request's `lane_row_options` give its row (`options`: the lane's)."""
    del options, request
    return 0

  @classmethod
  def row_axes(cls, state):
    """The row axis of every state leaf (None: a shared scalar): 0, or 1 for the k and v of
    the `cache_fields`."""
    def axis(path, leaf):
      if jnp.ndim(leaf) == 0:
        return None
      keys = [getattr(p, "name", getattr(p, "key", None)) for p in path]
      return 1 if (len(keys) >= 2 and keys[-2] in cls.cache_fields
                   and keys[-1] in ("k", "v")) else 0
    return jax.tree_util.tree_map_with_path(axis, state)

  def prompt_mask_id(self):
    """The id a served prompt must not hold (the [MASK] a diffusion model decodes), or None."""
    return None if self.attention == "causal" else self.cfg.mask_token_id

  def check_window(self, prompt_len: int) -> None:
    """Raises ValueError unless a lane's largest prompt bucket + gen_length fits."""
    base.check_window(self.cfg, prompt_len, self.gen_length,
                      getattr(self.opts, "block_length", 1))

  def pad(self, state, prompt_len: int):
    """A state built at a smaller prompt bucket as if built at `prompt_len` (default: a
    canvas state, [B, p + G] `canvas` / `valid` / `positions` and a cache in canvas order
    that no forward wrote yet, gets padding slots prepended)."""
    extra = prompt_len + self.gen_length - state.canvas.shape[1]
    state = state.replace(
        canvas=pad_axis(state.canvas, 1, extra, 0, base.output_pad_id(self.cfg)),
        valid=pad_axis(state.valid, 1, extra, 0, False),
        positions=pad_axis(state.positions, 1, extra, 0, 0))
    if getattr(state, "cache", None) is not None:
      c = state.cache
      state = state.replace(cache=c.replace(
          k=pad_axis(c.k, 2, extra, 0, 0), v=pad_axis(c.v, 2, extra, 0, 0),
          block_ids=pad_axis(c.block_ids, 1, extra, 0, masks.NO_KEY)))
    return state

  def forwards(self, state) -> Array:
    """[B] forwards each row was live in (its NFE decoded alone)."""
    return state.forwards

  def progress(self, state):
    """(response [B, G], prefix [B]: leading slots that are final, done [B], finite [B],
    nfe [B]): what a serving lane streams and harvests."""
    response, decided = self.view(state)
    return response, leading_true(decided), self.done(state), state.finite, self.forwards(state)


def _map_row_offset(state, fn):
  """`state` with `fn` applied to its `row_offset`: the state's own field, or the one in its
  `traced` options (a dict, where a missing offset counts as 0, or a dataclass)."""
  if hasattr(state, "row_offset"):
    return state.replace(row_offset=fn(state.row_offset))
  traced = state.traced
  if isinstance(traced, dict):
    return state.replace(traced=dict(traced, row_offset=fn(traced.get("row_offset", 0))))
  return state.replace(traced=traced.replace(row_offset=fn(traced.row_offset)))


def pad_axis(x: Array, axis: int, before: int, after: int, value) -> Array:
  if not before and not after:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (before, after)
  return jnp.pad(x, widths, constant_values=value)


def leading_true(mask: Array) -> Array:
  """[B, G] bool -> [B] int32 length of each row's leading run of True."""
  return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


def append_cache_slots(cache, capacity: int):
  """A cache with `capacity` slots per row: new slots empty (NO_KEY), lengths unchanged."""
  extra = capacity - cache.capacity
  return cache.replace(k=pad_axis(cache.k, 2, 0, extra, 0), v=pad_axis(cache.v, 2, 0, extra, 0),
                       block_ids=pad_axis(cache.block_ids, 1, 0, extra, masks.NO_KEY))


def prepend_cache_slots(cache, extra: int, capacity: int):
  """`extra` empty slots before every row's, lengths + extra, cut to `capacity`: a cache
  holding each row's prompt in its first p slots, re-padded to prompt bucket p + extra
  (positions are the rows' own, so moving the slots changes no attention)."""
  if not extra:
    return cache
  return cache.replace(k=pad_axis(cache.k, 2, extra, 0, 0)[:, :, :capacity],
                       v=pad_axis(cache.v, 2, extra, 0, 0)[:, :, :capacity],
                       block_ids=pad_axis(cache.block_ids, 1, extra, 0,
                                           masks.NO_KEY)[:, :capacity],
                       length=cache.length + extra)


class LoopDecoder(Decoder):
  """A decoder whose module holds the loop functions in the shared shape
  (`init_state(params, cfg, opts, tokens, valid, rng, traced)`, `step(params, cfg, opts,
  state)`, `running(opts, state)`, `response_view(cfg, opts, state)`, `finish(cfg, opts,
  state)`, `check(cfg, tokens, valid, opts)`): AR, LLaDA / Dream, Fast-dLLM."""
  module: ClassVar[Any] = None

  @classmethod
  def from_options(cls, cfg: ModelConfig, opts) -> Plan:
    """The plan of an options dataclass already built (its static part and traced)."""
    static, traced = opts.split()
    return Plan(cls(cfg, static), traced)

  def check(self, tokens, valid) -> None:
    self.module.check(self.cfg, tokens, valid, self.opts)

  def init(self, params, tokens, valid, rng, traced, row_inputs=None):
    return self.module.init_state(params, self.cfg, self.opts, tokens, valid, rng, traced)

  def step(self, params, state):
    return self.module.step(params, self.cfg, self.opts, state)

  def running(self, state) -> Array:
    return self.module.running(self.opts, state)

  def view(self, state):
    return self.module.response_view(self.cfg, self.opts, state)

  def output(self, state) -> base.DecodeOutput:
    return self.module.finish(self.cfg, self.opts, state)


# Old option names -> the shared name (rejected with a message naming the new one).
RENAMED = {"block_size": "block_length"}


def option_names(method: str) -> list[str]:
  """The options `method` accepts (its decoder's options, plus on_nonfinite)."""
  return list(_accepted(registry.get(method)))


@functools.cache
def _accepted(decoder_cls) -> tuple[str, ...]:
  """A decoder class's option names plus on_nonfinite (fixed per class: checked each call)."""
  return tuple(decoder_cls.option_names()) + ("on_nonfinite",)


def check_options(method: str, options: dict) -> None:
  """Raises ValueError naming unknown options and listing the valid ones."""
  valid = _accepted(registry.get(method))
  for old, new in RENAMED.items():
    if old in options and new in valid:
      raise ValueError(f"option {old}={options[old]!r}: the option is called {new} (the same "
                       f"name in every decoding method); pass {new} instead.")
  unknown = sorted(set(options).difference(valid))
  if unknown:
    raise ValueError(f"Unknown option(s) {unknown} for method {method!r}; valid options: "
                     f"{sorted(valid)}.")


def plan(method: str, cfg: ModelConfig, options: dict) -> Plan:
  """The checked `protocol.Plan` of `method` with `options` (on_nonfinite left out)."""
  check_options(method, options)
  options = {k: v for k, v in options.items() if k != "on_nonfinite"}
  return registry.get(method).plan(cfg, **options)


# ----------------------------------------------------------------------------- programs

@functools.partial(jax.jit, static_argnames=("decoder", "with_stats"))
def run(params, tokens, valid, rng, traced, row_inputs=None, *, decoder: Decoder,
        with_stats: bool = False):
  """The whole decode as one program: init, `lax.while_loop(running, step)`, output."""
  return decoder.decode(params, tokens, valid, rng, traced, row_inputs, with_stats)


def run_batch(params, tokens, valid, rng, traced, row_inputs=None, *, decoder: Decoder,
              with_stats: bool = False):
  """`run`'s result; for a decoder that `compacts` and more than one row, decoded in stages
  of shrinking batch that finished rows leave (`compaction.run`), so a batch whose rows
  finish apart costs no more than its rows decoded alone."""
  if decoder.compacts and np.shape(tokens)[0] > 1:
    return compaction.run(params, tokens, valid, rng, traced, row_inputs, decoder=decoder,
                          with_stats=with_stats)
  return run(params, tokens, valid, rng, traced, row_inputs, decoder=decoder,
             with_stats=with_stats)


def compiled_programs() -> tuple[int, int]:
  """How many decode programs `run_batch` holds compiled: (whole decodes and first stages:
  `run`'s and `compaction.start`'s, one per decoder, option set and shape; later stages
  and merges: `compaction.stage`'s and `merge`'s, at most one per stage shape, compiled when
  a decode first reaches it). A sweep that recompiles shows in the first."""
  later = compaction.stage._cache_size() + compaction.merge._cache_size()
  return run._cache_size() + compaction.start._cache_size(), later


def clear_programs() -> None:
  """Drops every compiled decode program of `run_batch` (the next decode traces anew)."""
  for program in (run, compaction.start, compaction.stage, compaction.merge):
    program.clear_cache()


@functools.partial(jax.jit, static_argnames=("decoder",))
def jit_init(params, tokens, valid, rng, traced, row_inputs=None, *, decoder: Decoder):
  return decoder.init(params, tokens, valid, rng, traced, row_inputs)


@functools.partial(jax.jit, static_argnames=("decoder",), donate_argnames=("state",))
def jit_step(params, state, *, decoder: Decoder):
  return decoder.step(params, state)


def check_row_inputs(plan: Plan, batch: int) -> None:
  """Raises ValueError unless the plan's per-row inputs (adaptive's task tags) have one
  entry per prompt."""
  if plan.row_inputs is not None and len(plan.row_inputs) != batch:
    names = " / ".join(plan.decoder.row_options)
    raise ValueError(f"{names} has {len(plan.row_inputs)} entries for {batch} prompts; pass "
                     "one per prompt.")


def run_on_mesh(plan: Plan, params, tokens, valid, rng, mesh, rules, with_stats=False):
  """`run` as one SPMD program on `mesh`: the batch (a multiple of the data-parallel size)
  split over the data axes, params not yet on the mesh placed by `parallel.place_params`."""
  dp = mesh_lib.data_parallel_size(mesh, rules)
  if np.shape(tokens)[0] % dp:
    raise ValueError(f"batch {np.shape(tokens)[0]} is not divisible by the mesh's "
                     f"data-parallel size {dp}; pad the batch with dummy prompts (generate "
                     "does).")
  decoder = plan.decoder.on_mesh(mesh, rules)
  params = sharding.place_params(plan.params(params), mesh, rules,
                                 abstract=decoder.abstract_params)
  batch = mesh_lib.batch_sharding(mesh, 2, rules)
  tokens, valid = jax.device_put(tokens, batch), jax.device_put(valid, batch)
  rng, traced = jax.device_put((rng, plan.traced), mesh_lib.replicated(mesh))
  row_inputs = plan.row_inputs
  if row_inputs is not None:
    row_inputs = jax.device_put(np.asarray(row_inputs), mesh_lib.batch_sharding(mesh, 1, rules))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    return run(params, tokens, valid, rng, traced, row_inputs, decoder=decoder,
               with_stats=with_stats)


def decode_batch(decoder_cls, params, cfg: ModelConfig, prompt_tokens, prompt_valid=None,
                 rng=None, *, on_nonfinite: str = "raise", with_stats: bool = False,
                 mesh=None, rules=None, **options):
  """One decode of a left-padded batch, on one device or as one SPMD program on `mesh`:
  what each method's `*_generate` function runs (`api.generate` adds buckets and shard_map).
  Returns the DecodeOutput, and the decoder's `stats` too when `with_stats`."""
  base.check_on_nonfinite(on_nonfinite)
  plan = decoder_cls.plan(cfg, **options)
  plan.decoder.check(prompt_tokens, prompt_valid)
  check_row_inputs(plan, np.shape(prompt_tokens)[0])
  rng = jax.random.key(0) if rng is None else rng
  tokens, valid = base.prompt_inputs(prompt_tokens, prompt_valid)
  if mesh is None:
    out = run_batch(plan.params(params), tokens, valid, rng, plan.traced, plan.row_inputs,
                    decoder=plan.decoder, with_stats=with_stats)
  else:
    out = run_on_mesh(plan, params, tokens, valid, rng, mesh, mesh_lib.rules_from_config(rules),
                      with_stats)
  if with_stats:
    return base.raise_if_nonfinite(out[0], on_nonfinite), out[1]
  return base.raise_if_nonfinite(out, on_nonfinite)
