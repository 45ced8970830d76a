"""The study's paired bootstrap intervals: every cell stores its per-prompt results, and an
interval in the verdict recomputes from them (an independent NumPy re-statement here)."""

import dataclasses
import json

import numpy as np
import pytest

from dllm_jax.data.tasks import TaskSuite
from dllm_jax.decoding.base import DecodeOutput
from studylib import accounting, intervals, report, runner, verdict
from studylib.accounting import MethodResult
from test_study import RowIndexLayout

from dllm_jax.data.tasks import Example

N = 40
EXAMPLES = [Example(f"{i}+1=", str(i + 1), str(i + 1), "arithmetic") for i in range(N)]


def fake(offset_of, nfe_of):
  """A decoder answering prompt i with `i + offset_of(i)` (right iff the offset is 1) in
  `nfe_of(i)` forwards, with a wall time that grows with them."""
  tok = RowIndexLayout.tokenizer

  def decode(params, tokens, valid, rng):
    i = int(tokens[0, 0])
    ids = tok.encode(str(i + offset_of(i)))
    for _ in range(200 * nfe_of(i)):  # some work per forward: a measurable wall time
      pass
    return DecodeOutput(tokens=np.array([ids], np.int32), lengths=np.array([len(ids)]),
                        nfe=np.array(nfe_of(i)), steps=np.array(nfe_of(i)),
                        committed=np.array([len(ids)]), done=np.ones(1, bool))
  return decode


def tiny_run():
  """AR right on every prompt in 3 forwards; D2F wrong on every fifth in 1."""
  cells = [runner.Cell(fake(lambda i: 1, lambda i: 3), None, "ar", "ar", {}, 1),
           runner.Cell(fake(lambda i: 2 if i % 5 == 0 else 1, lambda i: 1), None, "d2f",
                       "d2f", {}, 1)]
  return runner.run_cells(cells, layout=RowIndexLayout(), suite=TaskSuite.parse("arithmetic:1"),
                          examples=EXAMPLES, prompt_len=4)


def restated_interval(stat, n, resamples=intervals.RESAMPLES, seed=intervals.SEED):
  """The percentile interval of `stat(idx)` over resampled prompt indices, drawn as the
  module draws them, computed by indexing instead of its weight matrix."""
  draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
  values = np.array([stat(idx) for idx in draws])
  return list(np.percentile(values, [2.5, 97.5]))


def test_cells_store_each_prompt_and_each_timed_batch():
  ar, d2f = tiny_run()
  assert d2f.per_prompt["correct"] == [0 if i % 5 == 0 else 1 for i in range(N)]
  assert d2f.per_prompt["task"] == ["arithmetic"] * N
  assert d2f.per_prompt["tokens"] == [len(str(i + (2 if i % 5 == 0 else 1))) for i in range(N)]
  assert ar.per_batch["rows"] == [1] * N and ar.per_batch["forwards"] == [3] * N
  assert sum(ar.per_batch["wall_s"]) == pytest.approx(ar.wall_s)
  assert sum(d2f.per_prompt["correct"]) == d2f.num_correct


def test_a_stored_interval_recomputes_from_the_stored_per_prompt_results():
  """The verdict's intervals for the D2F cell, from study.json's stored rows, equal an
  independent re-statement over the same stored prompts."""
  results = tiny_run()
  doc = accounting.results_json(results, machine={"platform": "cpu"},
                                config={"eval": {"headline_task": "arithmetic",
                                                 "llada_vanilla_label": "llada"}})
  doc["verdict"] = verdict.judge(results, task="arithmetic", llada_label="llada")
  stored = json.loads(json.dumps(doc))
  accounting.validate_json(stored)
  verdict.check_recomputes(stored)
  (judged,) = next(c for c in stored["verdict"]["claims"] if c["id"] == "d2f_vs_ar")["cells"]
  rows = {r["label"]: r for r in stored["results"]}
  ar, d2f = rows["ar"], rows["d2f"]
  c, cb = np.array(d2f["per_prompt"]["correct"]), np.array(ar["per_prompt"]["correct"])
  t, tb = np.array(d2f["per_prompt"]["tokens"]), np.array(ar["per_prompt"]["tokens"])
  w, wb = np.array(d2f["per_batch"]["wall_s"]), np.array(ar["per_batch"]["wall_s"])
  delta = restated_interval(lambda i: 100 * (c[i].mean() - cb[i].mean()), N)
  speedup = restated_interval(lambda i: (t[i].sum() / w[i].sum()) / (tb[i].sum() / wb[i].sum()),
                              N)
  assert judged["accuracy_delta_ci95"] == pytest.approx(delta, abs=1e-9)
  assert judged["speedup_ci95"] == pytest.approx(speedup, rel=1e-9)
  assert judged["accuracy_delta_ci95"][0] < judged["accuracy_delta_points"] == -20.0 \
      < judged["accuracy_delta_ci95"][1]
  lo, hi = judged["speedup_ci95"]
  assert lo <= judged["speedup"] <= hi


def test_table_and_verdict_text_print_the_intervals():
  ar, d2f = tiny_run()
  table = report.markdown_table([ar, d2f], baseline="ar")
  ci = intervals.versus(d2f, ar, None, None)
  lo, hi = ci["accuracy_delta_ci95"]
  assert f"| -20.0 [{lo:+.1f}, {hi:+.1f}] |" in table
  text = verdict.verdict_text(verdict.judge([ar, d2f], task="arithmetic", llada_label="llada"))
  assert f"accuracy -20.0 [{lo:+.1f}, {hi:+.1f}] points" in text


def test_pooled_strata_resample_within_each_seed():
  """Two seeds' batches: every resample keeps each seed's count of batches."""
  w = intervals.weights([3, 5], resamples=50, seed=1)
  assert w.shape == (50, 8)
  assert (w[:, :3].sum(1) == 3).all() and (w[:, 3:].sum(1) == 5).all()
  assert intervals.weights([3, 5], resamples=50, seed=1) is w  # cached, read-only
  with pytest.raises(ValueError, match="at least one batch"):
    intervals.weights([0])


def test_cells_without_per_prompt_results_have_no_interval():
  """A document written before per-prompt results were kept: intervals are None, never a
  crash."""
  old = MethodResult("ar", "ar", {}, 1, 10, 9, 30, 1.0, 0.1, 30, 30, {"t": [9, 10]}, 1.0)
  assert intervals.versus(old, old, None, None) == {"accuracy_delta_ci95": None,
                                                     "speedup_ci95": None}
  assert intervals.own(old) == {"accuracy_ci95": None, "tokens_per_s_ci95": None}


def test_a_figure_without_a_denominator_has_no_interval_and_round_trips():
  """A baseline that wrote no token: its ratio has no denominator in any resample, so the
  interval is None (never NaN, which would not equal itself after a JSON round trip)."""
  assert intervals.rate_ratio([1, 2], [1.0, 1.0], [0, 0], [1.0, 1.0]) is None
  assert intervals.proportion([0, 0], [0, 0]) is None
  ar, d2f = tiny_run()
  silent = dataclasses.replace(ar, response_tokens=0,
                               per_prompt={**ar.per_prompt, "tokens": [0] * N})
  v = verdict.judge([silent, d2f], task="arithmetic", llada_label="llada")
  assert json.loads(json.dumps(v)) == v
