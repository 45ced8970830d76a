"""The OpenAI-compatible ASGI app (FastAPI) over a `Backend`.

  POST /v1/completions        text or token-id prompts (a list of them: one choice each x n)
  POST /v1/chat/completions   messages through the model's chat template (`encode_chat`)
  GET  /v1/models             the lanes (one per served method)
  GET  /health                200 {"status": "ok"} once serving (503 while not); no key needed
  GET  /metrics               Prometheus text (`serve.metrics`)

`stream: true` answers with server-sent events in OpenAI's chunk format, ending in
`data: [DONE]`; the deltas of a choice concatenate to its non-streamed text. Errors use
OpenAI's schema (`serve.errors`): 400 for a bad body (naming the field), 401 for a missing or
wrong key (when the server has one), 404 for an unknown model or route, 408 when a request
outlives `request_timeout` (its rows are cancelled), 413 for a body over `max_body_bytes`,
429 (with Retry-After) when a lane's queue or a client's stream cap is full, 500 when a row
fails. A timeout or a failed row after a stream has started is sent as an SSE event holding
`{"error": ...}`, then `[DONE]` (the openai client raises it).

A client that disconnects has its rows cancelled at once (a watcher awaits the ASGI
disconnect), so their slots take the next requests. A choice whose text reaches a stop string
is finished there and its row cancelled (the text is what `Sampler` returns for the tokens).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dllm_jax.serve import errors, protocol
from dllm_jax.serve.backend import Backend
from dllm_jax.serve.metrics import CONTENT_TYPE_LATEST
from dllm_jax.serve.text import StopText
from dllm_jax.serving import QueueFullError, Result, StreamUpdate

_GONE = object()  # put on a call's queue when its client disconnects
_LATE = object()  # put on a call's queue at its deadline


def _dumps(x) -> str:
  return json.dumps(x, separators=(",", ":"), ensure_ascii=False)


def _error_response(error: errors.APIError) -> JSONResponse:
  return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class _Auth:
  """ASGI middleware: every route but /health needs `Authorization: Bearer <key>`."""

  def __init__(self, app, key: str, metrics):
    self.app, self.key, self.metrics = app, key.encode(), metrics

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http" or scope["path"] == "/health":
      return await self.app(scope, receive, send)
    header = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key):
      return await self.app(scope, receive, send)
    self.metrics.rejected.labels("unauthorized").inc()
    error = errors.unauthorized()
    response = JSONResponse(error.body(), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})
    await response(scope, receive, send)


class _Call:
  """One completion request in flight: its choices, their text, deadline and outcome."""

  def __init__(self, server: "_Server", request: Request, job: protocol.Job, start: float):
    self.server, self.request, self.job, self.start = server, request, job, start
    self.lane = server.backend.lanes[job.lane]
    self.loop = asyncio.get_running_loop()
    self.queue: asyncio.Queue = asyncio.Queue()
    self.deadline = self.loop.time() + server.limits.request_timeout
    self.texts = [StopText(self.lane.tokenizer, job.stop) for _ in range(job.choices)]
    self.finish: list[str | None] = [None] * job.choices
    self.completion_tokens = [0] * job.choices
    self.handles: list = []
    self.first_text: float | None = None
    self.id = ("chatcmpl-" if job.chat else "cmpl-") + server.next_id()
    self.created = int(time.time())
    self._watcher: asyncio.Task | None = None
    self._timer: asyncio.TimerHandle | None = None
    self._closed = False
    self._streams = 0

  # -- lifecycle
  def submit(self, client: str) -> None:
    job, server = self.job, self.server
    if job.stream:
      if server.streams[client] + job.choices > server.limits.max_streams_per_client:
        raise errors.APIError(
            429, f"this client has {server.streams[client]} streamed choices in flight; at "
            f"most {server.limits.max_streams_per_client} (--max-streams-per-client).",
            type="rate_limit_error", code="too_many_streams", reason="too_many_streams",
            headers={"Retry-After": "1"})
    rows = [(prompt, job.seeds[i * job.n + j]) for i, prompt in enumerate(job.prompts)
            for j in range(job.n)]
    try:
      self.handles = server.backend.submit(job.lane, rows, job.options, job.max_tokens,
                                           self.queue)
    except QueueFullError as e:
      raise errors.APIError(429, f"the server is busy: {e} Retry later.",
                            type="rate_limit_error", code="queue_full", reason="queue_full",
                            headers={"Retry-After": str(server.retry_after)}) from None
    if job.stream:
      self._streams, self._client = job.choices, client
      server.streams[client] += job.choices
    self._watcher = asyncio.ensure_future(self._watch())
    self._timer = self.loop.call_at(self.deadline, self.queue.put_nowait, _LATE)

  async def _watch(self) -> None:
    while (await self.request.receive())["type"] != "http.disconnect":
      pass
    self.close("cancelled")
    self.queue.put_nowait(_GONE)

  def close(self, outcome: str | None) -> None:
    """Ends the call: unfinished choices are cancelled and counted with `outcome` (None: a
    request the engine refused, counted as a rejection instead)."""
    if self._closed:
      return
    self._closed = True
    self.server.backend.cancel(self.handles)
    if outcome is not None:
      for finish in self.finish:
        self.server.metrics.child(self.server.metrics.requests, self.job.lane,
                                  "ok" if finish else outcome).inc()
    if self._streams:
      self.server.streams[self._client] -= self._streams
      if not self.server.streams[self._client]:
        del self.server.streams[self._client]
    if self._watcher is not None and asyncio.current_task() is not self._watcher:
      self._watcher.cancel()
    if self._timer is not None:
      self._timer.cancel()
    self.server.metrics.child(self.server.metrics.latency, self.job.lane).observe(
        time.perf_counter() - self.start)

  @property
  def done(self) -> bool:
    return all(f is not None for f in self.finish)

  # -- events
  async def next(self) -> list:
    """Waits for the next engine event, then takes every other one already queued (a slow
    client or loop gets one chunk per choice for several engine steps, not one per step).
    Returns the pieces they add: (index, text delta, finish reason or None). Raises APIError
    on a timeout or a failed row, _Gone if the client left."""
    items = [await self.queue.get()]
    while not self.queue.empty():
      items.append(self.queue.get_nowait())
    pieces = []
    for item in items:
      if item is _LATE:
        self.close("timeout")
        raise errors.timeout(self.server.limits.request_timeout)
      if item is _GONE:
        raise _Gone
      pieces += self._apply(*item)
    return pieces

  def _apply(self, index: int, event) -> list:
    if self.finish[index] is not None:  # finished at a stop string; its row's tail is moot
      return []
    text = self.texts[index]
    if isinstance(event, StreamUpdate):
      delta = text.add(event.new_tokens)
      if text.stopped:
        return self._finished(index, delta + text.finish(), "stop", len(text.tokens))
      return self._visible(index, delta)
    assert isinstance(event, Result)
    if event.status != "ok":
      error = errors.from_request_error(event.error, self.job.prompt_field)
      self.close("error" if error.status >= 500 else None)
      raise error
    delta = text.finish(event.tokens)
    reason = "length" if len(event.tokens) >= self.job.max_tokens and not text.stopped \
        else "stop"
    return self._finished(index, delta, reason, len(event.tokens))

  def _visible(self, index: int, delta: str) -> list:
    if not delta:
      return []
    if self.first_text is None:
      self.first_text = time.perf_counter()
      self.server.metrics.child(self.server.metrics.ttft, self.job.lane).observe(
          self.first_text - self.start)
    return [(index, delta, None)]

  def _finished(self, index: int, delta: str, reason: str, tokens: int) -> list:
    self.finish[index] = reason
    self.completion_tokens[index] = tokens
    self.server.backend.cancel([self.handles[index]])  # a stop string: free the slot now
    return self._visible(index, delta) + [(index, "", reason)]

  # -- answers
  def usage(self) -> dict:
    prompt = sum(len(p) for p in self.job.prompts) * self.job.n
    completion = sum(self.completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}

  def answer(self) -> dict:
    choices = []
    for i, (text, finish) in enumerate(zip(self.texts, self.finish)):
      if self.job.chat:
        choices.append({"index": i, "message": {"role": "assistant", "content": text.text},
                        "logprobs": None, "finish_reason": finish})
      else:
        choices.append({"index": i, "text": text.text, "logprobs": None,
                        "finish_reason": finish})
    return {"id": self.id, "object": "chat.completion" if self.job.chat else "text_completion",
            "created": self.created, "model": self.job.lane, "choices": choices,
            "usage": self.usage()}

  def chunk(self, pieces: list) -> str:
    merged: dict = {}  # index -> [text, finish]: one entry per choice
    for index, delta, finish in pieces:
      entry = merged.setdefault(index, ["", None])
      entry[0] += delta
      entry[1] = finish or entry[1]
    choices = []
    for index, (delta, finish) in merged.items():
      if self.job.chat:
        body = {"content": delta} if delta else {}
        choices.append({"index": index, "delta": body, "logprobs": None,
                        "finish_reason": finish})
      else:
        choices.append({"index": index, "text": delta, "logprobs": None,
                        "finish_reason": finish})
    return self._event(choices)

  def _event(self, choices: list, **extra) -> str:
    kind = "chat.completion.chunk" if self.job.chat else "text_completion"
    return "data: " + _dumps({"id": self.id, "object": kind, "created": self.created,
                              "model": self.job.lane, "choices": choices, **extra}) + "\n\n"

  def opening(self) -> str:
    """A chat stream's first chunk: each choice's assistant role."""
    if not self.job.chat:
      return ""
    return self._event([{"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}
                        for i in range(self.job.choices)])

  def closing(self) -> str:
    usage = self._event([], usage=self.usage()) if self.job.include_usage else ""
    return usage + "data: [DONE]\n\n"


class _Gone(Exception):
  """The client disconnected."""


class _EventStream(StreamingResponse):
  """Server-sent events from an async iterator of (text, more): one write each, the last
  (more=False) ending the body in the same write. Unlike Starlette's StreamingResponse it
  starts no task group listening for a disconnect: the call's own watcher does that (it
  cancels the rows, and the iterator ends)."""

  async def __call__(self, scope, receive, send):
    await send({"type": "http.response.start", "status": self.status_code,
                "headers": self.raw_headers})
    more = True
    async for text, more in self.body_iterator:
      await send({"type": "http.response.body", "body": text.encode(), "more_body": more})
    if more:  # the iterator ended early (the client left)
      await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Server:
  """The app's state: the backend, caps, metrics and per-client stream counts."""

  def __init__(self, backend: Backend, limits: protocol.Limits, served_name: str):
    self.backend, self.limits, self.served_name = backend, limits, served_name
    self.metrics = backend.metrics
    self.streams: collections.Counter = collections.Counter()
    self.retry_after = 1
    self.created = int(time.time())
    # Response ids: a random prefix per server and a counter (unique without a call to the
    # OS's random source per request).
    self._id_prefix, self._ids = uuid.uuid4().hex[:16], itertools.count()

  def next_id(self) -> str:
    return f"{self._id_prefix}{next(self._ids):08x}"

  def refuse(self, error: errors.APIError) -> JSONResponse:
    self.metrics.rejected.labels(error.reason).inc()
    return _error_response(error)

  async def body(self, request: Request):
    limit = self.limits.max_body_bytes
    too_large = errors.APIError(413, f"the request body exceeds {limit} bytes "
                                "(--max-body-bytes).", code="request_too_large",
                                reason="too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
      raise too_large
    data = bytearray()
    async for part in request.stream():
      data += part
      if len(data) > limit:
        raise too_large
    try:
      return json.loads(data)
    except ValueError as e:
      raise errors.bad_request(f"the body is not valid JSON: {e}.", None,
                               "invalid_json") from None

  def client(self, request: Request) -> str:
    key = request.headers.get("authorization")
    return key or (request.client.host if request.client else "?")

  async def complete(self, request: Request, chat: bool):
    start = time.perf_counter()
    try:
      body = await self.body(request)
      job = protocol.parse(body, chat=chat, lanes=self.backend.lanes, limits=self.limits,
                           served_name=self.served_name)
      call = _Call(self, request, job, start)
      call.submit(self.client(request))
    except errors.APIError as error:
      return self.refuse(error)
    try:
      if job.stream:
        first = await call.next()  # a refused request is an error status, not a stream
        return _EventStream(self._stream(call, first), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
      while not call.done:
        await call.next()
      call.close("ok")
      return JSONResponse(call.answer())
    except errors.APIError as error:
      call.close("error")
      if error.status < 500 and error.status != 408:
        return self.refuse(error)
      return _error_response(error)
    except _Gone:
      return Response(status_code=499)
    except BaseException:
      call.close("cancelled")
      raise

  async def _stream(self, call: _Call, pieces: list):
    # Each yield is one write, (text, more): a chat stream's opening goes with its first
    # text, and the last text with the closing and the end of the body (no empty writes).
    try:
      head = call.opening()
      while not call.done:
        if pieces:
          yield head + call.chunk(pieces), True
          head = ""
        pieces = await call.next()
      call.close("ok")
      yield head + (call.chunk(pieces) if pieces else "") + call.closing(), False
    except errors.APIError as error:
      call.close("error")
      yield "data: " + _dumps(error.body()) + "\n\n" + "data: [DONE]\n\n", False
    except _Gone:
      return
    finally:
      call.close("cancelled")


def create_app(backend: Backend, limits: protocol.Limits = protocol.Limits(), *,
               api_key: str | None = None, served_name: str = "dllm_jax",
               start: bool = True) -> FastAPI:
  """The ASGI app.

  Args:
    backend: the engines (warmed up; see `Backend`).
    limits: the caps.
    api_key: if set, every route but /health requires `Authorization: Bearer <api_key>`.
    served_name: the model name a request may also use for a server with one lane.
    start: run the backend's engine thread for the app's lifetime (False: the caller
      starts and stops it).
  """
  server = _Server(backend, limits, served_name)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    if start:
      backend.start(asyncio.get_running_loop())
    try:
      yield
    finally:
      if start:
        backend.stop()

  app = FastAPI(title="dllm_jax", lifespan=lifespan, docs_url=None, redoc_url=None,
                openapi_url=None)
  app.state.server = server

  @app.exception_handler(HTTPException)
  async def http_error(request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error_response(errors.APIError(exc.status_code, f"{request.method} "
                                           f"{request.url.path}: {exc.detail}", code=code,
                                           reason=code or "bad_request"))

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await server.complete(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await server.complete(request, chat=True)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": server.created, "owned_by": "dllm_jax",
         "root": served_name, "method": lane.method, "max_tokens": lane.gen_length,
         "slots": lane.slots} for name, lane in backend.lanes.items()]}

  @app.get("/health")
  async def health():
    if backend.healthy:
      return {"status": "ok"}
    status = "failed" if backend.failed is not None else "starting"
    return JSONResponse({"status": status}, status_code=503)

  @app.get("/metrics")
  async def metrics():
    for name in backend.lanes:
      server.metrics.queue_depth.labels(name).set(backend.queue_depth(name))
    return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

  if api_key:
    app.add_middleware(_Auth, key=api_key, metrics=server.metrics)
  return app
