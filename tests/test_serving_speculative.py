"""Speculative decoding served by the engine: every request equals its prompt decoded alone.

References: each prompt's one-prompt `generate([prompt], method="speculative",
rng=request_keys([seed]))` with the lane's drafter and options (and batch_invariant=True, as
the engine decodes: `served`), cut before the request's stop
ids and at max_new_tokens; greedy lanes also equal AR greedy (`generate(method="ar")`) token
for token. Drafters: the target's own weights read as a D2F (block-causal) drafter, which
rejects most drafts (and as a "selfspec" one, whose ids are positions), and as an AR
drafter, which accepts whole blocks (greedy and sampled: q = p), so both rollback and the
AR drafter's pending token run inside the engine; and a narrower, shallower random AR
drafter (the accelerated AR baseline's shape: its cache differs from the target's), which
rejects most drafts.

Compile budget: one engine shape per lane (3 slots < 12 requests, one step per run, buckets
8 and 16, admit size 3: two admission programs and one run program); the one-prompt
references pad to their 16-token bucket, so they share one program per lane. The
no-recompile test keeps a shape of its own (4 slots) so programs compiled by other tests
cannot hide a gap in warmup.
"""

import jax
import numpy as np
import pytest

from conftest import backend_compiles

from dllm_jax.decoding import generate
from dllm_jax.models import init_params
from dllm_jax.serving import (BadOptionError, Engine, MaskInPromptError, PromptTooLongError,
                              Result, request_keys)
from test_serving_engine import (CFG, G, _alone, _serve, assert_streams_add_up,  # noqa: F401
                                 params, served, workload)

K = 3
LANES = {  # lane -> (drafter kind, sampling options)
    "d2f_greedy": ("d2f", {}),
    "d2f_sampled": ("d2f", dict(temperature=1.0, top_p=0.9)),
    "ar_greedy": ("ar", {}),
    "ar_sampled": ("ar", dict(temperature=0.8)),
    "block_diffusion_greedy": ("block_diffusion", {}),
    # Ids = positions for the prompt too: the engine's re-padding of admitted rows must keep
    # them (they count from each row's first real token, not from the padded width).
    "selfspec_greedy": ("selfspec", {}),
    # The accelerated AR baseline: a narrower, shallower AR drafter with its own cache shape.
    "ar_narrow_greedy": ("ar", {}),
}
NARROW = CFG.replace(d_model=CFG.d_model // 2, n_layers=1, n_heads=2, n_kv_heads=1,
                     mlp_dim=CFG.mlp_dim // 2)
SHAPE = dict(slots=3, max_steps_per_run=1, prompt_buckets=(8, 16), admit_sizes=(3,))

# The run's persistent cache: the greedy lanes' AR references are test_serving_engine.py's,
# the sampled lanes' programs those of test_serving_row_options.py's speculative lanes.
pytestmark = pytest.mark.usefixtures("compile_cache")


def lane_options(params, lane):
  drafter, sampling = LANES[lane]
  d_params, d_cfg = params, CFG
  if "narrow" in lane:
    d_cfg = NARROW
    d_params = init_params(NARROW, jax.random.key(7))
  return dict(gen_length=G, drafter=drafter, draft_length=K, drafter_params=d_params,
              drafter_cfg=d_cfg, **sampling)


def alone(params, options, requests):
  """Each request's one-prompt speculative decode (tokens cut like the engine's, nfe)."""
  refs = []
  for prompt, kw in requests:
    one = generate(params, CFG, [prompt], method="speculative",
                   rng=request_keys([kw["seed"]]), **served("speculative", options))
    row = np.asarray(one.tokens[0])[:int(one.lengths[0])].tolist()
    row = row[:kw.get("max_new_tokens", G)]
    stop = next((j for j, t in enumerate(row) if t in kw.get("stop_ids", ())), None)
    refs.append((tuple(row if stop is None else row[:stop]), int(one.nfe)))
  return refs


@pytest.mark.parametrize("lane", [
    "d2f_greedy", "d2f_sampled",
    pytest.param("ar_greedy", marks=pytest.mark.slow),
    pytest.param("ar_sampled", marks=pytest.mark.slow),
    pytest.param("block_diffusion_greedy", marks=pytest.mark.slow),
    pytest.param("selfspec_greedy", marks=pytest.mark.slow),
    pytest.param("ar_narrow_greedy", marks=pytest.mark.slow)])
def test_outputs_equal_alone(params, lane):
  options = lane_options(params, lane)
  requests = workload(12, seed=21)
  refs = alone(params, options, requests)
  engine = Engine(params, CFG, methods="speculative", options=options, max_prompt_len=16,
                  **SHAPE)
  # Reversed submission, 3 slots, one round per run: rows join and leave mid-decode.
  results, events = _serve(engine, "speculative", {}, requests, order=range(11, -1, -1))
  assert all(r.ok for r in results)
  assert [r.tokens for r in results] == [tokens for tokens, _ in refs]
  # A request that ran to its end has the forwards of its alone decode: rounds x (1 target
  # + the drafter's forwards per round).
  for (prompt, kw), r, (tokens, nfe) in zip(requests, results, refs):
    if "max_new_tokens" not in kw and "stop_ids" not in kw:
      assert r.nfe == nfe, (prompt, kw)
  assert_streams_add_up(events, results)
  if "greedy" in lane:  # the target's greedy choices: AR greedy token for token
    assert [r.tokens for r in results] == _alone(params, "ar", {}, requests)
  else:  # the seed matters
    other = alone(params, options, [(p, dict(kw, seed=kw["seed"] + 1)) for p, kw in requests])
    assert [t for t, _ in other] != [t for t, _ in refs]


def test_bad_requests_are_refused_alone(params):
  options = lane_options(params, "d2f_greedy")
  engine = Engine(params, CFG, methods="speculative", options=options, max_prompt_len=16,
                  **SHAPE)
  good = [([5, 6, 7], dict(seed=1)), ([9], dict(seed=2, max_new_tokens=5))]
  ids = [engine.submit(p, **kw) for p, kw in good]
  fixed = engine.submit([5], options=dict(drafter_params=params))  # the lane's drafter
  bad = {
      fixed: BadOptionError,
      engine.submit([5] * 17): PromptTooLongError,
      engine.submit([5, CFG.mask_token_id]): MaskInPromptError,  # a diffusion drafter's blank
      engine.submit([5], options=dict(draft_length=0)): BadOptionError,
      engine.submit([5], options=dict(draft_length=2)): BadOptionError,  # not this lane's
      engine.submit([5], options=dict(drafter="bogus")): BadOptionError,
      engine.submit([5], options=dict(temperature=float("nan"))): BadOptionError,
      engine.submit([5], options=dict(drafter_cfg=CFG)): BadOptionError,
      engine.submit([5], options=dict(block_length=4)): BadOptionError,
      engine.submit([5], max_new_tokens=G + 1): BadOptionError,
  }
  for rid, kind in bad.items():
    result = engine.result(rid)
    assert result.status == "error" and type(result.error) is kind, (rid, result)
    with pytest.raises(kind, match=f"request {rid}"):
      result.raise_for_error()
  assert "set once per lane" in str(engine.result(fixed).error)
  engine.run_until_idle()
  assert [engine.result(i).tokens for i in ids] == [t for t, _ in alone(params, options, good)]


def test_engine_rejects_bad_setup(params):
  base = dict(gen_length=8, drafter="d2f", draft_length=3)
  with pytest.raises(ValueError, match="needs a drafter"):
    Engine(params, CFG, methods="speculative", options=base)
  with pytest.raises(ValueError, match="vocabulary"):
    Engine(params, CFG, methods="speculative",
           options=dict(base, drafter_params=params, drafter_cfg=CFG.replace(vocab_size=32)))
  with pytest.raises(ValueError, match="max_seq_len"):
    Engine(params, CFG, methods="speculative", max_prompt_len=16,
           options=dict(base, drafter_params=params, drafter_cfg=CFG.replace(max_seq_len=20)))
  with pytest.raises(ValueError, match="draft_length"):
    Engine(params, CFG, methods="speculative",
           options=dict(base, draft_length=9, drafter_params=params, drafter_cfg=CFG))


def test_no_recompiles_after_warmup(params, no_compile_cache):
  engine = Engine(params, CFG, methods="speculative",
                  options=lane_options(params, "d2f_sampled"), slots=4, max_prompt_len=16,
                  prompt_buckets=(8, 16), admit_sizes=(4,))
  engine.warmup()
  with backend_compiles() as compiles:
    for prompt, kw in workload(10, seed=5):
      engine.submit(prompt, **kw)
    engine.run_until_idle()
    engine.submit([5, 6])
    engine.submit([8, 9, 10])
    engine.step()
    engine.cancel(engine._next_id - 1)
    results = engine.run_until_idle()
  assert compiles == []
  assert any(isinstance(r, Result) and r.ok for r in results)
