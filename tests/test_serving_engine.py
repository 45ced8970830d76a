"""The continuous-batching engine: every request's output equals its prompt decoded alone.

References: each prompt's one-prompt decode with the same method, options and seed
(`generate([prompt], method=m, rng=request_keys([seed]))`; with batch_invariant=True for a
method that ranks, as the engine decodes it: `served`), cut before the request's stop ids
and at max_new_tokens. Lanes are named by method, or `fast_dllm_<cache>` for Fast-dLLM's cache
modes (each mode with one rule: dual threshold, prefix factor, none threshold).

Compile budget (most of these tests' time is XLA compilation): `generate` pads every prompt
to its 16-token bucket, so all one-prompt references of a lane share one program (executing
it takes milliseconds); the engine's jitted functions are keyed by shapes and static options
only (temperature, thresholds are traced), so every engine below is one of two shapes that
the tests share: 8 slots with buckets (8, 16) and the default admit sizes, or `SMALL` (3
slots, one step per run, bucket 16, admit size 3). `test_no_recompiles_after_warmup` keeps a
shape of its own (4 slots), so programs compiled by other tests cannot hide a gap in warmup.
"""

import jax
import numpy as np
import pytest

from conftest import backend_compiles

from dllm_jax.decoding import generate, registry
from dllm_jax.models import get_preset
from dllm_jax.serving import (BadOptionError, CancelledError, Engine, InvalidPromptError,
                              MaskInPromptError, PromptTooLongError, Result, StreamUpdate,
                              UnknownMethodError, request_keys, rows)
from test_decoding_d2f import peaked_params

CFG = get_preset("tiny")
G = 12
METHODS = {  # lane -> the method's options
    "ar": dict(gen_length=G),
    "d2f": dict(gen_length=G, block_length=4, tau_conf=0.5),
    "block_diffusion": dict(gen_length=G, block_length=4),
    "fast_dllm_dual": dict(gen_length=G, block_length=4, cache="dual", threshold=0.5),
    "fast_dllm_prefix": dict(gen_length=G, block_length=4, cache="prefix", rule="factor"),
    "fast_dllm_none": dict(gen_length=G, block_length=6, cache="none", threshold=0.7),
    "llada": dict(gen_length=G, block_length=4, steps=6),           # 2 tokens a step
    "dream": dict(gen_length=G, block_length=6, cfg_scale=0.5),     # CFG: 2B-row forwards
}
SAMPLED = {"ar": dict(temperature=1.0, top_p=0.9), "d2f": dict(temperature=1.0),
           "block_diffusion": dict(temperature=0.8, remasking="random"),
           "fast_dllm_dual": dict(temperature=1.0), "fast_dllm_prefix": dict(temperature=0.8),
           "fast_dllm_none": dict(temperature=1.0),
           "llada": dict(temperature=1.0, remasking="random"),
           "dream": dict(temperature=1.0, alg_temp=0.5)}


# Every program compiled here goes to the run's persistent cache (a one-prompt reference is
# the program of test_serving_row_options.py's and test_serving_speculative.py's references).
pytestmark = pytest.mark.usefixtures("compile_cache")


def method_of(lane: str) -> str:
  """The engine's method name of a lane name."""
  return "fast_dllm" if lane.startswith("fast_dllm") else lane


@pytest.fixture(scope="module")
def params():
  return peaked_params()


def workload(n: int, seed: int = 0):
  """n mixed requests: prompt lengths 1..14, some with a max_new_tokens below G or an
  extra stop id, each with its own seed."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    prompt = [int(t) for t in rng.integers(4, CFG.vocab_size, rng.integers(1, 15))]
    kw = dict(seed=int(rng.integers(0, 2 ** 32)))
    if rng.random() < 0.3:
      kw["max_new_tokens"] = int(rng.integers(1, G + 1))
    if rng.random() < 0.2:
      kw["stop_ids"] = (int(rng.integers(4, CFG.vocab_size)),)
    out.append((prompt, kw))
  return out


def served(method: str, options: dict) -> dict:
  """The options the engine decodes a `method` lane with: batch_invariant=True for the
  methods that rank (`rows.invariant_options`), so a row alone equals the row served."""
  ranks = method in registry.ranking_methods()
  return {**options, "batch_invariant": True} if ranks else dict(options)


def _alone(params, lane, options, requests):
  """Each request's one-prompt output (tuple of ids), cut like the engine cuts it."""
  opts = served(method_of(lane), {**METHODS[lane], **options})
  refs = []
  for prompt, kw in requests:
    one = generate(params, CFG, [prompt], method=method_of(lane),
                   rng=request_keys([kw["seed"]]), **opts)
    row = np.asarray(one.tokens[0])[:int(one.lengths[0])].tolist()
    row = row[:kw.get("max_new_tokens", G)]
    for j, t in enumerate(row):
      if t in kw.get("stop_ids", ()):
        row = row[:j]
        break
    refs.append(tuple(row))
  return refs


def _serve(engine, method, options, requests, order=None):
  order = range(len(requests)) if order is None else order
  ids = {}
  for i in order:
    prompt, kw = requests[i]
    ids[i] = engine.submit(prompt, method=method, options=options, **kw)
  events = engine.run_until_idle()
  results = [e for e in events if isinstance(e, Result)]
  assert sorted(r.request_id for r in results) == sorted(ids.values())  # none lost / twice
  assert engine.occupancy == 0
  by_id = {r.request_id: r for r in results}
  return [by_id[ids[i]] for i in range(len(requests))], events


def assert_streams_add_up(events, results):
  """Each request's StreamUpdate tokens concatenate to its Result's tokens."""
  streamed = {}
  for e in events:
    if isinstance(e, StreamUpdate):
      streamed[e.request_id] = streamed.get(e.request_id, ()) + e.new_tokens
  assert all(streamed[r.request_id] == r.tokens for r in results)


# The second engine of `_check_outputs` (and the cancel test's): other slot count, one
# step per run, one bucket and one admit size (the 8-slot engine covers bucket 8 and the
# default admit sizes 1, 4, 8), so it compiles two programs per lane instead of five.
SMALL = dict(slots=3, max_steps_per_run=1, prompt_buckets=(16,), admit_sizes=(3,))


def _engine(params, lane, options, **kw):
  kw = dict(dict(slots=8, prompt_buckets=(8, 16)), **kw)
  return Engine(params, CFG, methods=method_of(lane), options={**METHODS[lane], **options},
                max_prompt_len=16, **kw)


def _check_outputs(params, lane, options, n):
  requests = workload(n, seed=n)
  refs = _alone(params, lane, options, requests)
  method = method_of(lane)
  engine = _engine(params, lane, options)
  results, events = _serve(engine, method, options, requests)
  assert all(r.ok for r in results)
  assert [r.tokens for r in results] == refs
  # Streaming: each request's updates concatenate to its tokens and end with done.
  streamed = {}
  for e in events:
    if isinstance(e, StreamUpdate):
      assert not streamed.get(e.request_id, ((), False))[1]
      streamed[e.request_id] = (streamed.get(e.request_id, ((), False))[0] + e.new_tokens,
                                e.done)
  assert all(streamed[r.request_id] == (r.tokens, True) for r in results)
  assert all(r.ttft is None or r.ttft <= r.latency for r in results)
  assert all(1 <= r.nfe <= G + 1 for r in results)
  # Completion order: reversed submission, 3 slots, one step per run, every prompt padded to
  # 16 and every admission 3 rows (fillers) -> same outputs.
  other = _engine(params, lane, options, **SMALL)
  again, _ = _serve(other, method, options, requests, order=range(n - 1, -1, -1))
  assert [r.tokens for r in again] == refs
  return results


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_outputs_equal_alone(params, method, sampled):
  _check_outputs(params, method, SAMPLED[method] if sampled else {}, n=24)


@pytest.mark.parametrize("options", [
    dict(steps=G, unmasking="entropy_bound", entropy_bound=1.0, temperature=1.0),
    dict(early_stop=False, temperature=1.0)], ids=["entropy_bound", "no_early_stop"])
def test_llada_rules_served_equal_alone(params, options):
  """LLaDA's adaptive count (entropy_bound: each row its own number of steps) and
  early_stop=False (a row runs all its S steps) in the 3-slot engine, one step per run:
  rows joining beside rows at other steps equal their one-prompt decodes."""
  requests = workload(9, seed=11)
  results, events = _serve(_engine(params, "llada", options, **SMALL), "llada", options,
                           requests)
  assert [r.tokens for r in results] == _alone(params, "llada", options, requests)
  assert_streams_add_up(events, results)


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["ar", "block_diffusion", "d2f", "fast_dllm_dual"])
def test_200_requests_equal_alone(params, method, sampled):
  """Every method (Fast-dLLM with its dual cache), the compiled programs of the test above."""
  results = _check_outputs(params, method, SAMPLED[method] if sampled else {}, n=200)
  assert len({len(r.tokens) for r in results}) > 3  # mixed lengths


def test_bad_requests_are_refused_alone(params):
  # The 8-slot engine's shape and options: its programs are the outputs tests' programs.
  engine = Engine(params, CFG, methods={"ar": METHODS["ar"], "d2f": METHODS["d2f"],
                                        "fast_dllm": METHODS["fast_dllm_dual"]},
                  slots=8, max_prompt_len=16, prompt_buckets=(8, 16))
  good = [engine.submit([5, 6, 7], method="d2f", seed=1),
          engine.submit([9], method="ar", seed=2),
          # The engine's own setting, spelled out: the same lane, the same output.
          engine.submit([5, 6, 7], method="d2f", options=dict(batch_invariant=True), seed=1)]
  bad = {
      engine.submit([5] * 17, method="ar"): PromptTooLongError,
      engine.submit([5, CFG.mask_token_id], method="d2f"): MaskInPromptError,
      engine.submit([5], method="fast_dllm", options=dict(threshold=-1.0)): BadOptionError,
      engine.submit([5], method="fast_dllm", options=dict(cache="bogus")): BadOptionError,
      engine.submit([5], method="fast_dllm", options=dict(rule="top_k")): BadOptionError,
      engine.submit([5], method="fast_dllm", options=dict(block_length=5)): BadOptionError,
      engine.submit([5], method="fast_dllm", options=dict(cache="prefix")): BadOptionError,
      engine.submit([5], method="fast_dllm", options=dict(steps=4)): BadOptionError,
      engine.submit([5, CFG.mask_token_id], method="fast_dllm"): MaskInPromptError,
      engine.submit([5], method="fast_dllm", max_new_tokens=0): BadOptionError,
      engine.submit([5], method="llada"): UnknownMethodError,
      engine.submit([5], method="nope"): UnknownMethodError,
      engine.submit([5], method="ar", options=dict(temperature=-1.0)): BadOptionError,
      engine.submit([5], method="ar", options=dict(tempreature=1.0)): BadOptionError,
      engine.submit([5], method="ar", options=dict(temperature=0.5)): BadOptionError,
      engine.submit([5], method="d2f", options=dict(block_size=4)): BadOptionError,
      engine.submit([5], method="d2f", options=dict(batch_invariant=False)): BadOptionError,
      engine.submit([5], method="ar", options=dict(batch_invariant=True)): BadOptionError,
      engine.submit([5], method="ar", max_new_tokens=G + 1): BadOptionError,
      engine.submit([5], method="ar", seed=-1): BadOptionError,
      engine.submit([5], method="ar", stop_ids=[CFG.vocab_size]): BadOptionError,
      engine.submit([], method="ar"): InvalidPromptError,
      engine.submit([5, CFG.vocab_size], method="ar"): InvalidPromptError,
      engine.submit("text", method="ar"): InvalidPromptError,
      engine.submit([[5]], method="ar"): InvalidPromptError,
      engine.submit([5]): UnknownMethodError,  # three lanes: the method must be named
  }
  for rid, kind in bad.items():
    result = engine.result(rid)
    assert result.status == "error" and type(result.error) is kind, (rid, result)
    with pytest.raises(kind, match=f"request {rid}"):
      result.raise_for_error()
  assert engine.occupancy == 0 and engine.busy
  engine.run_until_idle()
  got = [engine.result(i).tokens for i in good]
  assert got == _alone(params, "d2f", {}, [([5, 6, 7], dict(seed=1))]) + \
      _alone(params, "ar", {}, [([9], dict(seed=2))]) + got[:1]


def test_cancel_queued_and_running(params):
  engine = _engine(params, "ar", {}, **SMALL)  # the outputs tests' second engine
  requests = workload(6, seed=3)
  ids = [engine.submit(p, method="ar", **kw) for p, kw in requests]
  events = engine.step()  # three requests admitted and stepped once
  running = [i for i in ids[:3] if engine.result(i) is None]
  assert running
  assert engine.cancel(ids[5])  # queued
  for rid in running:
    assert engine.cancel(rid)
  assert not engine.cancel(ids[5]) and not engine.cancel(10 ** 6)
  events += engine.run_until_idle()
  assert engine.occupancy == 0
  refs = _alone(params, "ar", {}, requests)
  for rid, ref in zip(ids, refs):
    result = engine.result(rid)
    if rid in running or rid == ids[5]:
      assert result.status == "cancelled" and isinstance(result.error, CancelledError)
      assert ref[:len(result.tokens)] == result.tokens  # what was streamed is a prefix
    else:
      assert result.ok and result.tokens == ref


def test_backend_compiles_sees_a_compile(no_compile_cache):
  """The counter the no-recompile tests read does count a backend compile."""
  with backend_compiles() as compiles:
    jax.jit(lambda x: x * 3 + 1)(np.arange(5, dtype=np.float32))
  assert len(compiles) == 1


def test_no_recompiles_after_warmup(params, no_compile_cache):
  lanes = ("ar", "d2f", "fast_dllm", "llada")
  engine = Engine(params, CFG, methods={"ar": dict(gen_length=G, temperature=1.0),
                                        "d2f": dict(gen_length=G, block_length=4),
                                        "fast_dllm": dict(gen_length=G, block_length=4,
                                                          cache="dual", temperature=1.0),
                                        "llada": dict(gen_length=G, block_length=4, steps=6,
                                                      temperature=1.0)},
                  slots=4, max_prompt_len=16, prompt_buckets=(8, 16))
  engine.warmup()
  with backend_compiles() as compiles:
    for method in lanes:
      for prompt, kw in workload(30, seed=5):
        engine.submit(prompt, method=method, **kw)
    engine.run_until_idle()
    engine.submit([5, 6], method="ar")
    engine.submit([7], method="d2f")
    engine.submit([8, 9, 10], method="fast_dllm")
    engine.submit([11, 12], method="llada")
    engine.step()
    engine.cancel(engine._next_id - 1)
    engine.cancel(engine._next_id - 2)
    engine.cancel(engine._next_id - 3)
    engine.run_until_idle()
  assert compiles == []
  assert engine.metrics().occupancy > 0


def test_metrics(params):
  engine = _engine(params, "d2f", {}, slots=4)
  requests = workload(10, seed=9)
  results, _ = _serve(engine, "d2f", {}, requests)
  m = engine.metrics()
  assert m.ok == 10 and m.tokens == sum(len(r.tokens) for r in results)
  assert m.throughput == pytest.approx(m.tokens / m.wall)
  assert 0 < m.occupancy <= 1 and m.steps > 0
  assert m.latency_p50 <= m.latency_p95 <= max(r.latency for r in results) + 1e-9
  assert m.nfe_mean == pytest.approx(np.mean([r.nfe for r in results]))


def test_engine_rejects_bad_setup(params):
  with pytest.raises(ValueError, match="exceeds the model window"):
    Engine(params, CFG, methods="ar", options=dict(gen_length=64), max_prompt_len=100)
  # Every registered method is served (one generic adapter over the decoder protocol).
  assert rows.served_methods() == sorted(registry.names())
  with pytest.raises(ValueError, match="Unknown cache mode"):
    Engine(params, CFG, methods="fast_dllm", options=dict(gen_length=8, cache="full"))
  with pytest.raises(ValueError, match="multiple of block_length"):
    Engine(params, CFG, methods="fast_dllm", options=dict(gen_length=8, block_length=3))
  with pytest.raises(ValueError, match="no mask_token_id"):
    Engine(params, CFG.replace(mask_token_id=None), methods="fast_dllm",
           options=dict(gen_length=8))
  with pytest.raises(ValueError, match="batch_invariant=False"):  # the engine's contract
    Engine(params, CFG, methods="d2f", options=dict(gen_length=8, batch_invariant=False))
  with pytest.raises(ValueError, match="admit_sizes"):
    Engine(params, CFG, methods="ar", options=dict(gen_length=8), slots=4,
           admit_sizes=(2, 8))
  with pytest.raises(ValueError, match="Unknown option"):
    Engine(params, CFG, methods="ar", options=dict(gen_lenght=8))


@pytest.mark.slow
def test_mesh_slots_equal_one_device(run_devices):
  """Slots sharded over a 4-way data mesh give the one-device engine's outputs."""
  out = run_devices("""
    import json, jax, numpy as np
    from dllm_jax.models import get_preset
    from dllm_jax.parallel import mesh as mesh_lib
    from dllm_jax.serving import Engine
    import sys; sys.path.insert(0, "tests")
    from test_decoding_d2f import peaked_params
    cfg, params = get_preset("tiny"), peaked_params()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(4, 64, rng.integers(1, 9))] for _ in range(12)]
    got = {}
    for mesh in (None, mesh_lib.make_mesh({"data": 4})):
      for method, opts in (("ar", dict(gen_length=8, temperature=1.0)),
                           ("d2f", dict(gen_length=8, block_length=4, temperature=1.0))):
        e = Engine(params, cfg, methods=method, options=opts, slots=4, max_prompt_len=8,
                   prompt_buckets=(8,), mesh=mesh)
        res = e.generate(prompts, seeds=list(range(12)))
        got.setdefault(method, []).append([list(r.tokens) for r in res])
    print(json.dumps(got))
  """, devices=4)
  import json
  got = json.loads(out.strip().splitlines()[-1])
  for method, (one, mesh) in got.items():
    assert one == mesh, method
