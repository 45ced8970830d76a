"""Self-speculative (one-network) decoding served by the engine: every request equals its
prompt decoded alone.

References: each prompt's one-prompt `generate([prompt], method="selfspec",
rng=request_keys([seed]))` with the lane's options, cut before the request's stop ids and at
max_new_tokens; greedy lanes also equal AR greedy on the same weights token for token. The
model is the tiny network test_decoding_speculative trains with `selfspec_loss` on counting
rows (a, a+1, a+2, ...): some rows get whole drafts accepted, others have them rejected in
almost every round, so in one engine rows roll their caches back by different amounts.

Lanes: k = 3 greedy and sampled, and k = 8, whose forward ((k + 1)(k + 2) = 90 slots) is
wider than the smallest bucket's prompt + G (8 + 12): a forward writes only its clean slots,
so the cache stays prompt + G. Compile budget as in test_serving_speculative:
3 slots, one step per run, buckets 8 and 16, admit size 3.
"""

import numpy as np
import pytest

from dllm_jax.decoding import generate
from dllm_jax.decoding import selfspec
from dllm_jax.serving import (BadOptionError, Engine, MaskInPromptError, PromptTooLongError,
                              request_keys)
from test_decoding_speculative import counting_model
from test_serving_engine import CFG, G, _alone, _serve, assert_streams_add_up, workload

LANES = {"greedy": dict(draft_length=3), "sampled": dict(draft_length=3, temperature=0.9),
         "wide_draft": dict(draft_length=8)}
SHAPE = dict(slots=3, max_steps_per_run=1, prompt_buckets=(8, 16), admit_sizes=(3,))


@pytest.fixture(scope="module")
def params(run_cache):
  """A tiny self-speculative network trained on counting rows (200 steps, seconds; the
  speculative tests' target, trained once per test run)."""
  trained, loss = counting_model(run_cache, "selfspec", 0, block_size=4)
  assert loss < 1.0, f"the tiny network did not train (loss {loss})"
  return trained


def requests_of(n: int, seed: int):
  """n requests: every other one a counting prompt (a, a+1, ... of 1-8 ids), the others
  `workload`'s random prompts; stop ids and max_new_tokens as workload draws them."""
  rng = np.random.default_rng(seed)
  out = workload(n, seed)
  for i in range(0, n, 2):
    start, length = int(rng.integers(4, 40)), int(rng.integers(1, 9))
    out[i] = (list(range(start, start + length)), out[i][1])
  return out


def alone(params, options, requests):
  """Each request's one-prompt selfspec decode: (tokens cut like the engine's, nfe, tokens
  beyond one a forward)."""
  refs = []
  for prompt, kw in requests:
    one = generate(params, CFG, [prompt], method="selfspec", gen_length=G,
                   rng=request_keys([kw["seed"]]), **options)
    row = np.asarray(one.tokens[0])[:int(one.lengths[0])].tolist()
    beyond = len(row) - int(one.nfe)
    row = row[:kw.get("max_new_tokens", G)]
    stop = next((j for j, t in enumerate(row) if t in kw.get("stop_ids", ())), None)
    refs.append((tuple(row if stop is None else row[:stop]), int(one.nfe), beyond))
  return refs


@pytest.mark.parametrize("lane", ["greedy", "sampled", pytest.param("wide_draft",
                                                                    marks=pytest.mark.slow)])
def test_outputs_equal_alone(params, lane):
  options = LANES[lane]
  requests = requests_of(12, seed=31)
  refs = alone(params, options, requests)
  # Rows roll back by different amounts: a row writing its 12 tokens in 4 forwards had
  # blocks of 3 accepted whole, one taking G - 2 or more had drafts rejected in almost every
  # round.
  forwards = [nfe for _, nfe, _ in refs]
  assert min(forwards) <= 4 and max(forwards) >= G - 2 and len(set(forwards)) >= 4, forwards
  engine = Engine(params, CFG, methods="selfspec", options=dict(gen_length=G, **options),
                  max_prompt_len=16, **SHAPE)
  # Reversed submission, 3 slots, one round per run: rows join and leave mid-decode.
  results, events = _serve(engine, "selfspec", {}, requests, order=range(11, -1, -1))
  assert all(r.ok for r in results)
  assert [r.tokens for r in results] == [tokens for tokens, _, _ in refs]
  for (prompt, kw), r, (_, nfe, _) in zip(requests, results, refs):
    if "max_new_tokens" not in kw and "stop_ids" not in kw:  # ran to its end: its rounds
      assert r.nfe == nfe, (prompt, kw)
  assert_streams_add_up(events, results)
  if "temperature" not in options:  # the network's own greedy choices: AR greedy
    assert [r.tokens for r in results] == _alone(params, "ar", {}, requests)
  else:  # the seed matters
    other = alone(params, options, [(p, dict(kw, seed=kw["seed"] + 1)) for p, kw in requests])
    assert [t for t, _, _ in other] != [t for t, _, _ in refs]


def test_bad_requests_and_setups_are_refused(params):
  options = dict(gen_length=G, **LANES["greedy"])
  engine = Engine(params, CFG, methods="selfspec", options=options, max_prompt_len=16,
                  **SHAPE)
  good = [([5, 6, 7], dict(seed=1)), ([9], dict(seed=2, max_new_tokens=5))]
  ids = [engine.submit(p, **kw) for p, kw in good]
  bad = {
      engine.submit([5] * 17): PromptTooLongError,
      engine.submit([5, CFG.mask_token_id]): MaskInPromptError,  # its draft block's blank
      engine.submit([5], options=dict(draft_length=2)): BadOptionError,  # not this lane's
      engine.submit([5], options=dict(draft_length=0)): BadOptionError,
      engine.submit([5], options=dict(temperature=float("nan"))): BadOptionError,
      engine.submit([5], options=dict(block_length=4)): BadOptionError,
      engine.submit([5], max_new_tokens=G + 1): BadOptionError,
  }
  for rid, kind in bad.items():
    result = engine.result(rid)
    assert result.status == "error" and type(result.error) is kind, (rid, result)
  engine.run_until_idle()
  assert [engine.result(i).tokens for i in ids] == [t for t, _, _ in alone(
      params, LANES["greedy"], good)]
  with pytest.raises(ValueError, match="unshifted model"):
    Engine(params, CFG.replace(shift_logits=True), methods="selfspec", options=options)
  with pytest.raises(ValueError, match="no mask_token_id"):
    Engine(params, CFG.replace(mask_token_id=None), methods="selfspec", options=options)
  with pytest.raises(ValueError, match="\\(draft_length \\+ 1\\) \\* \\(draft_length \\+ 2\\) = 132 slots"):
    Engine(params, CFG.replace(max_seq_len=21), methods="selfspec", max_prompt_len=8,
           prompt_buckets=(8,), options=dict(gen_length=G, draft_length=10))
