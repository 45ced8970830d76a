"""One lane of the serving engine: one method with one static option set, its slots, queue
and batched device state, and the two jitted programs that move it (`engine.py` drives lanes).

A lane's options split like a decode's (`RowDecoder.split`): the static part is the lane's,
fixed when it is built (a request whose static options differ is refused); the traced part
(temperature, top_k, top_p, thresholds, ...) is per row, each row holding its request's
values (`Lane.resolve`; `Lane.per_row` names them), so requests with different values share
one batch and one program.
Temperature 0 is a program of its own (`base.ZERO_IS_STATIC`): a lane built with
`sampling=True` (the default when its own temperature is > 0) compiles the sampling program
and serves greedy rows in it (a row at temperature 0 takes the argmax, exactly as the greedy
program does); a lane built with `sampling=False` compiles the cheaper greedy program and
serves greedy requests only.

A lane knows nothing of the engine: it is built from explicit arguments (the model, the
engine's sizes, mesh and rules) and reports what each step did (`Report`: the events, with
the finished requests' `Result`s, and the decoder steps run); the engine records those.

Shape legend: B slots, A admitted rows (a static admit size), P the largest prompt bucket,
p an admission's prompt bucket, G gen_length.

  _admit  inits A rows at prompt bucket p with their requests' keys, pads them to P and
          scatters them into free slots (the other rows keep their state);
  _run    retires rows the host cut short, then steps every row in one `lax.while_loop`
          until enough occupied rows finished or `max_steps` steps ran.

Both take the state donated; every per-row leaf is pinned to the mesh's data axes on its row
axis (`_constrain`) when the lane has a mesh.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dllm_jax.decoding import base
from dllm_jax.serving import rows
from dllm_jax.serving.requests import CancelledError, NonFiniteRowError, Request, Result, \
    StreamUpdate

_STATIC = ("decoder", "cfg", "static", "mesh", "rules")


def _constrain(decoder, state, mesh, rules):
  """Pins every per-row leaf's row axis to the mesh's data axes (others unconstrained)."""
  if mesh is None:
    return state
  batch = nn.logical_to_mesh_axes(("batch",), rules)[0]
  free = PartitionSpec.UNCONSTRAINED

  def pin(axis, x):
    if axis is None:
      return x
    spec = PartitionSpec(*([free] * axis), batch, *([free] * (x.ndim - axis - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  return jax.tree_util.tree_map(pin, decoder.row_axes(state), state,
                                is_leaf=lambda x: x is None)


def mesh_context(mesh, rules):
  """The mesh and logical-axis-rules context device calls run under (none off-mesh)."""
  if mesh is None:
    return contextlib.nullcontext()
  stack = contextlib.ExitStack()
  stack.enter_context(jax.set_mesh(mesh))
  stack.enter_context(nn.logical_axis_rules(rules))
  return stack


def _row_inputs(decoder, row_inputs) -> dict:
  """`init`'s row_inputs keyword, for the decoders that declare row options."""
  return {"row_inputs": row_inputs} if decoder.row_options else {}


@functools.partial(jax.jit, static_argnames=_STATIC + ("prompt_len",),
                   donate_argnames=("state",))
def _admit(params, state, traced, tokens, valid, seeds, row_inputs, slots, *, decoder, cfg,
           static, prompt_len, mesh, rules):
  """Inits A rows (tokens [A, p]) with their requests' keys and traced options ([A] leaves;
  and row inputs, for a decoder with `row_options`) and scatters them into `slots`."""
  new = decoder.init(params, cfg, static, traced, tokens, valid, rows.request_keys(seeds),
                     **_row_inputs(decoder, row_inputs))
  new = decoder.pad(cfg, static, new, prompt_len)
  return _constrain(decoder, rows.scatter_rows(decoder, state, new, slots), mesh, rules)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def _run(params, state, retire, limit, occupied, max_steps, min_finished, *, decoder, cfg,
         static, mesh, rules):
  """Retires rows, then steps until `min_finished` occupied rows have finished (or all of
  them) or after max_steps steps.

  Returns (state, [] steps run, the decoder's progress view)."""
  state = state.replace(done=state.done | retire)

  def finished(s):
    _, prefix, done, finite, _ = decoder.progress(static, s)
    return done | (prefix >= limit) | ~finite

  def more(carry):
    i, s = carry
    done = jnp.sum(finished(s) & occupied)
    return (i < max_steps) & (done < jnp.minimum(min_finished, jnp.sum(occupied)))

  def body(carry):
    i, s = carry
    s = decoder.step(params, cfg, static, s, mesh, rules)
    return i + 1, _constrain(decoder, s, mesh, rules)

  steps, state = jax.lax.while_loop(more, body, (jnp.zeros((), jnp.int32), state))
  return state, steps, decoder.progress(static, state)


@dataclasses.dataclass
class Report:
  """What one `Lane.step` did, for the engine to record."""
  events: list  # StreamUpdate / Result in order; each Result answers its request for good
  steps: int = 0  # decoder steps run (each steps all B slots)
  occupied_steps: int = 0  # slot-steps of occupied slots: steps x occupied rows

  @property
  def results(self) -> list[Result]:
    return [e for e in self.events if isinstance(e, Result)]


@dataclasses.dataclass
class _Live:
  """Host record of an occupied slot."""
  request: Request
  admitted: float
  streamed: int = 0
  first_token: float | None = None
  tokens: tuple[int, ...] = ()


class Lane:
  """One method with one static option set: its slots, queue and device state.

  Args:
    method, options: the method (a registry name served by `rows.for_method`) and the
      lane's options: its static options, the defaults of its traced ones, and `sampling`
      (True / False / None: whether it compiles the sampling program; None: True when the
      lane's own temperature is > 0; module docstring).
    params, cfg: the model's (placed) parameters and config.
    slots: B, rows decoded together.
    prompt_buckets, admit_sizes: the static prompt lengths and admission sizes.
    max_steps_per_run, refill: when a run returns to the host (see `Engine`).
    filler_id: the token of rows no request fills.
    mesh, rules: shard the slots over the mesh's data axes (None: one device).
    decode_text: tokens -> the Result's text (None: no text).
  """

  def __init__(self, method: str, options: dict, *, params, cfg, slots: int,
               prompt_buckets: Sequence[int], admit_sizes: Sequence[int],
               max_steps_per_run: int, refill: int, filler_id: int, mesh=None, rules=None,
               decode_text: Callable[[Sequence[int]], str | None] | None = None):
    self.method, self.cfg, self.num_slots = method, cfg, slots
    self.prompt_buckets, self.admit_sizes = tuple(prompt_buckets), tuple(admit_sizes)
    self.max_steps_per_run, self.refill, self.filler_id = max_steps_per_run, refill, filler_id
    self.mesh, self.rules, self.decode_text = mesh, rules, decode_text
    self.decoder = rows.for_method(method)
    self.options = dict(options)
    self.sampling = self._sampling(self.options.pop("sampling", None))
    self.opts, self.static, self.traced = self.resolve({})
    self.per_row = self.decoder.traced_names(self.traced)  # options each row holds its own of
    self.gen_length = self.decoder.gen_length(self.static)
    self.decoder.check_window(cfg, self.static, self.prompt_buckets[-1])
    self.mask_id = self.decoder.mask_id(cfg, self.static)
    self.params = self.decoder.lane_params(params, cfg, self.static, self.options, mesh, rules)
    self.filler_input = self.decoder.row_input(self.opts, {})  # rows no request fills
    self.stop_ids = frozenset(base.stop_ids(cfg))
    self.queue: collections.deque[Request] = collections.deque()
    self.slots: list[_Live | None] = [None] * slots
    self.retire = np.zeros(slots, bool)
    self.state = self._empty_state()

  def _sampling(self, sampling) -> bool:
    """Whether the lane compiles the sampling program (see the module docstring)."""
    names = self.decoder.sampling_options
    if sampling is None:
      return any(self.options.get(name, 0) != 0 for name in names)
    sampling = base.check_flag("sampling", sampling)
    if sampling and not names:
      raise ValueError(f"sampling=True: the {self.method!r} lane's temperature is static (each "
                       "value compiles its own program), so it serves the temperature in its "
                       "options only; drop sampling and set the lane's temperature.")
    return sampling

  def resolve(self, options: dict):
    """(opts, static, traced) of a request's options over the lane's: the checked options
    (ValueError naming a bad one), their jit-static part as this lane compiles it and their
    traced values ([] leaves). A request fits the lane when its static part is the lane's."""
    merged = {**self.options, **options}
    opts = self.decoder.make_options(self.cfg, merged)
    static, traced = self.decoder.split(opts)
    if self.sampling:  # the sampling program, whatever the request's own values
      sampled = {name: 1.0 for name in self.decoder.sampling_options}
      static = self.decoder.split(self.decoder.make_options(self.cfg, {**merged, **sampled}))[0]
    return opts, static, traced

  # ------------------------------------------------------------------ device calls
  def _kw(self):
    return dict(decoder=self.decoder, cfg=self.cfg, static=self.static, mesh=self.mesh,
                rules=self.rules)

  def context(self):
    return mesh_context(self.mesh, self.rules)

  def _empty_state(self):
    b, p = self.num_slots, self.prompt_buckets[-1]
    shapes = jax.eval_shape(
        lambda: self.decoder.init(self.params, self.cfg, self.static,
                                  rows.stack_traced([self.traced] * b),
                                  jnp.zeros((b, p), jnp.int32), jnp.ones((b, p), bool),
                                  rows.request_keys(np.zeros(b, np.uint32)),
                                  **_row_inputs(self.decoder, jnp.zeros((b,), jnp.int32))))
    state = rows.empty_like(shapes, self.decoder, self.traced)
    # Committed (to the params' device) like every state `_admit` and `_run` return: a jit
    # cache key holds its arguments' committedness, so an uncommitted empty state would
    # compile `_admit` once more, when it first meets a state a run returned.
    if self.mesh is None:
      arrays = [x for x in jax.tree.leaves(self.params) if isinstance(x, jax.Array)]
      return jax.device_put(state, arrays[0].sharding if arrays else jax.devices()[0])
    with self.context():
      return jax.jit(functools.partial(_constrain, self.decoder, mesh=self.mesh,
                                       rules=self.rules))(state)

  def admit_batch(self, requests: Sequence[Request], slots: Sequence[int]) -> None:
    a = next(s for s in self.admit_sizes if s >= len(requests))
    p = next(s for s in self.prompt_buckets if s >= max(len(r.prompt) for r in requests))
    prompts = [list(r.prompt) for r in requests] + [[self.filler_id]] * (a - len(requests))
    tokens, valid = base.pad_prompts(prompts, base.output_pad_id(self.cfg), p)
    seeds = np.zeros(a, np.uint32)
    seeds[:len(requests)] = [r.seed for r in requests]
    inputs = np.full(a, self.filler_input, np.int32)
    inputs[:len(requests)] = [r.row_input for r in requests]
    traced = rows.stack_traced([r.traced for r in requests]
                               + [self.traced] * (a - len(requests)))
    where = np.full(a, self.num_slots, np.int32)  # unused rows: out of range, dropped
    where[:len(requests)] = slots
    with self.context():
      self.state = _admit(self.params, self.state, traced, tokens, valid, seeds, inputs, where,
                          prompt_len=self.prompt_buckets[-1], **self._kw())

  def run(self, max_steps: int):
    """One `_run`: returns (the decoder's progress view, steps run, occupied slot-steps)."""
    occupied = np.array([s is not None for s in self.slots])
    # With requests waiting, return once enough rows finished to admit a batch of them
    # (fewer host round trips); with none waiting, as soon as one row finishes.
    min_finished = min(len(self.queue), self.refill) if self.queue else 1
    limit = np.array([s.request.max_new_tokens if s else self.gen_length for s in self.slots],
                     np.int32)
    with self.context():
      self.state, steps, view = _run(self.params, self.state, self.retire, limit, occupied,
                                     np.int32(max_steps), np.int32(max(min_finished, 1)),
                                     **self._kw())
    self.retire = np.zeros_like(self.retire)
    view = jax.device_get((steps, view))
    steps = int(view[0])
    return view[1], steps, steps * int(occupied.sum())

  def warmup(self) -> None:
    """Compiles every admission shape (admit size x prompt bucket) and the run loop, then
    empties the lane again. Needs an idle lane."""
    for a in self.admit_sizes:
      for p in self.prompt_buckets:
        dummy = [Request(-1, (self.filler_id,) * p, self.method, 1, (), 0, 0.0,
                         traced=self.traced)] * a
        self.admit_batch(dummy, list(range(a)))
    self.retire[:] = True
    self.run(1)
    self.state = self._empty_state()

  # ------------------------------------------------------------------ host loop
  @property
  def occupied(self) -> int:
    return sum(s is not None for s in self.slots)

  @property
  def busy(self) -> bool:
    return bool(self.queue) or self.occupied > 0

  def step(self) -> Report:
    """Admits waiting requests, runs, harvests: what happened, for the engine to record."""
    events: list = []
    free = [i for i, s in enumerate(self.slots) if s is None]
    while free and self.queue:
      take = min(len(free), len(self.queue), self.admit_sizes[-1])
      batch = [self.queue.popleft() for _ in range(take)]
      where, free = free[:take], free[take:]
      self.admit_batch(batch, where)
      now = time.perf_counter()
      for request, slot in zip(batch, where):
        self.slots[slot] = _Live(request, now)
        self.retire[slot] = False  # the slot holds a fresh row now
    if not self.occupied:
      return Report(events)
    (response, prefix, done, finite, nfe), steps, occupied_steps = self.run(
        self.max_steps_per_run)
    now = time.perf_counter()
    for b, live in enumerate(self.slots):
      if live is not None:
        events.extend(self._harvest(b, live, response[b], int(prefix[b]), bool(done[b]),
                                    bool(finite[b]), int(nfe[b]), now))
    return Report(events, steps, occupied_steps)

  def _harvest(self, b, live, response, prefix, done, finite, nfe, now) -> list:
    request = live.request
    if not finite:
      return [self._free(b, done, Result(
          request.id, status="error", nfe=nfe, latency=now - request.arrival,
          queued=live.admitted - request.arrival, error=NonFiniteRowError(
              f"request {request.id}: the model produced non-finite (NaN/inf) logits for its "
              "row; check the weights (dllm_jax.models.finite) and the dtype.")))]
    n = min(prefix, request.max_new_tokens)
    tokens = [int(t) for t in response[:n]]
    stops = self.stop_ids | set(request.stop_ids)
    hit = next((i for i, t in enumerate(tokens) if t in stops), None)
    if hit is not None:
      tokens = tokens[:hit]
    final = hit is not None or done or n >= request.max_new_tokens
    new = tuple(tokens[live.streamed:])
    events = []
    if new and live.first_token is None:
      live.first_token = now
    if new or final:
      events.append(StreamUpdate(request.id, new, final))
    live.streamed, live.tokens = len(tokens), tuple(tokens)
    if final:
      ttft = None if live.first_token is None else live.first_token - request.arrival
      events.append(self._free(b, done, Result(
          request.id, tokens=tuple(tokens), text=self._text(tokens), nfe=nfe,
          ttft=ttft, latency=now - request.arrival, queued=live.admitted - request.arrival)))
    return events

  def _text(self, tokens) -> str | None:
    return None if self.decode_text is None else self.decode_text(tokens)

  def _free(self, b: int, done: bool, result: Result) -> Result:
    self.slots[b] = None
    self.retire[b] = not done
    return result

  def cancel(self, request_id: int) -> Result | None:
    """The cancelled request's Result (for the caller to record), or None if this lane
    does not hold it."""
    for request in self.queue:
      if request.id == request_id:
        self.queue.remove(request)
        return cancelled(request, None, time.perf_counter())
    for b, live in enumerate(self.slots):
      if live is not None and live.request.id == request_id:
        return self._free(b, False, cancelled(live.request, live, time.perf_counter()))
    return None


def cancelled(request: Request, live: _Live | None, now: float) -> Result:
  return Result(request.id, tokens=live.tokens if live else (), status="cancelled",
                error=CancelledError(f"request {request.id} was cancelled."),
                latency=now - request.arrival,
                queued=None if live is None else live.admitted - request.arrival)
