"""Per-request traced options: requests with different temperatures, top_p, top_k, thresholds
and seeds share one running batch, and each equals its prompt decoded alone.

References: `generate([prompt], method=m, rng=request_keys([seed]), **options)` with the
request's options over the lane's (batch_invariant=True for a method that ranks, as the
engine decodes it). A request at temperature 0 is decoded alone by the greedy program (no
sampling in it); in a sampling-capable lane its row runs the sampling program and takes the
argmax, so the two must agree token for token.

Compile budget: each lane is one engine of 8 slots, one prompt bucket and one admit size (two
programs, compiled by `warmup`), but for the hybrids' lanes (speculative, selfspec,
adaptive), which take the engine shape of test_serving_speculative.py (3 slots < 12 requests,
so rows join beside rows with other options there too) and so its sampled lanes' programs;
the references share two programs per lane (greedy and sampled: traced options never
recompile). After warmup the engine compiles nothing while it serves the mixed requests
(counted with `backend_compiles`, with the persistent compilation cache off, so a counted
event is a compile). The references and
warmup use the run's cache: the speculative lanes' references are the programs of
test_serving_speculative.py's lanes.
"""

import contextlib
import math

import jax
import numpy as np
import pytest

from conftest import backend_compiles

from dllm_jax.decoding import generate, registry
from dllm_jax.models import get_preset
from dllm_jax.serving import BadOptionError, Engine, Result, request_keys, rows
from test_decoding_d2f import peaked_params
from test_serving_speculative import SHAPE as DRAFTED_ENGINE

CFG = get_preset("tiny")
G = 12
ENGINE = dict(slots=8, max_prompt_len=16, prompt_buckets=(16,), admit_sizes=(8,))
# lane -> (method, the lane's options, {traced option: values a request picks from}).
LANES = {
    "ar": ("ar", dict(gen_length=G),
           dict(temperature=[0.0, 0.5, 1.0, 1.7], top_p=[1.0, 0.9, 0.5], top_k=[0, 3, 20])),
    "d2f": ("d2f", dict(gen_length=G, block_length=4),
            dict(temperature=[0.0, 0.8, 1.3], tau_conf=[0.3, 0.6, 0.95], tau_add=[0.1, 0.6],
                 tau_act=[0.5, 0.95])),
    "block_diffusion": ("block_diffusion", dict(gen_length=G, block_length=4,
                                                remasking="random"),
                        dict(temperature=[0.0, 0.7, 1.2])),
    "fast_dllm": ("fast_dllm", dict(gen_length=G, block_length=4, cache="dual"),
                  dict(temperature=[0.0, 0.9, 1.4], threshold=[0.3, 0.6, 0.9, math.inf])),
    "fast_dllm_factor": ("fast_dllm", dict(gen_length=G, block_length=6, cache="none",
                                           rule="factor"),
                         dict(temperature=[0.0, 0.6, 1.0], factor=[0.5, 1.0, 2.0])),
    "llada": ("llada", dict(gen_length=G, block_length=4, steps=6),
              dict(temperature=[0.0, 0.6, 1.0], alg_temp=[0.0, 0.5, 1.0])),
    "llada_entropy_bound": ("llada", dict(gen_length=G, block_length=4,
                                          unmasking="entropy_bound"),
                            dict(temperature=[0.0, 1.0], entropy_bound=[0.0, 0.5, 2.0])),
    "dream": ("dream", dict(gen_length=G, block_length=6, cfg_scale=0.5),
              dict(temperature=[0.0, 1.0], alg_temp=[0.0, 0.7], cfg_scale=[0.5, 1.0, 2.5])),
    # The target's own weights as the drafter: an AR drafter samples its drafts from q (the
    # rejection rule's q = p), a D2F one drafts greedily (q a point mass).
    "speculative_ar": ("speculative", dict(gen_length=G, drafter="ar", draft_length=3),
                       dict(temperature=[0.0, 0.8, 1.3], top_p=[1.0, 0.8], top_k=[0, 4])),
    "speculative_d2f": ("speculative", dict(gen_length=G, drafter="d2f", draft_length=3),
                        dict(temperature=[0.0, 0.7, 1.1], top_p=[1.0, 0.9])),
    # The hybrids whose target samples as speculative's does (`speculative.split_sampling`):
    # selfspec on the same weights (drafts from its mask block), adaptive with the target as
    # its D2F drafter and per-request thresholds (its rows run all three modes, sampled rows
    # in VERIFY and AR).
    "selfspec": ("selfspec", dict(gen_length=G, draft_length=3),
                 dict(temperature=[0.0, 0.8, 1.2], top_p=[1.0, 0.9], top_k=[0, 5])),
    "adaptive": ("adaptive", dict(gen_length=G, draft_length=3, min_acceptance=0.3,
                                  trust_streak=1),
                 dict(temperature=[0.0, 0.7, 1.3], top_p=[1.0, 0.85],
                      parallel_confidence=[0.75, math.inf], ar_confidence=[0.0, 0.6])),
}
DRAFTED = ("speculative", "adaptive")  # methods whose lane options carry the drafter
HYBRIDS = ("speculative", "selfspec", "adaptive")  # the engine shape of their serving tests

pytestmark = pytest.mark.usefixtures("compile_cache")


@contextlib.contextmanager
def compile_cache_off():
  """The persistent compilation cache off while the block runs (as `no_compile_cache` does
  for a whole test), so that each compile it counts is a compile, not a load."""
  saved = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", saved)


@pytest.fixture(scope="module")
def params():
  return peaked_params()


def mixed_requests(choices: dict, n: int, seed: int):
  """n requests, each with its own prompt (1..14 tokens), seed and traced options (the
  first two at temperature 0: greedy rows beside sampled ones)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    prompt = [int(t) for t in rng.integers(4, CFG.vocab_size, rng.integers(1, 15))]
    options = {k: v[int(rng.integers(len(v)))] for k, v in choices.items()}
    if i < 2:
      options["temperature"] = 0.0
    elif i < 4:
      options["temperature"] = choices["temperature"][-1]
    kw = dict(seed=int(rng.integers(0, 2 ** 32)), options=options)
    if rng.random() < 0.3:
      kw["max_new_tokens"] = int(rng.integers(1, G + 1))
    out.append((prompt, kw))
  return out


def alone(params, method: str, lane_options: dict, prompt, kw) -> tuple:
  """The request's one-prompt decode, cut at max_new_tokens as the engine cuts it."""
  options = {**lane_options, **kw["options"]}
  if method in registry.ranking_methods():
    options["batch_invariant"] = True
  one = generate(params, CFG, [prompt], method=method, rng=request_keys([kw["seed"]]),
                 **options)
  row = np.asarray(one.tokens[0])[:int(one.lengths[0])].tolist()
  return tuple(row[:kw.get("max_new_tokens", G)])


@pytest.mark.parametrize("lane", sorted(LANES))
def test_mixed_options_in_one_batch_equal_alone(params, lane):
  """12 requests with different traced options and seeds in one lane of 8 slots (3 for the
  speculative lanes), so rows join beside rows with other options: each equals its decode
  alone, and after warmup the lane compiles nothing."""
  method, lane_options, choices = LANES[lane]
  if method in DRAFTED:
    lane_options = dict(lane_options, drafter_params=params, drafter_cfg=CFG)
  requests = mixed_requests(choices, 12, seed=len(lane))
  combinations = math.prod(len(v) for v in choices.values())
  assert len({tuple(sorted(kw["options"].items())) for _, kw in requests}) >= min(
      5, combinations)
  refs = [alone(params, method, lane_options, prompt, kw) for prompt, kw in requests]
  shape = dict(ENGINE, **DRAFTED_ENGINE) if method in HYBRIDS else ENGINE
  engine = Engine(params, CFG, methods=method, options={**lane_options, "sampling": True},
                  **shape)
  engine.warmup()
  with compile_cache_off(), backend_compiles() as compiles:
    ids = [engine.submit(prompt, method=method, **kw) for prompt, kw in requests]
    events = engine.run_until_idle()
  assert compiles == []
  results = {e.request_id: e for e in events if isinstance(e, Result)}
  assert [results[i].status for i in ids] == ["ok"] * len(ids)
  assert [results[i].tokens for i in ids] == refs


@pytest.mark.parametrize("lane", ["speculative_ar", "selfspec", "adaptive"])
def test_a_greedy_hybrid_lane_draws_no_random_numbers(params, lane):
  """A hybrid's lane built at temperature 0 holds the greedy rule only: its init (round 0)
  and step draw no random numbers, while a sampling lane's do (its rows' temperatures
  traced). The programs are traced, not compiled."""
  method, lane_options, _ = LANES[lane]
  if method in DRAFTED:
    lane_options = dict(lane_options, drafter_params=params, drafter_cfg=CFG)

  def program(temperature) -> str:
    plan = registry.get(method).lane_plan(CFG, dict(lane_options, temperature=temperature))
    decoder, both = plan.decoder, plan.params(params)
    traced = rows.stack_traced([plan.traced] * 2)
    tokens, valid = np.full((2, 4), 5, np.int32), np.ones((2, 4), bool)
    round_one = lambda: decoder.step(both, decoder.init(both, tokens, valid,
                                                        request_keys([1, 2]), traced))
    return str(jax.jit(round_one).trace().jaxpr)

  assert "random_bits" not in program(0.0), f"{lane}: the greedy lane draws random numbers"
  assert "random_bits" in program(0.7), f"{lane}: the sampling lane draws nothing"


def test_greedy_lane_refuses_sampling_and_names_the_fix(params):
  """A lane built greedy (temperature 0, sampling unset) compiles the greedy program: a
  sampled request is refused, naming temperature and sampling=True; a greedy request with
  its own top_p (unused at temperature 0) fits."""
  engine = Engine(params, CFG, methods="ar", options=dict(gen_length=G), **ENGINE)
  bad = engine.submit([5, 6], options=dict(temperature=0.7))
  good = engine.submit([5, 6], options=dict(top_p=0.5), seed=4)
  events = {e.request_id: e for e in engine.run_until_idle() if isinstance(e, Result)}
  error = events[bad].error
  assert isinstance(error, BadOptionError)
  assert "temperature" in str(error) and "sampling=True" in str(error)
  assert events[good].ok
  assert events[good].tokens == alone(params, "ar", dict(gen_length=G), [5, 6],
                                      dict(seed=4, options={}))


@pytest.mark.parametrize("lane, options, field", [
    ("ar", dict(temperature=math.nan), "temperature"),
    ("ar", dict(temperature=-1.0), "temperature"),
    ("ar", dict(top_p=math.inf), "top_p"),
    ("ar", dict(top_p=0.0), "top_p"),
    ("ar", dict(top_k=-3), "top_k"),
    ("ar", dict(top_k=2 ** 40), "top_k"),
    ("ar", dict(temperature="hot"), "temperature"),
    ("d2f", dict(tau_conf=math.nan), "tau_conf"),
    ("d2f", dict(tau_add=1.5), "tau_add"),
    ("fast_dllm", dict(threshold=-0.1), "threshold"),
    ("llada", dict(alg_temp=math.inf), "alg_temp"),
    ("d2f", dict(block_length=6), "block_length"),      # static: another program
    ("ar", dict(sampling=False), "sampling"),           # a lane's setting
])
def test_bad_row_options_are_refused_before_a_slot(params, lane, options, field):
  """NaN, inf, out-of-range or mistyped per-request values, and static options other than
  the lane's, are a BadOptionError naming the field; nothing is queued or admitted."""
  method, lane_options, _ = LANES[lane]
  engine = Engine(params, CFG, methods=method, options={**lane_options, "sampling": True},
                  **ENGINE)
  rid = engine.submit([5, 6, 7], options=options)
  assert not engine.lanes[method].queue and engine.occupancy == 0
  (result,) = engine.step()
  assert result.request_id == rid and result.status == "error"
  assert isinstance(result.error, BadOptionError) and field in str(result.error)


def test_sampling_flag_is_checked(params):
  with pytest.raises(ValueError, match="sampling must be True or False"):
    Engine(params, CFG, methods="ar", options=dict(gen_length=G, sampling=1), **ENGINE)
  # A decoder that declares no `sampling_options` compiles each temperature on its own: its
  # lane cannot take sampling=True (every registered method can).
  static = type("StaticTemperatureAR", (registry.get("ar"),), {"sampling_options": ()})
  registry.register("static_temperature_ar", static)
  try:
    with pytest.raises(ValueError, match="temperature is static"):
      Engine(params, CFG, methods="static_temperature_ar",
             options=dict(gen_length=G, sampling=True), **ENGINE)
  finally:
    registry.unregister("static_temperature_ar")
