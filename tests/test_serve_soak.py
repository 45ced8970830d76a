"""Soak: 500 requests at concurrency 32 through the HTTP server (official async client).

10% are streamed and dropped by the client after their first chunk, 5% are malformed. Every
well-formed request is answered (or, if dropped, cancelled), none is lost or hangs (each has a
deadline), the freed slots take the next requests (500 requests through 2 x 16 slots and
nothing left occupied), the server's /metrics counters add up to what the clients saw, no
request compiled, and the server's RSS after the soak is within 10% of its RSS after warm-up.
"""

import asyncio
import random

import openai
import pytest

import tiny_llada
from serve_server import KEY, LANES, ServerProcess

pytestmark = pytest.mark.slow

N, CONCURRENCY = 500, 32
PROMPTS = ["Hello world", "The quick brown fox", "import os", "def f(x):", "a", "1 2 3 4"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  s = ServerProcess(tiny_llada.write_llada_instruct(tmp_path_factory.mktemp("m") / "model"),
                    "--api-key", KEY, "--max-queue", "512", "--max-streams-per-client", "64",
                    "--request-timeout", "120")
  yield s
  s.close()


async def _one(c, i, kind, rng):
  method = list(LANES)[i % len(LANES)]
  kw = dict(model=method, prompt=PROMPTS[i % len(PROMPTS)], seed=i,
            max_tokens=rng.randint(1, 16))
  if kind == "malformed":
    bad = rng.choice([dict(extra_body={"frobnicate": 1}), dict(max_tokens=0),
                      dict(extra_body={"block_length": 2}), dict(stop=[""])])
    try:
      await c.completions.create(**{**kw, **bad})
    except openai.BadRequestError:
      return "rejected"
    return "accepted?!"
  if kind == "drop":
    stream = await c.completions.create(**{**kw, "max_tokens": 16}, stream=True)
    async for _ in stream:
      break
    await stream.close()
    return "dropped"
  if rng.random() < 0.3:
    parts = [chunk async for chunk in await c.completions.create(**kw, stream=True)]
    assert parts and parts[-1].choices[0].finish_reason in ("stop", "length")
    return "ok"
  r = await c.completions.create(**kw)
  assert r.choices[0].finish_reason in ("stop", "length")
  return "ok"


def _run(server, n, seed):
  rng = random.Random(seed)
  kinds = ["malformed" if rng.random() < 0.05 else "drop" if rng.random() < 0.1 / 0.95
           else "ok" for _ in range(n)]

  async def main():
    gate = asyncio.Semaphore(CONCURRENCY)
    async with openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0,
                                  timeout=60) as c:
      async def bounded(i):
        async with gate:
          return await asyncio.wait_for(_one(c, i, kinds[i], rng), 90)
      return await asyncio.gather(*[bounded(i) for i in range(n)], return_exceptions=True)

  return kinds, asyncio.run(main())


def _counters(m):
  counts = {o: sum(v for k, v in m.items() if k.startswith("dllm_requests_total{")
                   and f'outcome="{o}"' in k) for o in ("ok", "cancelled", "timeout", "error")}
  counts["bad_request"] = m.get('dllm_rejected_requests_total{reason="bad_request"}', 0)
  counts["compiles"] = m["dllm_compiles_after_warmup_total"]
  return counts


def _settled(server):
  m = server.metrics()
  return all(m[f'dllm_slots_occupied{{method="{l}"}}'] == 0 and
             m[f'dllm_queue_depth{{method="{l}"}}'] == 0 for l in LANES)


def test_soak_500_requests(server):
  _run(server, 64, seed=1)  # warm the host side (sockets, allocator) before measuring RSS
  _wait(lambda: _settled(server))
  before, rss_warm = _counters(server.metrics()), server.rss_kb()

  kinds, outcomes = _run(server, N, seed=2)
  errors = [o for o in outcomes if isinstance(o, BaseException)]
  assert not errors, errors[:3]  # none lost, none hung (every request had a deadline)
  assert [o for k, o in zip(kinds, outcomes) if k == "malformed"] == \
      ["rejected"] * kinds.count("malformed")
  _wait(lambda: _settled(server))  # every slot freed (and reused: 500 requests, 32 slots)

  m = server.metrics()
  after = _counters(m)
  seen = {k: after[k] - before[k] for k in after}
  well_formed = N - kinds.count("malformed")
  assert seen["bad_request"] == kinds.count("malformed")
  assert seen["ok"] + seen["cancelled"] == well_formed
  assert seen["ok"] >= kinds.count("ok") and seen["timeout"] == seen["error"] == 0
  assert seen["compiles"] == 0  # steady state (test_serve_http checks from warm-up on)
  assert server.rss_kb() <= 1.10 * rss_warm, (server.rss_kb(), rss_warm)


def _wait(condition, timeout=60.0):
  import time
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, "the server did not settle"
    time.sleep(0.1)
