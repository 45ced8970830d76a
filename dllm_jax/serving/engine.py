"""Continuous batching: a fixed set of slots decoding requests that come and go.

Shape legend: B slots, A admitted rows (a static admit size), P the largest prompt bucket,
p an admission's prompt bucket, G gen_length.

    engine = Engine(params, cfg, methods={"ar": dict(gen_length=64),
                                          "d2f": dict(gen_length=64, block_length=16)},
                    slots=8, max_prompt_len=32)
    rid = engine.submit([1, 5, 6], method="d2f", seed=3, max_new_tokens=40)
    for event in engine.serve():          # StreamUpdate / Result events until idle
      ...

Each method (a *lane*, with one static option set: `lanes.py`) owns B slots: one batched decoder
state with static shapes (every cursor per row; `rows.py`). A lane is built from explicit
arguments and knows nothing of the engine; each lane step reports its events and decoder
steps, and the engine records the results and metrics. `step()` runs every lane once:

  1. admit: waiting requests (FIFO) fill free slots. Their prompts go through the method's
     batched init at a static admit size A (rows beyond the requests are dropped) and
     prompt bucket p, are padded to P, and every per-row field (cache rows on axis 1) is
     scattered into the free slots; the other rows keep their state.
  2. run: one jitted `lax.while_loop` of decoder steps that returns to the host when
     occupied rows finish (EOS, max_new_tokens, a non-finite row): the first one when no
     request waits, else `refill` of them (admissions in batches, few host round trips),
     or after `max_steps_per_run` steps (streaming, cancellation).
  3. harvest: each occupied row's final response prefix is streamed (`StreamUpdate`);
     finished rows give a `Result`, and their slots are freed (rows cut short by the
     host, e.g. at a request's own stop id, are retired on the device in the next run).

Slots, admit sizes and prompt buckets are static, so after `warmup()` serving never
compiles again. A row's randomness comes from its request's seed only (per-row keys:
`rows.request_keys`), and every lane of a method that ranks confidences (d2f,
block_diffusion, fast_dllm, speculative, adaptive) decodes with `batch_invariant=True`
(ranking on `sampling.RANK_GRID`; `rows.invariant_options`; a lane or request that sets it
False is refused), so a row's output equals decoding its prompt alone with the same method,
options and seed and batch_invariant=True (`generate(..., method=m,
rng=request_keys([seed]), batch_invariant=True)`), whatever shares the batch and whatever
order requests finish in.

Bad requests are answered at submission with a named `RequestError` and never reach a slot;
so is a request past a lane's `max_queue` (`QueueFullError`: backpressure). `cancel` frees a
running request's slot for the next admission.

Per-request options: a lane's static options are fixed when it is built; its traced ones
(temperature, top_k, top_p, D2F's tau_*, threshold, factor, alg_temp, cfg_scale,
entropy_bound, adaptive's thresholds: what the decoder's `split` makes traced) are per row,
so a request may set its own and share the batch and the program with the others. A lane
built `sampling=True` serves greedy and sampled rows in one batch (`lanes.py`).
On a mesh (`mesh=`), params are placed like `generate` places them and every per-row state
field is sharded over the data axes on its row axis (NamedSharding constraints inside the
jitted functions; slots must divide evenly); rows never interact, so outputs are unchanged.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from dllm_jax.decoding import api, base, registry
from dllm_jax.models import transformer
from dllm_jax.models.config import ModelConfig
from dllm_jax.parallel import mesh as mesh_lib
from dllm_jax.parallel import sharding
from dllm_jax.serving import lanes as lanes_lib
from dllm_jax.serving import metrics as metrics_lib
from dllm_jax.serving import rows
from dllm_jax.serving.requests import (
    BadOptionError, InvalidPromptError, MaskInPromptError, PromptTooLongError, QueueFullError,
    Request, RequestError, Result, UnknownMethodError, check_seed, check_stop_ids)


def _default_buckets(max_prompt_len: int) -> tuple[int, ...]:
  sizes, n = [], 16
  while n < max_prompt_len:
    sizes.append(n)
    n *= 2
  return tuple(sizes) + (max_prompt_len,)


def _check_sizes(name: str, sizes, top: int | None = None) -> tuple[int, ...]:
  sizes = tuple(sizes)
  if not sizes or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s <= 0
                      for s in sizes) or list(sizes) != sorted(set(sizes)):
    raise ValueError(f"{name} must be strictly increasing positive ints, got {sizes!r}.")
  if top is not None and sizes[-1] > top:
    raise ValueError(f"{name} {sizes!r} exceed the {top} slots; the largest must be <= {top}.")
  return tuple(int(s) for s in sizes)


class Engine:
  """A continuous-batching server of prompts over a fixed set of slots per method.

  Args:
    params: model parameters.
    cfg: the model config.
    methods: a method name, or {method: options} for several lanes (each with `slots`
      slots); default `registry.DEFAULT_METHOD`. Served: `rows.served_methods()`, every
      registered method (one generic adapter, `rows.RowDecoder`).
    options: the options of a single `methods` name (e.g. gen_length, block_length, tau_*).
      Speculative's and adaptive's drafter is a lane option: `drafter_params`,
      `drafter_cfg` (with drafter, draft_length, ...) go here, once; requests may not name
      them (the decoder's `lane_options`). Adaptive's `task_modes` and thresholds
      are the lane's too; a request may name its own `task` tag (a row option).
    slots: B, rows decoded together per lane.
    max_prompt_len: longest prompt accepted (the largest prompt bucket).
    prompt_buckets: padded prompt lengths admissions compile for (default 16, 32, ...,
      max_prompt_len); an admission pads to the smallest that holds its prompts.
    admit_sizes: rows a batched init compiles for (default 1, 4, 16, ... below slots, and
      slots); an admission of n requests runs the smallest size >= n.
    max_steps_per_run: decoder steps between host returns when no row finishes (bounds
      the streaming and cancellation delay).
    refill: while requests wait, the loop returns to the host once this many rows have
      finished (default slots // 4), so admissions come in batches and host round trips
      stay few; with no request waiting it returns at the first finished row.
    tokenizer: encodes text prompts and decodes `Result.text` (data.tokenizers).
    mesh, rules: shard the slots over the mesh's data axes (see the module docstring).
    max_queue: most requests a lane keeps waiting beyond its free slots (None: no bound);
      a submission past it is answered at once with a `QueueFullError` (backpressure).
  """

  def __init__(self, params, cfg: ModelConfig, *,
               methods: str | Mapping = registry.DEFAULT_METHOD,
               options: Mapping | None = None, slots: int = 8, max_prompt_len: int = 64,
               prompt_buckets: Sequence[int] | None = None,
               admit_sizes: Sequence[int] | None = None, max_steps_per_run: int = 16,
               refill: int | None = None, tokenizer=None, mesh=None, rules=None,
               max_queue: int | None = None):
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots <= 0:
      raise ValueError(f"slots must be a positive int, got {slots!r}.")
    if isinstance(methods, str):
      methods = {methods: dict(options or {})}
    elif options is not None:
      raise ValueError("pass options inside methods={method: options} when serving several "
                       "methods (options= is for a single method name).")
    if not methods:
      raise ValueError("methods is empty; name at least one method to serve.")
    if not isinstance(max_steps_per_run, (int, np.integer)) or max_steps_per_run <= 0:
      raise ValueError(f"max_steps_per_run must be a positive int, got {max_steps_per_run!r}.")
    self.cfg, self.num_slots, self.tokenizer = cfg, int(slots), tokenizer
    self.max_steps_per_run = int(max_steps_per_run)
    if refill is None:
      refill = max(1, self.num_slots // 4)
    if isinstance(refill, bool) or not isinstance(refill, (int, np.integer)) or \
        not 1 <= refill <= self.num_slots:
      raise ValueError(f"refill must be an int in [1, slots={self.num_slots}], got {refill!r}.")
    self.refill = int(refill)
    if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(
        max_queue, (int, np.integer)) or max_queue < 0):
      raise ValueError(f"max_queue must be an int >= 0 or None (no bound), got {max_queue!r}.")
    self.max_queue = None if max_queue is None else int(max_queue)
    buckets = _default_buckets(max_prompt_len) if prompt_buckets is None else prompt_buckets
    self.prompt_buckets = _check_sizes("prompt_buckets", buckets)
    if admit_sizes is None:  # 1, 4, 16, ... below slots, then slots
      admit_sizes = tuple(4 ** i for i in range(self.num_slots.bit_length())
                          if 4 ** i < self.num_slots) + (self.num_slots,)
    self.admit_sizes = _check_sizes("admit_sizes", admit_sizes, self.num_slots)
    self.filler_id = next(i for i in range(cfg.vocab_size) if i != cfg.mask_token_id)
    self.mesh = mesh
    self.rules = None
    self.params = params
    if mesh is not None:
      self.rules = mesh_lib.rules_from_config(rules)
      dp = mesh_lib.data_parallel_size(mesh, self.rules)
      if self.num_slots % dp:
        raise ValueError(f"slots={self.num_slots} must be a multiple of the mesh's "
                         f"data-parallel size {dp}.")
      self.params = sharding.place_params(
          params, mesh, self.rules, abstract=functools.partial(transformer.abstract_params, cfg))
    self.lanes: dict[str, lanes_lib.Lane] = {}
    for method, opts in methods.items():
      if method not in registry.names() or rows.for_method(method) is None:
        raise ValueError(_method_message(method))
      self.lanes[method] = lanes_lib.Lane(
          method, dict(opts), params=self.params, cfg=cfg, slots=self.num_slots,
          prompt_buckets=self.prompt_buckets, admit_sizes=self.admit_sizes,
          max_steps_per_run=self.max_steps_per_run, refill=self.refill,
          filler_id=self.filler_id, mesh=mesh, rules=self.rules, decode_text=self.decode_text)
    self._steps = 0  # decoder steps run, over all lanes (each steps all B slots)
    self._occupied_steps = 0  # of those slot-steps, the ones on occupied slots
    self._next_id = 0
    self._results: dict[int, Result] = {}
    self._pending: list = []
    self._first_arrival: float | None = None
    self._last_finish: float | None = None

  # ------------------------------------------------------------------ requests
  def submit(self, prompt, *, method: str | None = None, options: Mapping | None = None,
             max_new_tokens: int | None = None, stop_ids: Sequence[int] = (),
             seed: int = 0) -> int:
    """Queues a request; returns its id. A bad request is answered at once: its `Result`
    (status "error", `error` a named RequestError) is ready, and no slot is touched."""
    rid, now = self._next_id, time.perf_counter()
    self._next_id += 1
    if self._first_arrival is None:
      self._first_arrival = now
    try:
      lane, request = self._check(rid, now, prompt, method, options, max_new_tokens, stop_ids,
                                  seed)
      self._check_room(rid, lane)
    except RequestError as error:
      result = Result(rid, status="error", error=error)
      self._pending.append(self._record(result))
      return rid
    lane.queue.append(request)
    return rid

  def _check(self, rid, now, prompt, method, options, max_new_tokens, stop_ids, seed):
    if method is None:
      if len(self.lanes) > 1:
        raise UnknownMethodError(f"request {rid}: name a method; this engine serves "
                                 f"{sorted(self.lanes)}.")
      method = next(iter(self.lanes))
    if method not in self.lanes:
      raise UnknownMethodError(f"request {rid}: " + _method_message(method, self.lanes))
    lane = self.lanes[method]
    options = dict(options or {})
    row = {k: options.pop(k) for k in lane.decoder.row_options if k in options}
    fixed = sorted(set(options) & {*lane.decoder.lane_options, "sampling"})
    if fixed:  # sampling picks the lane's compiled program
      raise BadOptionError(
          f"request {rid}: {fixed} are set once per lane, when the engine is built (its "
          f"{method!r} lane has its own); drop them from the request, or start an engine "
          "with these in the lane's options.")
    try:
      api.check_options(method, options)
      _, static, traced = lane.resolve(options)
      row_input = lane.decoder.row_input(lane.opts, row)
    except (ValueError, TypeError, OverflowError) as e:
      raise BadOptionError(f"request {rid}: {e}") from None
    if static != lane.static:
      raise BadOptionError(f"request {rid}: " + _static_message(lane, options))
    tokens = self._tokens(rid, prompt)
    if len(tokens) > self.prompt_buckets[-1]:
      raise PromptTooLongError(
          f"request {rid}: the prompt has {len(tokens)} tokens but this engine's longest "
          f"prompt bucket is {self.prompt_buckets[-1]} (max_prompt_len); shorten the prompt "
          "or start the engine with a larger max_prompt_len.")
    if lane.mask_id is not None and lane.mask_id in tokens:
      raise MaskInPromptError(
          f"request {rid}: the prompt contains the mask id {lane.mask_id}; remove "
          "[MASK] tokens from prompts (they would be decoded as blanks).")
    g = lane.gen_length
    if max_new_tokens is None:
      max_new_tokens = g
    if isinstance(max_new_tokens, (bool, np.bool_)) or not isinstance(
        max_new_tokens, (int, np.integer)) or not 1 <= max_new_tokens <= g:
      raise BadOptionError(f"request {rid}: max_new_tokens must be an int in [1, {g}] (the "
                           f"{method!r} lane's gen_length), got {max_new_tokens!r}.")
    try:
      seed = check_seed(seed)
      stops = check_stop_ids(stop_ids, self.cfg.vocab_size)
    except BadOptionError as e:
      raise BadOptionError(f"request {rid}: {e}") from None
    return lane, Request(rid, tuple(tokens), method, int(max_new_tokens), stops, seed, now,
                         row_input, traced)

  def _check_room(self, rid, lane) -> None:
    """QueueFullError when `lane` already holds max_queue requests beyond its free slots
    (the next step admits up to one request per free slot)."""
    if self.max_queue is None:
      return
    room = self.max_queue + self.num_slots - lane.occupied
    if len(lane.queue) >= room:
      raise QueueFullError(
          f"request {rid}: the {lane.method!r} lane is full ({lane.occupied} running, "
          f"{len(lane.queue)} waiting, max_queue={self.max_queue}); retry later.")

  def queue_depth(self) -> dict[str, int]:
    """Requests waiting for a slot, per lane (method name)."""
    return {method: len(lane.queue) for method, lane in self.lanes.items()}

  def _tokens(self, rid, prompt) -> list[int]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise InvalidPromptError(f"request {rid}: a text prompt needs a tokenizer; pass "
                                 "Engine(tokenizer=...) or send token ids.")
      prompt = self.tokenizer.encode(prompt)
    try:
      array = np.asarray(prompt)
    except (TypeError, ValueError):
      array = np.zeros((0, 0))
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
      raise InvalidPromptError(f"request {rid}: a prompt is a list of token ids (or text with "
                               f"a tokenizer), got {prompt!r:.80}.")
    if array.size == 0:
      raise InvalidPromptError(f"request {rid}: the prompt is empty; send at least one token.")
    if np.any((array < 0) | (array >= self.cfg.vocab_size)):
      raise InvalidPromptError(f"request {rid}: the prompt holds token ids outside the "
                               f"vocabulary [0, {self.cfg.vocab_size}).")
    return [int(t) for t in array]

  def cancel(self, request_id: int) -> bool:
    """Cancels a queued or running request (its Result: status "cancelled", the tokens
    streamed so far). Returns False if it is unknown or already finished."""
    for lane in self.lanes.values():
      result = lane.cancel(request_id)
      if result is not None:
        self._pending.append(self._record(result))
        return True
    return False

  # ------------------------------------------------------------------ serving loop
  def step(self) -> list:
    """One round: every lane admits, runs and harvests once. Returns the events
    (StreamUpdate, Result) produced since the last call, bad-request results included."""
    events, self._pending = self._pending, []
    for lane in self.lanes.values():
      report = lane.step()
      self._steps += report.steps
      self._occupied_steps += report.occupied_steps
      for result in report.results:
        self._record(result)
      events.extend(report.events)
    return events

  @property
  def busy(self) -> bool:
    return any(lane.busy for lane in self.lanes.values())

  def serve(self) -> Iterator:
    """Yields events until no request is queued or running."""
    while self.busy or self._pending:
      yield from self.step()

  def run_until_idle(self) -> list:
    return list(self.serve())

  def generate(self, prompts: Sequence, *, seeds: Sequence[int] | None = None,
               **request) -> list[Result]:
    """Submits every prompt (with the same request keywords; seeds per prompt), serves until
    idle and returns their results in prompt order."""
    ids = [self.submit(p, seed=0 if seeds is None else seeds[i], **request)
           for i, p in enumerate(prompts)]
    self.run_until_idle()
    return [self.pop_result(i) for i in ids]

  def result(self, request_id: int) -> Result | None:
    return self._results.get(request_id)

  def pop_result(self, request_id: int) -> Result | None:
    return self._results.pop(request_id, None)

  def _record(self, result: Result) -> Result:
    if result.request_id in self._results:
      raise RuntimeError(f"request {result.request_id} answered twice (engine bug).")
    self._results[result.request_id] = result
    self._last_finish = time.perf_counter()
    return result

  @property
  def occupancy(self) -> int:
    """Slots holding a request now, over all lanes."""
    return sum(lane.occupied for lane in self.lanes.values())

  def metrics(self, results: Sequence[Result] | None = None) -> metrics_lib.RunMetrics:
    """Run metrics over `results` (default: every result not yet popped)."""
    results = list(self._results.values()) if results is None else list(results)
    steps, occupied = self._steps, self._occupied_steps
    slot_steps = steps * self.num_slots
    first = self._first_arrival if self._first_arrival is not None else 0.0
    last = self._last_finish if self._last_finish is not None else first
    return metrics_lib.summarize(results, first_arrival=first, last_finish=last,
                                 occupancy=occupied / slot_steps if slot_steps else None,
                                 steps=steps)

  def reset_metrics(self) -> None:
    """Starts a new measurement window (results are kept)."""
    self._first_arrival = self._last_finish = None
    self._steps = self._occupied_steps = 0

  def warmup(self) -> None:
    """Compiles every admission shape (admit size x prompt bucket) and the run loop of
    every lane, so serving afterwards never compiles. Needs an idle engine."""
    if self.busy:
      raise RuntimeError("warmup() needs an idle engine (requests are queued or running).")
    for lane in self.lanes.values():
      lane.warmup()
    self._steps = self._occupied_steps = 0

  def decode_text(self, tokens) -> str | None:
    return None if self.tokenizer is None else self.tokenizer.decode(tokens)

  def context(self):
    """The mesh and logical-axis-rules context device calls run under (none off-mesh)."""
    return lanes_lib.mesh_context(self.mesh, self.rules)


def _static_message(lane, options: dict) -> str:
  """Why a request's options do not fit its lane: the ones that change the compiled program."""
  def changes_program(name) -> bool:
    try:
      return lane.resolve({name: options[name]})[1] != lane.static
    except ValueError:  # valid only with the request's other options: name it too
      return True
  static = sorted(k for k in options if changes_program(k))
  greedy = [k for k in static if k in lane.decoder.sampling_options and not lane.sampling]
  fix = (f"; {greedy} > 0 needs the sampling program: start the engine with sampling=True "
         f"in the {lane.method!r} lane's options" if greedy else "")
  return (f"options {static or sorted(options)} change the program this engine's "
          f"{lane.method!r} lane compiled (static options: {lane.options}); send the lane's "
          f"values or start an engine with these{fix}.")


def _method_message(method: str, lanes=None) -> str:
  served = rows.served_methods() if lanes is None else sorted(lanes)
  if lanes is not None and method in registry.names():
    return (f"this engine serves {served}, not {method!r}; start the engine with "
            f"methods={{{method!r}: options, ...}}.")
  return f"unknown decoding method {method!r}; served: {served}."
