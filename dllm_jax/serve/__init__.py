"""An OpenAI-compatible HTTP server over the continuous-batching engine (`dllm_jax.serving`).

  python -m dllm_jax.serve --model demo --method d2f --port 8000

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
  client.completions.create(model="d2f", prompt="37+48=", max_tokens=8, temperature=0)

Modules: `cli` (the command line: loads the checkpoint, one engine per network, warms up),
`backend` (the engine thread, admission, per-request event queues), `protocol` (request
bodies -> checked jobs; the caps), `text` (stop strings, streamed text), `app` (the FastAPI
routes, SSE, auth, timeouts, disconnects), `metrics` (Prometheus), `errors` (OpenAI's error
schema). See docs/serving.md.
"""

from dllm_jax import _extras

_extras.require("dllm_jax.serve", "serve", {"fastapi": "FastAPI", "uvicorn": "uvicorn",
                                            "prometheus_client": "prometheus_client"})

from dllm_jax.serve.app import create_app  # pylint: disable=wrong-import-position
from dllm_jax.serve.backend import Backend, QueueFullError
from dllm_jax.serve.metrics import ServerMetrics
from dllm_jax.serve.protocol import Limits
