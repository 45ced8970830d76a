"""The OpenAI-compatible server, driven by the official `openai` client (sync and async).

One server subprocess (`python -m dllm_jax.serve` on the tiny LLaDA stand-in, `serve_server`,
with a lane of every registered method) answers every test here: each completion equals its
prompt decoded alone with `generate` (same method, options and seed), streamed chunks
concatenate to the non-streamed text, stop strings cut as `Sampler` cuts, every bad input is
a 400 naming its field, and no request compiles after warm-up. Every lane serves greedy and
sampled rows in one program and gets 16 concurrent requests with their own temperatures and
seeds in one batch; the ar and d2f lanes get every other check (stop strings, chat, n); every
other method gets 4 concurrent requests and a stream (`test_every_lane_method_...`).
The error codes that need a full queue, a timeout or a held stream are in
test_serve_errors.py.
"""

import asyncio
import json

import httpx
import openai
import pytest

import tiny_llada
from serve_server import ALL_LANES, EXTRA_LANES, G, KEY, LANES, SLOTS, References, ServerProcess

PROMPTS = ["Hello world", "The quick brown fox", "import os", "def f(x):"]
# The temperatures of test_every_lane_method_...'s 4 requests: greedy, sampled at 0.7 and
# at the lane's own 1.0, so each row is seen to sample at its own.
LANE_TEMPERATURES = (0.0, 0.7, 1.0, 0.7)
# The 16 requests' temperatures of test_16_concurrent_..., greedy among them (a reference
# `generate` compiles one greedy and one sampled program per method: temperatures are traced).
TEMPERATURES = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0, 0.6)
# The methods whose lanes take top_p (the target's nucleus, traced per row).
TOP_P = ("ar", "speculative", "selfspec", "adaptive")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  return tiny_llada.write_llada_instruct(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def refs(model_dir):
  return References(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, refs):
  s = ServerProcess(model_dir, "--api-key", KEY, "--max-n", "4", "--max-body-bytes", "4096",
                    lanes=ALL_LANES, timeout=600, wait=False)
  try:
    refs.compile_all()  # while the server warms up
    s.wait()
  except BaseException:
    s.close()
    raise
  yield s
  s.close()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def aclient(server):
  return openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("method", list(LANES))
def test_sampled_completions_equal_generate(client, refs, method):
  for i, prompt in enumerate(PROMPTS):
    r = client.completions.create(model=method, prompt=prompt, max_tokens=10, seed=100 + i)
    assert r.choices[0].text == refs.text(method, refs.ids(prompt), 100 + i, 10), prompt
    assert r.usage.completion_tokens == len(refs.tokens(method, refs.ids(prompt), 100 + i, 10))


@pytest.mark.parametrize("method", list(LANES))
def test_greedy_completions_equal_generate(client, refs, method):
  for prompt in PROMPTS[:2]:
    r = client.completions.create(model=method, prompt=prompt, temperature=0, seed=5)
    assert r.choices[0].text == refs.text(method, refs.ids(prompt), 5, temperature=0.0)


@pytest.mark.parametrize("method", list(ALL_LANES))
def test_16_concurrent_requests_with_their_own_temperatures_and_seeds(server, refs, method):
  """16 requests (async client) with their own seeds and temperatures (`TEMPERATURES`),
  greedy among them (and top_p 0.9 in every third, for the methods that take top_p), fill
  the lane's 16 slots: each equals its prompt decoded alone by `generate`."""
  assert len(set(TEMPERATURES)) == SLOTS
  extra = [{"top_p": 0.9} if method in TOP_P and i % 3 == 0 else {} for i in range(SLOTS)]

  async def main():
    async with aclient(server) as c:
      return await asyncio.gather(*[
          c.completions.create(model=method, prompt=PROMPTS[i % 4], temperature=t, seed=7 * i,
                               extra_body=extra[i]) for i, t in enumerate(TEMPERATURES)])

  answers = asyncio.run(main())
  for i, (t, answer) in enumerate(zip(TEMPERATURES, answers)):
    want = refs.text(method, refs.ids(PROMPTS[i % 4]), 7 * i, temperature=t, **extra[i])
    assert answer.choices[0].text == want, (method, t)


@pytest.mark.parametrize("method", list(LANES))
def test_streamed_chunks_concatenate_to_the_text(client, server, method):
  whole = client.completions.create(model=method, prompt=PROMPTS[1], max_tokens=12, seed=3)
  parts = [c.choices[0].text for c in client.completions.create(
      model=method, prompt=PROMPTS[1], max_tokens=12, seed=3, stream=True)]
  assert "".join(parts) == whole.choices[0].text and len(parts) >= 1

  async def chat():
    async with aclient(server) as c:
      messages = [{"role": "user", "content": "Hi there"}]
      full = await c.chat.completions.create(model=method, messages=messages, seed=9)
      stream = await c.chat.completions.create(model=method, messages=messages, seed=9,
                                               stream=True,
                                               stream_options={"include_usage": True})
      chunks = [chunk async for chunk in stream]
      return full, chunks

  full, chunks = asyncio.run(chat())
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == full.choices[0].message.content
  assert chunks[0].choices[0].delta.role == "assistant"
  assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.parametrize("method", list(EXTRA_LANES))
def test_every_lane_method_answers_as_generate(client, server, refs, method):
  """4 concurrent requests (async client) with their own seeds and temperatures, greedy
  among them, each equal to its prompt decoded alone by `generate`; the sync client's answer
  and streamed chunks give the same text."""
  kws = [{"temperature": t} for t in LANE_TEMPERATURES]

  async def main():
    async with aclient(server) as c:
      return await asyncio.gather(*[
          c.completions.create(model=method, prompt=PROMPTS[i], seed=60 + i, max_tokens=12,
                               **kw) for i, kw in enumerate(kws)])

  answers = asyncio.run(main())
  for i, (kw, answer) in enumerate(zip(kws, answers)):
    want = refs.text(method, refs.ids(PROMPTS[i]), 60 + i, 12, **kw)
    assert answer.choices[0].text == want, (method, kw)
  r = client.completions.create(model=method, prompt=PROMPTS[1], seed=61, max_tokens=12,
                                **kws[1])
  assert r.choices[0].text == answers[1].choices[0].text
  parts = [c.choices[0].text for c in client.completions.create(
      model=method, prompt=PROMPTS[0], seed=60, max_tokens=12, stream=True, **kws[0])]
  assert "".join(parts) == answers[0].choices[0].text


def test_chat_uses_the_chat_template(client, refs):
  messages = [{"role": "user", "content": "2+2?"}]
  r = client.chat.completions.create(model="d2f", messages=messages, seed=11)
  assert r.choices[0].message.content == refs.text("d2f", refs.chat_ids(messages), 11)
  assert r.usage.prompt_tokens == len(refs.chat_ids(messages))


def test_stop_strings_cut_as_the_sampler_cuts(client, refs):
  for method in LANES:
    ids = refs.ids(PROMPTS[0])
    full = refs.text(method, ids, 21)
    # Two characters from the middle of the answer (not U+FFFD, a cut UTF-8 character: a
    # stop string holding one is not stable under streaming).
    start = next(i for i in range(2, len(full) - 1)
                 if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip())
    stop = full[start:start + 2]
    want = refs.text(method, ids, 21, stop=[stop])
    r = client.completions.create(model=method, prompt=PROMPTS[0], seed=21, stop=[stop, "zzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    parts = [c.choices[0].text for c in client.completions.create(
        model=method, prompt=PROMPTS[0], seed=21, stop=stop, stream=True)]
    assert "".join(parts) == want


def test_n_choices_take_consecutive_seeds_and_token_prompts(client, refs):
  ids = refs.ids(PROMPTS[2])
  r = client.completions.create(model="ar", prompt=ids, n=3, seed=40)
  assert [c.index for c in r.choices] == [0, 1, 2]
  assert [c.text for c in r.choices] == [refs.text("ar", ids, 40 + j) for j in range(3)]
  r = client.completions.create(model="ar", prompt=[ids, refs.ids(PROMPTS[3])], seed=50)
  assert [c.text for c in r.choices] == [refs.text("ar", ids, 50),
                                         refs.text("ar", refs.ids(PROMPTS[3]), 51)]


def test_models_health_and_metrics(client, server):
  from dllm_jax.decoding import registry
  assert sorted(ALL_LANES) == sorted(registry.names())  # every method has a lane here
  assert sorted(m.id for m in client.models.list()) == sorted(ALL_LANES)
  assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}
  m = server.metrics()
  for name in ("dllm_queue_depth", "dllm_slots_occupied", "dllm_tokens_per_second",
               "dllm_ttft_seconds_count", "dllm_request_latency_seconds_count",
               "dllm_nfe_total", "dllm_generated_tokens_total", "dllm_requests_total",
               "dllm_compiles_after_warmup_total"):
    assert any(k.startswith(name) for k in m), name


def test_no_compiles_after_warmup_across_mixed_options(server):
  options = [dict(temperature=0.5), dict(temperature=1.3, extra_body={"top_p": 0.8}),
             dict(temperature=0, extra_body={"top_k": 5}), dict(extra_body={"tau_conf": 0.7}),
             dict(extra_body={"tau_add": 0.5, "tau_act": 0.5})]

  async def main():
    async with aclient(server) as c:
      jobs = []
      for i, opts in enumerate(options * 2):
        method = "d2f" if "tau" in str(opts) else ("ar", "d2f")[i % 2]
        if method == "d2f" and "top" in str(opts):
          method = "ar"
        jobs.append(c.completions.create(model=method, prompt=PROMPTS[i % 4], seed=i,
                                         max_tokens=1 + i % 12, **opts))
      return await asyncio.gather(*jobs, return_exceptions=True)

  answers = asyncio.run(main())
  assert server.metrics()["dllm_compiles_after_warmup_total"] == 0
  assert all(not isinstance(a, Exception) for a in answers), answers


def test_cli_lanes_serve_greedy_and_sampled_rows(model_dir):
  """`python -m dllm_jax.serve` builds the lane of every method that can serve both in one
  program with sampling=True, whatever its own temperature."""
  from dllm_jax.serve import cli
  args = cli.build_parser().parse_args(["--model", str(model_dir), "--method", "ar",
                                        "--method", "d2f", "--opt", "gen_length=8",
                                        "--max-prompt-tokens", "16"])
  methods, options, _ = cli.check_args(args)
  (engine,) = cli.load_engines(args, methods, options, None)
  assert {m: lane.sampling for m, lane in engine.lanes.items()} == {"ar": True, "d2f": True}


# ------------------------------------------------------------------------- error codes

def _post(server, body, key=KEY, raw=None, path="/v1/completions"):
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  if raw is not None:
    return httpx.post(server.root + path, content=raw,
                      headers={**headers, "Content-Type": "application/json"}, timeout=30)
  return httpx.post(server.root + path, json=body, headers=headers, timeout=30)


def _error(response, status, param=None):
  assert response.status_code == status, response.text
  error = response.json()["error"]
  assert set(error) == {"message", "type", "param", "code"} and error["message"]
  assert error["param"] == param, error
  return error


def test_401_for_a_missing_or_wrong_key(server):
  for key in (None, "wrong"):
    r = _post(server, {"model": "ar", "prompt": "x"}, key=key)
    error = _error(r, 401)
    assert KEY not in r.text and "d2f" not in error["message"]
    wrong = {"Authorization": "Bearer no"}
    assert httpx.get(f"{server.url}/models", headers=wrong).status_code == 401
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
  assert httpx.get(f"{server.root}/health").status_code == 200  # no key needed


def test_404_for_an_unknown_model(client, server):
  with pytest.raises(openai.NotFoundError) as e:
    client.completions.create(model="gpt-4", prompt="x")
  assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
  _error(_post(server, {"model": "ar", "method": "nosuch", "prompt": "x"}), 404, "method")


@pytest.mark.parametrize("case", [
    "malformed", "unknown_field", "prompt_over_window", "nan_option", "mask_id",
    "bad_type", "lane_option", "logprobs", "empty_messages", "bad_stop", "seed"])
def test_400_names_the_field(server, refs, case):
  before = server.metrics().get('dllm_rejected_requests_total{reason="bad_request"}', 0)
  body, param, raw, path = {"model": "ar", "prompt": "hi"}, None, None, "/v1/completions"
  if case == "malformed":
    raw = b'{"model": "ar", "prompt": '
  elif case == "unknown_field":
    body["frobnicate"], param = 1, "frobnicate"
  elif case == "prompt_over_window":
    body["prompt"], param = list(range(10, 43)), "prompt"  # 33 tokens > 32
  elif case == "nan_option":
    raw, param = b'{"model": "d2f", "prompt": "hi", "tau_conf": NaN}', "tau_conf"
  elif case == "mask_id":
    body.update(model="d2f", prompt=[10, refs.model.cfg.mask_token_id, 11])
    param = "prompt"
  elif case == "bad_type":
    body["max_tokens"], param = "ten", "max_tokens"
  elif case == "lane_option":
    body["block_length"], param = 8, "block_length"
  elif case == "logprobs":
    body["logprobs"], param = 2, "logprobs"
  elif case == "empty_messages":
    body, param, path = {"model": "ar", "messages": []}, "messages", "/v1/chat/completions"
  elif case == "bad_stop":
    body["stop"], param = [""], "stop"
  elif case == "seed":
    body["seed"], param = -1, "seed"
  error = _error(_post(server, body, raw=raw, path=path), 400, param)
  assert error["type"] == "invalid_request_error"
  if param:
    assert param in error["message"]
  after = server.metrics()['dllm_rejected_requests_total{reason="bad_request"}']
  assert after == before + 1
  assert server.metrics()['dllm_slots_occupied{method="ar"}'] == 0


def test_413_and_400_over_the_caps(server, client):
  r = _post(server, {"model": "ar", "prompt": "x" * 5000})
  assert _error(r, 413)["code"] == "request_too_large"
  for kw, param in ((dict(max_tokens=G + 1), "max_tokens"), (dict(n=5), "n")):
    with pytest.raises(openai.BadRequestError) as e:
      client.completions.create(model="ar", prompt="x", **kw)
    assert e.value.body["param"] == param and e.value.body["code"] == "cap_exceeded"
  with pytest.raises(openai.BadRequestError) as e:  # 3 prompts x n=2 > --max-n 4
    client.completions.create(model="ar", prompt=["a", "b", "c"], n=2)
  assert e.value.body["param"] == "n"


def test_a_nan_body_never_reaches_a_slot(server):
  r = _post(server, None, raw=json.dumps({"model": "ar", "prompt": "x",
                                          "temperature": float("inf")}).encode())
  _error(r, 400, "temperature")


def test_a_cli_mistake_is_one_line():
  import subprocess
  import sys
  from conftest import REPO
  proc = subprocess.run([sys.executable, "-m", "dllm_jax.serve", "--model", "/no/such/dir",
                         "--method", "ar", "--method", "d2f"], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
  assert proc.stderr.startswith("error: ") and "does not exist" in proc.stderr
