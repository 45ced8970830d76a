"""Serving metrics: per request (in `Result`) and per run (`RunMetrics`).

Definitions (all times from `time.perf_counter`, seconds):
  throughput        response tokens of ok requests / (last result - first arrival)
  ttft              arrival -> first streamed token (the response prefix grew past 0)
  latency           arrival -> result; p50 / p95 by linear interpolation (numpy default)
  nfe per request   forwards the request's row was live in
  slot occupancy    occupied slot-steps / (slots x loop steps), over the engine's forwards
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dllm_jax.serving.requests import Result


def percentile(values: Sequence[float], q: float) -> float:
  return float(np.percentile(np.asarray(values, np.float64), q)) if len(values) else 0.0


@dataclasses.dataclass(frozen=True)
class RunMetrics:
  """Summary of a set of results (one run).

  Attributes:
    requests: results counted; ok / errors / cancelled split them by status.
    tokens: response tokens of the ok requests.
    wall: seconds from the first arrival to the last result.
    throughput: tokens / wall.
    ttft_mean, ttft_p50, ttft_p95: time to first token over ok requests that streamed one.
    latency_p50, latency_p95, latency_mean: over ok requests.
    nfe_mean: forwards per ok request.
    occupancy: mean fraction of slots holding a request, over the engine's loop steps
      (None when not measured, e.g. static batching).
    steps: engine loop steps (batched forwards) run.
  """
  requests: int
  ok: int
  errors: int
  cancelled: int
  tokens: int
  wall: float
  throughput: float
  ttft_mean: float
  ttft_p50: float
  ttft_p95: float
  latency_mean: float
  latency_p50: float
  latency_p95: float
  nfe_mean: float
  occupancy: float | None = None
  steps: int = 0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def summarize(results: Sequence[Result], *, first_arrival: float, last_finish: float,
              occupancy: float | None = None, steps: int = 0) -> RunMetrics:
  """RunMetrics of `results` (arrival / finish bounds in perf_counter seconds)."""
  ok = [r for r in results if r.ok]
  tokens = sum(len(r.tokens) for r in ok)
  wall = max(last_finish - first_arrival, 1e-9)
  ttft = [r.ttft for r in ok if r.ttft is not None]
  lat = [r.latency for r in ok]
  return RunMetrics(
      requests=len(results), ok=len(ok),
      errors=sum(r.status == "error" for r in results),
      cancelled=sum(r.status == "cancelled" for r in results), tokens=tokens, wall=wall,
      throughput=tokens / wall, ttft_mean=float(np.mean(ttft)) if ttft else 0.0,
      ttft_p50=percentile(ttft, 50), ttft_p95=percentile(ttft, 95),
      latency_mean=float(np.mean(lat)) if lat else 0.0, latency_p50=percentile(lat, 50),
      latency_p95=percentile(lat, 95),
      nfe_mean=float(np.mean([r.nfe for r in ok])) if ok else 0.0, occupancy=occupancy,
      steps=steps)
