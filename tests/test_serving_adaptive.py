"""Task-adaptive decoding served by the engine: every request equals its prompt decoded alone.

References: each prompt's one-prompt `generate([prompt], method="adaptive",
rng=request_keys([seed]), tasks=[its tag])` with the lane's drafter, rule and tag map (and
batch_invariant=True, as the engine decodes: `served`), cut
before the request's stop ids and at max_new_tokens, with the same forwards where the
request ran to its end. The target is test_serving_engine's peaked random tiny model and the
drafter the same weights read as a D2F (block-causal) drafter. The tag map forces each mode
(`ar`, `parallel`, `verify`) on some requests and leaves the others to the rule ("auto" and
untagged), whose thresholds are set so that the rule picks all three modes over the
workload: rows in different modes share every batch, admitted in reversed order into 3
slots, one round per run.

Compile budget as in test_serving_speculative: 3 slots, one step per run, buckets 8 and 16,
admit size 3; the one-prompt references pad to their 16-token bucket.
"""

import numpy as np
import pytest

from dllm_jax.decoding import adaptive, generate
from dllm_jax.serving import BadOptionError, Engine, MaskInPromptError, request_keys
from test_serving_engine import (CFG, G, assert_streams_add_up, params,  # noqa: F401
                                 served, workload)

TAGS = {"sum": "ar", "sort": "parallel", "copy": "verify", "other": "auto"}
RULE = dict(draft_length=3, parallel_confidence=0.75, ar_confidence=0.6, min_acceptance=0.3,
            trust_streak=1, task_modes=TAGS)
SAMPLING = {"greedy": {}, "sampled": dict(temperature=1.0, top_p=0.9)}
SHAPE = dict(slots=3, max_steps_per_run=1, prompt_buckets=(8, 16), admit_sizes=(3,))


def lane_options(params, sampling):
  return dict(gen_length=G, drafter_params=params, drafter_cfg=CFG, **RULE,
              **SAMPLING[sampling])


def tagged(requests, seed):
  """The requests with a task tag drawn for most of them (None: untagged)."""
  rng = np.random.default_rng(seed)
  tags = list(TAGS) + [None]
  return [(p, kw, tags[int(rng.integers(len(tags)))]) for p, kw in requests]


def alone(params, options, requests):
  """Each request's one-prompt adaptive decode: (tokens cut like the engine's, nfe, the
  modes of its rounds)."""
  refs = []
  for prompt, kw, tag in requests:
    one = generate(params, CFG, [prompt], method="adaptive", rng=request_keys([kw["seed"]]),
                   tasks=[tag], **served("adaptive", options))
    row = np.asarray(one.tokens[0])[:int(one.lengths[0])].tolist()
    row = row[:kw.get("max_new_tokens", G)]
    stop = next((j for j, t in enumerate(row) if t in kw.get("stop_ids", ())), None)
    modes = {int(m) for m in np.asarray(one.round_modes[0]) if m != adaptive.NO_ROUND}
    refs.append((tuple(row if stop is None else row[:stop]), int(one.nfe), modes))
  return refs


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_outputs_equal_alone(params, sampling):
  options = lane_options(params, sampling)
  requests = tagged(workload(15, seed=41), seed=41)
  refs = alone(params, options, requests)
  # Every mode runs, forced by a tag and chosen by the rule, and some rows switch mode.
  seen = set().union(*(modes for _, _, modes in refs))
  assert seen == {adaptive.PARALLEL, adaptive.VERIFY, adaptive.AR}, seen
  free = [modes for (_, _, tag), (_, _, modes) in zip(requests, refs)
          if TAGS.get(tag, "auto") == "auto"]
  assert len(set().union(*free)) >= 2 and any(len(m) > 1 for m in free), free

  engine = Engine(params, CFG, methods="adaptive", options=options, max_prompt_len=16, **SHAPE)
  ids = {}
  for i in range(len(requests) - 1, -1, -1):  # reversed: rows join and leave mid-decode
    prompt, kw, tag = requests[i]
    ids[i] = engine.submit(prompt, options={} if tag is None else dict(task=tag), **kw)
  events = engine.run_until_idle()
  results = [engine.result(ids[i]) for i in range(len(requests))]
  assert all(r.ok for r in results)
  assert [r.tokens for r in results] == [tokens for tokens, _, _ in refs]
  for (prompt, kw, tag), r, (_, nfe, _) in zip(requests, results, refs):
    if "max_new_tokens" not in kw and "stop_ids" not in kw:  # ran to its end
      assert r.nfe == nfe, (prompt, kw, tag)
  assert_streams_add_up(events, results)
  if sampling == "sampled":  # the seed matters
    other = alone(params, options, [(p, dict(kw, seed=kw["seed"] + 1), t)
                                    for p, kw, t in requests])
    assert [t for t, _, _ in other] != [t for t, _, _ in refs]


def test_bad_requests_and_setups_are_refused(params):
  options = lane_options(params, "greedy")
  engine = Engine(params, CFG, methods="adaptive", options=options, max_prompt_len=16,
                  **SHAPE)
  good = [([5, 6, 7], dict(seed=1), "sum"), ([9], dict(seed=2, max_new_tokens=5), None)]
  ids = [engine.submit(p, options={} if t is None else dict(task=t), **kw)
         for p, kw, t in good]
  bad = {
      engine.submit([5], options=dict(task="poetry")): ("unknown task tag 'poetry'", "sum"),
      engine.submit([5], options=dict(tasks=["sum"])): ("task=<tag>",),
      engine.submit([5], options=dict(drafter_params=params)): ("set once per lane",),
      # The thresholds are traced, so a request may set its own (per row), but not NaN.
      engine.submit([5], options=dict(ar_confidence=float("nan"))): ("ar_confidence",),
      engine.submit([5], options=dict(task_modes={"sum": "verify"})): (
          "task_modes", "set once per lane"),
      engine.submit([5], options=dict(draft_steps=9)): ("draft_steps",),
  }
  for rid, words in bad.items():
    result = engine.result(rid)
    assert result.status == "error" and type(result.error) is BadOptionError, (rid, result)
    assert all(w in str(result.error) for w in words), result.error
  masked = engine.submit([5, CFG.mask_token_id])  # the drafter's blank
  assert type(engine.result(masked).error) is MaskInPromptError
  engine.run_until_idle()
  assert [engine.result(i).tokens for i in ids] == [t for t, _, _ in alone(params, options,
                                                                           good)]
  with pytest.raises(ValueError, match="needs a diffusion drafter"):
    Engine(params, CFG, methods="adaptive", options=dict(gen_length=G))
  with pytest.raises(ValueError, match="max_seq_len"):
    Engine(params, CFG, methods="adaptive", max_prompt_len=16,
           options=dict(options, drafter_cfg=CFG.replace(max_seq_len=20)))
