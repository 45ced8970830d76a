"""The serving lane's view of a decoder, written once over `decoding.protocol`.

Shape legend: B slots (the engine's batch), A admitted rows, P the largest prompt bucket,
p this admission's bucket, G gen_length.

Every registered decoder is servable: `RowDecoder(method)` drives its `protocol.Decoder`
(`lane_plan`, `init`, `step`, `pad`, `progress`, `row_axes` and the serving hooks the
protocol declares with defaults). A served decoder keeps every cursor per row and, given
per-row keys (`request_keys`), draws a row's noise from its own key only, so a slot's row can
be replaced by a fresh one while the others keep their state. The lane (`lanes.py`) calls:

  make_options(cfg, options) -> opts          checked options (ValueError naming the fix);
      a method that ranks confidences gets batch_invariant=True (`invariant_options`)
  split(opts) -> (static, traced)              the decoder (jit-static), its traced options
  init(params, cfg, static, traced [A leaves], tokens [A, p], valid [A, p], keys [A])
      -> state of A rows (adaptive's `task` rows also get row_inputs [A])
  pad(cfg, static, state, P)                   the A-row state as if built at P
  step(params, cfg, static, state, mesh, rules) one decoder step of all B slots
  progress(static, state) -> (response [B, G], prefix [B], done [B], finite [B], nfe [B])

Insertion is generic (`scatter_rows` on the decoder's `row_axes`: every non-scalar leaf per
row on axis 0, a cache's k and v on axis 1; scalars shared). The traced options are per row
([B] leaves, `stack_traced`), so requests with different temperatures, top_p or thresholds
share one batch and one program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, registry
from dllm_jax.models.config import ModelConfig
from dllm_jax.parallel import sharding

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


@dataclasses.dataclass(frozen=True)
class LaneOptions:
  """A lane's (or request's) checked options: their plan and the options themselves."""
  plan: object
  options: dict = dataclasses.field(compare=False, hash=False)


@dataclasses.dataclass(frozen=True)
class RowDecoder:
  """The registered method `method` as a lane drives it (hashable: a jit static argument)."""
  method: str

  @property
  def decoder_class(self):
    return registry.get(self.method)

  @property
  def lane_options(self) -> tuple[str, ...]:
    return self.decoder_class.lane_options

  @property
  def row_options(self) -> tuple[str, ...]:
    return self.decoder_class.lane_row_options

  @property
  def sampling_options(self) -> tuple[str, ...]:
    return self.decoder_class.sampling_options

  def traced_names(self, traced) -> tuple[str, ...]:
    """The request options a lane's traced part carries, one value per row: what a request
    may set for its own row without recompiling (the decoder's `per_row_options`)."""
    return self.decoder_class.per_row_options(traced)

  def make_options(self, cfg: ModelConfig, options: dict) -> LaneOptions:
    cls = self.decoder_class
    if self.method in registry.ranking_methods():
      options = invariant_options(self.method, options)
    plan = cls.lane_plan(cfg, options)
    if cls.attention != "causal" and cfg.mask_token_id is None:
      raise ValueError(f"model config {cfg.name!r} has no mask_token_id; method "
                       f"{self.method!r} needs one (serve a masked-diffusion model).")
    return LaneOptions(plan, options)

  def split(self, opts: LaneOptions):
    return opts.plan.decoder, opts.plan.traced

  def gen_length(self, static) -> int:
    return static.gen_length

  def check(self, cfg, tokens, valid, opts: LaneOptions):
    opts.plan.decoder.check(tokens, valid)

  def row_input(self, opts: LaneOptions, request: dict) -> int:
    """The int32 a request's `row_options` values give its row (ValueError naming the fix)."""
    return opts.plan.decoder.row_input(opts.options, request)

  def lane_params(self, params, cfg: ModelConfig, static, options: dict, mesh, rules):
    """The params the lane's programs take: the engine's (placed), and a hybrid's drafter."""
    if not static.uses_drafter:
      return params
    drafter = options["drafter_params"]
    if mesh is not None:
      drafter = sharding.place_params(drafter, mesh, rules,
                                      abstract=lambda: static.abstract_params()[1])
    return params, drafter

  def check_window(self, cfg: ModelConfig, static, prompt_len: int) -> None:
    static.check_window(prompt_len)

  def mask_id(self, cfg: ModelConfig, static):
    return static.prompt_mask_id()

  def row_axes(self, state):
    return self.decoder_class.row_axes(state)

  def init(self, params, cfg, static, traced, tokens, valid, keys, mesh=None, rules=None,
           row_inputs=None):
    decoder = static if mesh is None else static.on_mesh(mesh, rules)
    return decoder.init(params, tokens, valid, keys, traced, row_inputs)

  def pad(self, cfg, static, state, prompt_len: int):
    return static.pad(state, prompt_len)

  def step(self, params, cfg, static, state, mesh=None, rules=None):
    decoder = static if mesh is None else static.on_mesh(mesh, rules)
    new = decoder.step(params, state)
    # `done` stays set: a row the engine retired (done set by the host) must not run on.
    return new.replace(done=new.done | state.done)

  def with_traced(self, state, traced):
    return state.replace(traced=traced) if hasattr(state, "traced") else state

  def progress(self, static, state):
    return static.progress(state)


def for_method(method: str) -> RowDecoder:
  """The lane view of `method` (a registry name)."""
  return RowDecoder(registry.check(method))


def serves_sampling(method: str) -> bool:
  """Whether a lane of `method` may be built `sampling=True` (greedy and sampled rows in one
  program: every method whose decoder declares `sampling_options`)."""
  return bool(for_method(method).sampling_options)


def served_methods() -> list[str]:
  """The methods an engine can serve: every registered one."""
  return sorted(registry.names())


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
