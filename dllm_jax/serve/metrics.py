"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own.

  dllm_requests_total{method, outcome}     choices answered: ok, cancelled (client gone),
                                           timeout, error
  dllm_rejected_requests_total{reason}     requests refused before reaching a slot:
                                           bad_request, not_found, too_large, queue_full,
                                           too_many_streams, unauthorized
  dllm_queue_depth{method}                 choices waiting for a slot
  dllm_slots_occupied{method}, dllm_slots{method}
  dllm_generated_tokens_total{method}      response tokens the engine produced
  dllm_tokens_per_second                   over the last `window` seconds
  dllm_nfe_total{method}                   forwards the answered rows were live in
  dllm_ttft_seconds{method}                request arrival -> first text sent (histogram)
  dllm_request_latency_seconds{method}     request arrival -> answer complete (histogram)
  dllm_compiles_after_warmup_total         XLA backend compiles since warm-up (0 expected)
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
  """Every metric of one server; safe to update from the engine thread and the event loop."""

  def __init__(self, window: float = 10.0):
    self.registry = r = CollectorRegistry()
    self.requests = Counter("dllm_requests", "Choices answered, by method and outcome.",
                            ["method", "outcome"], registry=r)
    self.rejected = Counter("dllm_rejected_requests", "Requests refused before reaching a "
                            "slot, by reason.", ["reason"], registry=r)
    self.queue_depth = Gauge("dllm_queue_depth", "Choices waiting for a slot.", ["method"],
                             registry=r)
    self.occupied = Gauge("dllm_slots_occupied", "Slots holding a row.", ["method"],
                          registry=r)
    self.slots = Gauge("dllm_slots", "Slots per lane.", ["method"], registry=r)
    self.tokens = Counter("dllm_generated_tokens", "Response tokens produced.", ["method"],
                          registry=r)
    self.tokens_per_second = Gauge("dllm_tokens_per_second", "Response tokens per second "
                                   f"over the last {window:g} s.", registry=r)
    self.nfe = Counter("dllm_nfe", "Forwards the answered rows were live in.", ["method"],
                       registry=r)
    self.ttft = Histogram("dllm_ttft_seconds", "Request arrival to first text sent.",
                          ["method"], buckets=_BUCKETS, registry=r)
    self.latency = Histogram("dllm_request_latency_seconds", "Request arrival to answer "
                             "complete.", ["method"], buckets=_BUCKETS, registry=r)
    self.compiles = Counter("dllm_compiles_after_warmup", "XLA backend compiles since "
                            "warm-up.", registry=r)
    self._children: dict = {}
    self._window = window
    self._recent: collections.deque = collections.deque()  # (time, tokens)
    self._lock = threading.Lock()

  def produced(self, method: str, tokens: int, nfe: int) -> None:
    """A row's result: its response tokens and forwards (engine thread)."""
    self.child(self.tokens, method).inc(tokens)
    self.child(self.nfe, method).inc(nfe)
    with self._lock:
      self._recent.append((time.monotonic(), tokens))

  def child(self, metric, *labels):
    """`metric.labels(*labels)`, looked up once (`labels` takes a lock and builds a key on
    every call; this runs per request and per row)."""
    key = (id(metric), labels)
    found = self._children.get(key)
    if found is None:
      found = self._children[key] = metric.labels(*labels)
    return found

  def update_rate(self) -> None:
    now = time.monotonic()
    with self._lock:
      while self._recent and self._recent[0][0] < now - self._window:
        self._recent.popleft()
      total = sum(t for _, t in self._recent)
    self.tokens_per_second.set(total / self._window)

  def text(self) -> bytes:
    self.update_rate()
    return generate_latest(self.registry)
