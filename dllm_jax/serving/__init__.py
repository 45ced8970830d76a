"""Continuous-batching serving of the decoders: a fixed set of slots, requests that come and go.

  engine = Engine(params, cfg, methods="d2f", options=dict(gen_length=64), slots=8)
  rid = engine.submit([1, 5, 6], seed=3)
  results = engine.run_until_idle()     # StreamUpdate and Result events

`engine.py` is the loop, `lanes.py` one method's slots, queue and device programs, `rows.py`
the lane's view of any registered decoder (`decoding.protocol`), `requests.py` requests,
results and named errors, `metrics.py` throughput, TTFT, latency, NFE and occupancy.
"""

from dllm_jax.serving.engine import Engine
from dllm_jax.serving.metrics import RunMetrics, summarize
from dllm_jax.serving.requests import (
    BadOptionError, CancelledError, InvalidPromptError, MaskInPromptError, NonFiniteRowError,
    PromptTooLongError, QueueFullError, Request, RequestError, Result, StreamUpdate,
    UnknownMethodError)
from dllm_jax.serving.rows import RowDecoder, request_keys, served_methods, serves_sampling
