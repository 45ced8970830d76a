"""The server's answers when a lane is full, a request times out, a client holds too many
streams or disconnects: each with OpenAI's error body, driven by the official async client.

The app runs in a uvicorn thread of this process on 127.0.0.1 (`serve_server.ThreadServer`)
over a real engine whose thread the test starts only when it wants rows decoded, so a full
queue, a timeout and a held stream are deterministic (nothing is decoded behind the test's
back) and nothing compiles.
"""

import asyncio

import httpx
import openai
import pytest

import tiny_llada
from serve_server import ThreadServer

from dllm_jax import loading
from dllm_jax.serve import Backend, Limits, create_app, protocol
from dllm_jax.serving import Engine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  return loading.load_model(tiny_llada.write_llada_instruct(
      tmp_path_factory.mktemp("tiny") / "model"), "ar")


@pytest.fixture
def serve(model):
  servers = []

  def make(**limits):
    engine = Engine(model.params, model.cfg, methods={"ar": dict(gen_length=8)}, slots=2,
                    max_prompt_len=16, prompt_buckets=(16,), tokenizer=model.tokenizer)
    backend = Backend([engine], max_queue=limits.get("max_queue", 256))
    server = ThreadServer(create_app(backend, Limits(max_prompt_tokens=16, **limits),
                                     start=False), backend)
    servers.append(server)
    return server

  yield make
  for server in servers:
    server.close()


def client(server):
  return openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=30)


def test_429_with_retry_after_when_the_queue_is_full(serve):
  server = serve(max_queue=1)  # 2 slots + 1 waiting

  async def main():
    async with client(server) as c:
      held = [asyncio.ensure_future(c.completions.create(model="ar", prompt="a"))
              for _ in range(3)]
      while server.backend.in_flight("ar") < 3:
        await asyncio.sleep(0.01)
      with pytest.raises(openai.RateLimitError) as e:
        await c.completions.create(model="ar", prompt="b")
      for task in held:
        task.cancel()
      return e.value

  error = asyncio.run(main())
  assert error.status_code == 429 and error.response.headers["retry-after"] == "1"
  assert error.body["code"] == "queue_full" and error.body["type"] == "rate_limit_error"


def test_408_after_the_request_timeout_cancels_the_rows(serve):
  server = serve(request_timeout=0.3)

  async def main():
    async with client(server) as c:
      with pytest.raises(openai.APIStatusError) as e:
        await c.completions.create(model="ar", prompt="a", n=2)
      return e.value

  error = asyncio.run(main())
  assert error.status_code == 408 and error.body["code"] == "request_timeout"
  kinds = [command[0] for command in server.backend._commands]
  assert kinds == ["submit", "submit", "cancel", "cancel"]  # both rows cancelled
  server.start_backend()  # the engine answers them as cancelled: nothing stays in flight
  _wait(lambda: server.backend.in_flight("ar") == 0)
  metrics = httpx.get(server.url[:-3] + "/metrics").text
  assert 'dllm_requests_total{method="ar",outcome="timeout"} 2.0' in metrics


def test_429_when_a_client_holds_too_many_streams(serve):
  server = serve(max_streams_per_client=2)

  async def main():
    async with client(server) as c:
      held = asyncio.ensure_future(c.completions.create(model="ar", prompt="a", n=2,
                                                        stream=True))
      while server.backend.in_flight("ar") < 2:
        await asyncio.sleep(0.01)
      with pytest.raises(openai.RateLimitError) as e:
        await c.completions.create(model="ar", prompt="b", stream=True)
      plain = asyncio.ensure_future(c.completions.create(model="ar", prompt="c"))
      while server.backend.in_flight("ar") < 3:  # a non-streamed request still gets in
        await asyncio.sleep(0.01)
      held.cancel()
      plain.cancel()
      return e.value

  error = asyncio.run(main())
  assert error.body["code"] == "too_many_streams"


def test_a_disconnect_cancels_the_row(serve):
  server = serve()

  async def main():
    async with httpx.AsyncClient(timeout=30) as c:
      task = asyncio.ensure_future(c.post(server.url + "/completions", json=dict(
          model="ar", prompt="a", stream=True)))
      while server.backend.in_flight("ar") < 1:
        await asyncio.sleep(0.01)
      task.cancel()  # the client goes away before any token
      while not any(cmd[0] == "cancel" for cmd in list(server.backend._commands)):
        await asyncio.sleep(0.01)

  asyncio.run(main())
  server.start_backend()
  _wait(lambda: server.backend.in_flight("ar") == 0)
  assert server.backend.lanes["ar"].lane.occupied == 0
  metrics = httpx.get(server.url[:-3] + "/metrics").text
  assert 'dllm_requests_total{method="ar",outcome="cancelled"} 1.0' in metrics


def _wait(condition, timeout=20.0):
  import time
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.02)


def test_per_request_fields_are_what_the_lanes_carry_per_row(serve):
  """An ar lane carries temperature, top_k and top_p per row, so a D2F threshold is an unknown
  field; built greedy-only (sampling=False: no sampling program), it refuses a temperature
  > 0 naming the field. Both are 400s before anything reaches the engine."""
  server = serve()
  assert protocol.per_request(server.backend.lanes) == ("temperature", "top_k", "top_p")
  for extra, param, code in ((dict(tau_conf=0.5), "tau_conf", "unknown_field"),
                             (dict(temperature=0.7), "temperature", "unsupported_option")):
    r = httpx.post(f"{server.url}/completions", json={"model": "ar", "prompt": "a", **extra},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
  assert server.backend.in_flight("ar") == 0
