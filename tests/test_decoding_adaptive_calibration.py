"""Threshold calibration: the pick on a constructed sweep equals the hand computation, the
split must be disjoint from the evaluation prompts, and an end-to-end sweep on tiny models."""

import json

import numpy as np
import pytest

from studylib import adaptive_calibration as calib
from dllm_jax.decoding import ar

PROMPTS = [[5, 6], [7, 8], [9, 10], [11, 12]]
ANSWERS = [[20], [21], [22], [23]]
INF = float("inf")
GRID = {"parallel_confidence": [0.5, 0.9, INF], "trust_streak": [0, 2]}


def constructed(thresholds, prompts):
  """Hand-made sweep: (correct rows, target forwards, drafter forwards), 40 tokens each."""
  pc, trust = thresholds["parallel_confidence"], thresholds.get("trust_streak", 0)
  correct, tf, df = {0.5: (2, 0, 8), 0.9: (4, 10, 10) if trust == 0 else (3, 5, 10),
                     INF: (4, 12, 12)}[pc]
  responses = [a if i < correct else [0] for i, a in enumerate(ANSWERS)]
  return calib.Decoded(responses, 40, tf, df)


def ar_reference(prompts):
  return calib.Decoded(list(ANSWERS), 40, 40, 0)


@pytest.mark.parametrize("tolerance, cost, expected", [
    # acc >= 0.9 leaves (0.9, 0): 40 / 20 = 2.0 and (inf, *): 40 / 24 = 1.67.
    (0.1, 1.0, {"parallel_confidence": 0.9, "trust_streak": 0}),
    # acc >= 0.75 adds (0.9, 2): 40 / 15 = 2.67; 0.5 (acc 0.5, 5.0) stays out.
    (0.25, 1.0, {"parallel_confidence": 0.9, "trust_streak": 2}),
    # drafter forwards at 4x: (0.9, 0) 40 / 50 = 0.8, (0.9, 2) 40 / 45 = 0.89, (inf, 0)
    # 40 / 60 = 0.67: (0.9, 2) at tolerance 0.25.
    (0.25, 4.0, {"parallel_confidence": 0.9, "trust_streak": 2}),
    # everything eligible: parallel everywhere, 40 / 8 = 5.0.
    (0.5, 1.0, {"parallel_confidence": 0.5, "trust_streak": 0}),
])
def test_pick_equals_the_hand_computation(tolerance, cost, expected):
  result = calib.calibrate(constructed, ar_reference, PROMPTS, ANSWERS, eval_prompts=[[1, 2]],
                           grid=GRID, tolerance=tolerance, drafter_cost=cost)
  assert result.options == expected
  assert result.ar_accuracy == 1.0 and result.ar_tokens_per_forward == 1.0
  assert len(result.trials) == 6
  written = json.loads(result.to_json())
  assert written["options"] == {k: ("inf" if v == INF else v) for k, v in expected.items()}
  assert written["accuracy"] == result.chosen.accuracy


def test_split_and_grid_errors():
  run = lambda **kw: calib.calibrate(constructed, ar_reference, PROMPTS, ANSWERS,
                                     **({"eval_prompts": None, "grid": GRID} | kw))
  with pytest.raises(ValueError, match=r"1 of 4 calibration prompts are also evaluation "
                                       r"prompts \(calibration rows \[2\]\)"):
    run(eval_prompts=[[1], [9, 10]])
  with pytest.raises(TypeError):
    calib.calibrate(constructed, ar_reference, PROMPTS, ANSWERS, grid=GRID)  # eval set named
  with pytest.raises(ValueError, match="unknown thresholds"):
    run(grid={"tau_conf": [0.9]})
  with pytest.raises(ValueError, match="non-empty list"):
    run(grid={"trust_streak": []})
  with pytest.raises(ValueError, match="one answer per calibration prompt"):
    calib.calibrate(constructed, ar_reference, PROMPTS, ANSWERS[:2], eval_prompts=None)
  with pytest.raises(ValueError, match="no threshold setting keeps accuracy"):
    run(grid={"parallel_confidence": [0.5]}, tolerance=0.0)
  with pytest.raises(ValueError, match="tolerance"):
    run(tolerance=float("nan"))
  assert calib.check_disjoint(["a b"], ["b a"]) is None  # text prompts compare as text


def tiny_decoders():
  """(decode, ar_decode, prompts, answers) on two unrelated random tiny models: the answers
  are the target's own greedy outputs (AR accuracy 1)."""
  from test_decoding_speculative import CFG, G, K, PROMPTS as P3, batch_of, random_params
  target, drafter = random_params(CFG, 0, 0.3), random_params(CFG, 1, 0.3)
  tokens, valid = batch_of(P3)
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  answers = [np.asarray(ref.tokens[r, :int(ref.lengths[r])]).tolist() for r in range(3)]
  decode, ar_decode = calib.model_decoders(target, CFG, drafter, CFG, batch_size=4,
                                           gen_length=G, draft_length=K)
  return decode, ar_decode, P3, answers


@pytest.mark.slow
def test_end_to_end_on_tiny_models_keeps_ar_accuracy():
  """Answers are the target's own greedy outputs (AR accuracy 1): an unrelated drafter's
  parallel commits are wrong, so the pick is the verified setting."""
  decode, ar_decode, P3, answers = tiny_decoders()
  grid = {"parallel_confidence": [0.0, INF], "ar_confidence": [0.0],
          "min_acceptance": [0.0], "trust_streak": [0]}
  result = calib.calibrate(decode, ar_decode, P3, answers, eval_prompts=[[1, 2, 3]],
                           grid=grid, tolerance=0.01)
  assert result.ar_accuracy == 1.0
  assert result.options["parallel_confidence"] == INF and result.chosen.accuracy == 1.0
  parallel = result.trials[0]
  assert parallel.accuracy < 1.0 and parallel.tokens_per_forward > \
      result.chosen.tokens_per_forward


def test_choose_task_modes_takes_the_fastest_mode_within_tolerance():
  """By hand: per task, the fastest mode whose accuracy is within tolerance of AR's."""
  ar_accuracy = {"long": 1.0, "sums": 1.0, "short": 0.9}
  trials = {"parallel": {"long": (0.95, 30.0), "sums": (0.4, 50.0), "short": (0.9, 9.0)},
            "verify": {"long": (1.0, 14.0), "sums": (1.0, 8.0), "short": (0.9, 8.0)},
            "ar": {"long": (1.0, 10.0), "sums": (1.0, 10.0), "short": (0.9, 9.0)}}
  # tolerance 0: long -> verify (parallel loses 5 points); sums -> ar (verify is slower);
  # short: parallel and ar tie at 9.0, the first mode in order wins.
  assert calib.choose_task_modes(ar_accuracy, trials) == {
      "long": "verify", "short": "parallel", "sums": "ar"}
  assert calib.choose_task_modes(ar_accuracy, trials, tolerance=0.05)["long"] == "parallel"
  # A speed that was not measured never wins; a task needs every mode's figures.
  nan_trials = {**trials, "parallel": {**trials["parallel"], "long": (1.0, float("nan"))}}
  assert calib.choose_task_modes(ar_accuracy, nan_trials)["long"] == "verify"
  with pytest.raises(ValueError, match=r"task 'long' has no calibration figures for modes "
                                       r"\['verify'\]"):
    calib.choose_task_modes(ar_accuracy, {**trials, "verify": {"sums": (1.0, 1.0),
                                                               "short": (1.0, 1.0)}})
  with pytest.raises(ValueError, match="no mode keeps task 'sums' within 0.0"):
    calib.choose_task_modes({"sums": 1.0}, {"parallel": {"sums": (0.4, 50.0)}})
  with pytest.raises(ValueError, match="trials must map modes of"):
    calib.choose_task_modes(ar_accuracy, {"fast": trials["ar"]})


def test_calibrate_task_modes_by_hand():
  """A constructed decoder whose figures depend on each row's forced mode: "copy" rows are
  right in every mode (parallel commits 4 tokens per forward), "sums" rows are wrong in
  parallel; the map is the most tokens per forward within tolerance, per task."""
  prompts, answers = [[1], [2], [3], [4]], [[10], [11], [12], [13]]
  tasks = ["copy", "sums", "copy", "sums"]
  per_row = {"parallel": (4, 0, 1), "verify": (2, 1, 1), "ar": (1, 1, 0)}  # tokens, tf, df
  seen = []

  def decode(thresholds, p, tasks=None, task_modes=None):
    seen.append((tuple(tasks), dict(task_modes)))
    rows = [prompts.index(x) for x in p]
    responses = []
    for r, t in zip(rows, tasks):
      mode = task_modes[t]
      responses.append(answers[r] if (mode != "parallel" or t == "copy") else [0])
    tokens, tf, df = per_row[task_modes[tasks[0]]]
    return calib.Decoded(responses, tokens * len(p), tf * len(p), df * len(p))

  def ar_decode(p):
    return calib.Decoded([answers[prompts.index(x)] for x in p], len(p), len(p), 0)

  result = calib.calibrate_task_modes(decode, ar_decode, prompts, answers, tasks,
                                      eval_prompts=[[9]])
  assert result.task_modes == {"copy": "parallel", "sums": "verify"}  # 4.0 / 1.0 vs 1.0
  assert result.trials["parallel"]["sums"] == (0.0, 4.0)
  assert result.trials["verify"]["copy"] == (1.0, 1.0)
  assert result.ar_accuracy == {"copy": 1.0, "sums": 1.0}
  # Every decode forces one mode on every tag, on one task's rows.
  assert all(len(set(modes.values())) == 1 and len(set(t)) == 1 for t, modes in seen)
  # A drafter forward at 3 target forwards: verify 2 / 4 = 0.5 < AR's 1.0 on "sums".
  costly = calib.calibrate_task_modes(decode, ar_decode, prompts, answers, tasks,
                                      eval_prompts=None, drafter_cost=3.0)
  assert costly.task_modes["sums"] == "ar"
  assert json.loads(costly.to_json())["task_modes"] == costly.task_modes
  with pytest.raises(ValueError, match="one task per calibration prompt"):
    calib.calibrate_task_modes(decode, ar_decode, prompts, answers, tasks[:3],
                               eval_prompts=None)
  with pytest.raises(ValueError, match="also evaluation prompts"):
    calib.calibrate_task_modes(decode, ar_decode, prompts, answers, tasks,
                               eval_prompts=[[2]])


@pytest.mark.slow
def test_calibrate_task_modes_on_tiny_models_keeps_ar_accuracy():
  """Answers are the target's greedy outputs; an unrelated drafter's parallel commits are
  wrong, so every task gets a mode with AR's accuracy (verify or AR: both are exact)."""
  decode, ar_decode, P3, answers = tiny_decoders()
  result = calib.calibrate_task_modes(decode, ar_decode, P3, answers, ["a", "b", "a"],
                                      eval_prompts=None)
  assert set(result.task_modes) == {"a", "b"}
  assert set(result.task_modes.values()) <= {"verify", "ar"}
  for mode in ("verify", "ar"):
    assert all(result.trials[mode][t][0] == 1.0 for t in ("a", "b"))
  assert result.trials["parallel"]["a"][0] < 1.0 or result.trials["parallel"]["b"][0] < 1.0
