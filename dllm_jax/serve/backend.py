"""The engines behind the HTTP layer: one dedicated thread runs every device call.

    backend = Backend([engine], max_queue=64)
    backend.warmup()                         # compiles every shape (before serving)
    backend.start(loop)                      # the engine thread
    handles = backend.submit("d2f", [(ids, seed)], options, max_tokens, queue)   # on the loop
    ...                                      # queue receives (index, StreamUpdate | Result)
    backend.cancel(handles)

The asyncio event loop never touches an engine: `submit` and `cancel` (called on the loop)
append commands to a queue that the engine thread drains before each `Engine.step()`; the
events of a step go back to the loop in one `loop.call_soon_threadsafe` call, which puts each
on its request's asyncio queue. Admission is decided on the loop, at once: a lane accepts a
choice while fewer than `slots + max_queue` of its choices are in flight (else the engine's
`QueueFullError`: a 429). The bound is the backend's, not the engines' `max_queue` (left
unset): a request's choices are admitted or refused together, before any reaches the engine
thread. Every finished row's `Result` is popped from its engine, so nothing accumulates over
a long run.

Several engines may serve at once (one per model: e.g. the demo's AR and D2F models); lane
names (methods) are unique across them. If a device call fails, every request in flight is
answered with the error and the backend reports itself failed (`/health` 503).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from dllm_jax.serve.metrics import ServerMetrics
from dllm_jax.serving import Engine, QueueFullError, RequestError, Result

# The event jax.monitoring reports for each XLA backend compile.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class EngineFailedError(RequestError):
  """A device call of the engine failed; the request could not be decoded."""


@dataclasses.dataclass(frozen=True)
class LaneInfo:
  """What the HTTP layer reads of one lane (a method served by one engine)."""
  name: str
  engine: Engine
  lane: Any  # the engine's `serving.lanes.Lane`

  @property
  def method(self) -> str:
    return self.lane.method

  @property
  def cfg(self):
    return self.engine.cfg

  @property
  def tokenizer(self):
    return self.engine.tokenizer

  @property
  def decoder(self):
    return self.lane.decoder

  @property
  def options(self) -> dict:
    return self.lane.options

  @property
  def opts(self):
    return self.lane.opts

  @property
  def gen_length(self) -> int:
    return self.lane.gen_length

  @property
  def mask_id(self):
    return self.lane.mask_id

  @property
  def slots(self) -> int:
    return self.engine.num_slots

  @property
  def per_row(self) -> tuple[str, ...]:
    """The options each row of the lane holds its own value of (the engine's traced ones)."""
    return self.lane.per_row


@dataclasses.dataclass(eq=False)
class Handle:
  """One choice in flight: its lane, where its events go, and its engine request id."""
  id: int
  lane: str
  index: int
  queue: asyncio.Queue
  finished: bool = False  # its Result reached the loop
  rid: int | None = None  # set by the engine thread


class Backend:
  """Engines, their thread, and admission (see the module docstring).

  Args:
    engines: the engines to serve (each with a tokenizer); every lane name must be unique.
    max_queue: choices per lane that may wait for a free slot.
    metrics: where to report (default: a fresh `ServerMetrics`).
  """

  def __init__(self, engines: Sequence[Engine], *, max_queue: int = 256,
               metrics: ServerMetrics | None = None):
    self.engines = list(engines)
    self.metrics = metrics or ServerMetrics()
    self.max_queue = int(max_queue)
    self.lanes: dict[str, LaneInfo] = {}
    for engine in self.engines:
      if engine.tokenizer is None:
        raise ValueError("every engine needs a tokenizer (Engine(tokenizer=...)) to serve text.")
      for name, lane in engine.lanes.items():
        if name in self.lanes:
          raise ValueError(f"method {name!r} is served by two engines; serve it once.")
        self.lanes[name] = LaneInfo(name, engine, lane)
        self.metrics.slots.labels(name).set(engine.num_slots)
    self._in_flight = {name: 0 for name in self.lanes}   # loop side
    self._occupied = {name: 0 for name in self.lanes}    # thread side (snapshots)
    self._occupied_gauges = {name: self.metrics.occupied.labels(name) for name in self.lanes}
    for gauge in self._occupied_gauges.values():
      gauge.set(0)
    self._ids = itertools.count()
    self._commands: collections.deque = collections.deque()
    self._wake = threading.Condition()
    self._by_rid: dict[tuple[int, int], Handle] = {}     # (engine index, rid) -> handle
    self._thread: threading.Thread | None = None
    self._loop: asyncio.AbstractEventLoop | None = None
    self._stopping = False
    self.failed: BaseException | None = None
    self.warm = False

  # ------------------------------------------------------------------ lifecycle
  def warmup(self) -> None:
    """Compiles every shape of every engine (before `start`); serving never compiles after."""
    for engine in self.engines:
      engine.warmup()
    self.warm = True

  def start(self, loop: asyncio.AbstractEventLoop) -> None:
    """Starts the engine thread; its events are delivered on `loop`."""
    if self._thread is not None:
      raise RuntimeError("the backend is already started.")
    import jax
    jax.monitoring.register_event_duration_secs_listener(self._on_compile)
    self._loop = loop
    self._thread = threading.Thread(target=self._run, name="dllm-engine", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    """Stops the engine thread (requests in flight are left unanswered)."""
    with self._wake:
      self._stopping = True
      self._wake.notify()
    if self._thread is not None:
      self._thread.join()
      import jax
      jax.monitoring.unregister_event_duration_listener(self._on_compile)

  @property
  def healthy(self) -> bool:
    return (self._thread is not None and self._thread.is_alive() and self.failed is None
            and not self._stopping)

  def _on_compile(self, event: str, duration: float, **kw) -> None:
    if event == BACKEND_COMPILE_EVENT:
      self.metrics.compiles.inc()

  # ------------------------------------------------------------------ event loop side
  def capacity(self, lane: str) -> int:
    return self.lanes[lane].slots + self.max_queue

  def in_flight(self, lane: str) -> int:
    return self._in_flight[lane]

  def queue_depth(self, lane: str) -> int:
    return max(0, self._in_flight[lane] - self._occupied[lane])

  def submit(self, lane: str, rows: Sequence[tuple[Sequence[int], int]], options: Mapping,
             max_tokens: int, queue: asyncio.Queue) -> list[Handle]:
    """Queues one choice per (prompt ids, seed); their events go to `queue` as (index,
    event). QueueFullError (nothing queued) if the lane cannot take them all."""
    if self._in_flight[lane] + len(rows) > self.capacity(lane):
      raise QueueFullError(f"lane {lane!r} has {self._in_flight[lane]} choices in flight and "
                           f"takes at most {self.capacity(lane)} (slots + --max-queue).")
    handles = [Handle(next(self._ids), lane, i, queue) for i in range(len(rows))]
    self._in_flight[lane] += len(rows)
    with self._wake:
      for handle, (ids, seed) in zip(handles, rows):
        self._commands.append(("submit", handle, dict(
            prompt=list(ids), method=lane, options=dict(options), max_new_tokens=max_tokens,
            seed=int(seed))))
      self._wake.notify()
    return handles

  def cancel(self, handles: Sequence[Handle]) -> None:
    """Cancels the choices not yet answered (their slots are freed; each still gets its
    Result, status "cancelled")."""
    live = [h for h in handles if not h.finished]
    if not live:
      return
    with self._wake:
      self._commands.extend(("cancel", h, None) for h in live)
      self._wake.notify()

  def _deliver(self, events: list) -> None:
    # The queue-depth gauge is set when /metrics is read, not here: this runs once per
    # engine step, on the loop that also serves every request.
    for handle, event in events:
      if isinstance(event, Result) and not handle.finished:
        handle.finished = True
        self._in_flight[handle.lane] -= 1
      handle.queue.put_nowait((handle.index, event))

  # ------------------------------------------------------------------ engine thread
  def _run(self) -> None:
    try:
      while True:
        with self._wake:
          while not self._commands and not self._stopping and not self._busy():
            self._wake.wait()
          if self._stopping:
            return
          commands, self._commands = self._commands, collections.deque()
        events = [pair for command in commands for pair in self._apply(*command)]
        for e, engine in enumerate(self.engines):
          for event in engine.step():
            handle = self._by_rid.get((e, event.request_id))
            if handle is None:
              continue
            if isinstance(event, Result):
              del self._by_rid[(e, event.request_id)]
              engine.pop_result(event.request_id)
              self._record(handle.lane, event)
            events.append((handle, event))
        self._snapshot()
        if events:
          self._loop.call_soon_threadsafe(self._deliver, events)
    except BaseException as error:  # noqa: BLE001  (every waiting request is told)
      self.failed = error
      self._fail_all(error)

  def _busy(self) -> bool:
    return any(engine.busy for engine in self.engines)

  def _engine_index(self, lane: str) -> int:
    return self.engines.index(self.lanes[lane].engine)

  def _apply(self, kind: str, handle: Handle, kwargs) -> list:
    e = self._engine_index(handle.lane)
    if kind == "submit":
      handle.rid = self.engines[e].submit(**kwargs)
      self._by_rid[(e, handle.rid)] = handle
    elif handle.rid is not None and (e, handle.rid) in self._by_rid:
      self.engines[e].cancel(handle.rid)
    return []

  def _record(self, lane: str, result: Result) -> None:
    if result.status != "error":
      self.metrics.produced(lane, len(result.tokens), result.nfe)

  def _snapshot(self) -> None:
    for name, info in self.lanes.items():
      occupied = info.lane.occupied
      if occupied != self._occupied[name]:  # a gauge update takes a lock: only on change
        self._occupied[name] = occupied
        self._occupied_gauges[name].set(occupied)

  def _fail_all(self, error: BaseException) -> None:
    failure = EngineFailedError(f"the engine failed: {type(error).__name__}: {error}")
    handles = list(self._by_rid.values())
    handles += [c[1] for c in self._commands if c[0] == "submit"]
    self._by_rid.clear()
    events = [(h, Result(-1, status="error", error=failure)) for h in handles]
    if self._loop is not None and not self._loop.is_closed():
      self._loop.call_soon_threadsafe(self._deliver, events)

