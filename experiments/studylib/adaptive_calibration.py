"""Calibrating adaptive decoding's thresholds on a held-out split, never on evaluation prompts.

Shape legend: N calibration prompts; a grid of T threshold settings.

    decode, ar_decode = model_decoders(target, target_cfg, drafter, drafter_cfg,
                                       gen_length=32, draft_length=4)
    result = calibrate(decode, ar_decode, prompts, answers, eval_prompts=eval_prompts)
    result.options  # {"parallel_confidence": ..., "ar_confidence": ..., ...}

Every setting of the grid (the Cartesian product of `grid`, in its order) decodes the N
prompts; the thresholds are traced, so the whole sweep is one compiled program. A setting is
eligible when its accuracy is at least AR's accuracy on the same prompts minus `tolerance`;
the chosen one has the most tokens per forward,

    tokens per forward = committed tokens / (target forwards + drafter_cost * drafter forwards)

(drafter_cost: a drafter forward's cost in target forwards; 1 counts forwards), the first in
grid order on ties. `calibrate` refuses a calibration split that shares a prompt with the
evaluation prompts.

The task-tag map (`task_modes`) is fitted the same way, one task at a time
(`calibrate_task_modes`, by tokens per forward; the study's calibration step by measured
tokens/s; both choose with `choose_task_modes`): each mode of CALIBRATED_MODES is forced on the task's calibration
prompts (its tag mapped to that mode), and the task gets the fastest mode whose accuracy is
within `tolerance` of AR's on those prompts. "ar" is AR itself, so some mode always
qualifies.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from dllm_jax.decoding import adaptive, ar, base
from dllm_jax.decoding.adaptive_rule import DEFAULT_GRID  # re-exported


INF = float("inf")
# The modes a task can be given (`choose_task_modes`), in tie-break order.
CALIBRATED_MODES = ("parallel", "verify", "ar")


@dataclasses.dataclass(frozen=True)
class Decoded:
  """What one sweep point decoded: responses (cut at the first stop), committed tokens,
  target and drafter forwards summed over the batches."""
  responses: list
  committed: int
  target_forwards: int
  drafter_forwards: int


@dataclasses.dataclass(frozen=True)
class Trial:
  """One grid point: its thresholds, accuracy and tokens per forward."""
  thresholds: dict
  accuracy: float
  tokens_per_forward: float
  committed: int
  target_forwards: int
  drafter_forwards: int


@dataclasses.dataclass(frozen=True)
class CalibrationResult:
  """The chosen thresholds (`options`, ready for `generate(method="adaptive", ...)`), AR's
  reference figures and every trial."""
  options: dict
  chosen: Trial
  ar_accuracy: float
  ar_tokens_per_forward: float
  tolerance: float
  drafter_cost: float
  trials: list

  def to_json(self) -> str:
    def trial(t: Trial):
      return dataclasses.asdict(t) | {"thresholds": _jsonable(t.thresholds)}
    return json.dumps({
        "method": "adaptive", "options": _jsonable(self.options),
        "accuracy": self.chosen.accuracy, "tokens_per_forward": self.chosen.tokens_per_forward,
        "ar_accuracy": self.ar_accuracy, "ar_tokens_per_forward": self.ar_tokens_per_forward,
        "tolerance": self.tolerance, "drafter_cost": self.drafter_cost,
        "trials": [trial(t) for t in self.trials]}, indent=2)


def _jsonable(d: Mapping) -> dict:
  """inf (a threshold that never fires) as the string "inf", which float() reads back."""
  return {k: ("inf" if isinstance(v, float) and np.isinf(v) else v) for k, v in d.items()}


def exact_match(response: Sequence[int], answer: Sequence[int]) -> bool:
  """The response (cut at its first stop token) equals the answer's token ids."""
  return [int(t) for t in response] == [int(t) for t in answer]


def check_disjoint(prompts: Sequence, eval_prompts: Sequence | None) -> None:
  """Raises ValueError if a calibration prompt is also an evaluation prompt."""
  if eval_prompts is None:
    return
  key = lambda p: p if isinstance(p, str) else tuple(int(t) for t in p)
  held = {key(p) for p in eval_prompts}
  shared = [i for i, p in enumerate(prompts) if key(p) in held]
  if shared:
    raise ValueError(
        f"{len(shared)} of {len(prompts)} calibration prompts are also evaluation prompts "
        f"(calibration rows {shared[:5]}{'...' if len(shared) > 5 else ''}); calibrate on a "
        "held-out split disjoint from the evaluation set, or the evaluation would measure "
        "thresholds fitted to it.")


def grid_points(grid: Mapping[str, Sequence]) -> list[dict]:
  """The Cartesian product of `grid` (names from adaptive.THRESHOLDS), in order."""
  unknown = sorted(set(grid) - set(adaptive.THRESHOLDS))
  if unknown:
    raise ValueError(f"grid names unknown thresholds {unknown}; use {adaptive.THRESHOLDS}.")
  for name, values in grid.items():
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
      raise ValueError(f"grid[{name!r}] must be a non-empty list of values, got {values!r}.")
  names = list(grid)
  return [dict(zip(names, values)) for values in itertools.product(*grid.values())]


def per_forward(committed: int, target_forwards: int, drafter_forwards: int,
                drafter_cost: float) -> float:
  return committed / max(target_forwards + drafter_cost * drafter_forwards, 1e-9)


def select(trials: Sequence[Trial], ar_accuracy: float, tolerance: float) -> Trial:
  """The most tokens per forward among trials within `tolerance` of AR's accuracy (the
  first in order on ties); ValueError if none is."""
  eligible = [t for t in trials if t.accuracy >= ar_accuracy - tolerance - 1e-12]
  if not eligible:
    best = max(t.accuracy for t in trials)
    raise ValueError(
        f"no threshold setting keeps accuracy within {tolerance} of AR's {ar_accuracy:.4f} "
        f"(best {best:.4f}); add a verify-only setting to the grid (parallel_confidence=inf, "
        "ar_confidence=0, trust_streak=0) or raise the tolerance.")
  return max(eligible, key=lambda t: t.tokens_per_forward)  # max keeps the first on ties


def choose_task_modes(ar_accuracy: Mapping[str, float],
                      trials: Mapping[str, Mapping[str, Sequence[float]]], *,
                      tolerance: float = 0.0,
                      modes: Sequence[str] = CALIBRATED_MODES) -> dict[str, str]:
  """Each task's mode: the fastest whose accuracy is within `tolerance` of AR's.

  Args:
    ar_accuracy: {task: AR's accuracy on that task's calibration prompts}.
    trials: {mode: {task: (accuracy, speed)}}, each mode forced on every prompt of the task
      (modes of `modes`: CALIBRATED_MODES, or with "auto", the rule's own choice, as the
      prompt router's, router.py); speed is any larger-is-faster figure (the study: measured
      response tokens/s at its batch size). Modes are tried in order: the first wins a tie.
    tolerance: accuracy (a fraction) a mode may lose against AR on the task.
  Returns {task: mode} for every task of `ar_accuracy`; ValueError if a task has no trial of
  some mode, or no mode within tolerance (impossible when "ar" is a mode: it is AR).
  """
  base.check_number("tolerance", tolerance, low=0.0, high=1.0)
  unknown = sorted(set(trials) - set(modes))
  if unknown or not trials:
    raise ValueError(f"trials must map modes of {list(modes)} to their figures, "
                     f"got {sorted(trials)}.")
  chosen = {}
  for task in sorted(ar_accuracy):
    missing = [m for m in trials if task not in trials[m]]
    if missing:
      raise ValueError(f"task {task!r} has no calibration figures for modes {missing}.")
    eligible = [(mode, float(trials[mode][task][1])) for mode in trials
                if float(trials[mode][task][0]) >= ar_accuracy[task] - tolerance - 1e-12]
    if not eligible:
      raise ValueError(f"no mode keeps task {task!r} within {tolerance} of AR's accuracy "
                       f"{ar_accuracy[task]:.4f}; include 'ar' (AR itself) among the modes.")
    # max keeps the first on ties; a speed that was not measured (nan) never wins
    chosen[task] = max(eligible, key=lambda e: -INF if np.isnan(e[1]) else e[1])[0]
  return chosen


@dataclasses.dataclass(frozen=True)
class TaskModesResult:
  """The chosen tag -> mode map, AR's accuracy per task and every (mode, task) trial."""
  task_modes: dict
  ar_accuracy: dict
  trials: dict  # {mode: {task: (accuracy, tokens per forward)}}
  tolerance: float
  drafter_cost: float

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2)


def calibrate_task_modes(decode: Callable, ar_decode: Callable, prompts: Sequence,
                         answers: Sequence, tasks: Sequence[str], *,
                         eval_prompts: Sequence | None, thresholds: Mapping | None = None,
                         tolerance: float = 0.0, drafter_cost: float = 1.0,
                         score: Callable = exact_match) -> TaskModesResult:
  """Fits the tag -> mode map on the calibration split (module docstring).

  Each task's prompts are decoded by AR and, for every mode of CALIBRATED_MODES, with every
  tag mapped to that mode (`decode(thresholds, prompts, tasks=, task_modes=)`, as
  `model_decoders` gives); a mode's speed is its tokens per forward (drafter forwards at
  `drafter_cost`), the figure `calibrate` ranks thresholds by. `thresholds` (the rule's) are
  passed through; forced rows do not read them.
  """
  if not (len(prompts) == len(answers) == len(tasks)) or not prompts:
    raise ValueError(f"need one answer and one task per calibration prompt and at least one "
                     f"prompt; got {len(prompts)} prompts, {len(answers)} answers and "
                     f"{len(tasks)} tasks.")
  base.check_number("drafter_cost", drafter_cost, low=0.0)
  check_disjoint(prompts, eval_prompts)
  names = sorted(set(tasks))
  thresholds = dict(thresholds or {})
  ar_accuracy, trials = {}, {m: {} for m in CALIBRATED_MODES}
  for task in names:
    rows = [i for i, t in enumerate(tasks) if t == task]
    p, a = [prompts[i] for i in rows], [answers[i] for i in rows]
    accuracy = lambda d: float(np.mean([bool(score(r, x)) for r, x in zip(d.responses, a)]))
    ar_accuracy[task] = accuracy(ar_decode(p))
    for mode in CALIBRATED_MODES:
      out = decode(thresholds, p, tasks=[task] * len(p),
                   task_modes={t: mode for t in names})
      trials[mode][task] = (accuracy(out), per_forward(out.committed, out.target_forwards,
                                                       out.drafter_forwards, drafter_cost))
  return TaskModesResult(choose_task_modes(ar_accuracy, trials, tolerance=tolerance),
                         ar_accuracy, trials, tolerance, drafter_cost)


def calibrate(decode: Callable, ar_decode: Callable, prompts: Sequence, answers: Sequence, *,
              eval_prompts: Sequence | None, grid: Mapping[str, Sequence] = DEFAULT_GRID,
              tolerance: float = 0.01, drafter_cost: float = 1.0,
              score: Callable = exact_match) -> CalibrationResult:
  """Sweeps `grid` on the calibration split and picks the thresholds (module docstring).

  Args:
    decode: (thresholds dict, prompts) -> Decoded, adaptive decoding (`model_decoders`).
    ar_decode: prompts -> Decoded, the AR reference.
    prompts, answers: the calibration split (N prompts and what each should produce).
    eval_prompts: the evaluation prompts, checked disjoint from `prompts` (required: pass
      None only when no evaluation set exists).
    grid: {threshold name: candidate values}.
    tolerance: accuracy (a fraction) a setting may lose against AR.
    drafter_cost: a drafter forward's cost in target forwards.
    score: (response ids, answer) -> bool.
  """
  if len(prompts) != len(answers) or not prompts:
    raise ValueError(f"need one answer per calibration prompt and at least one prompt; got "
                     f"{len(prompts)} prompts and {len(answers)} answers.")
  base.check_number("tolerance", tolerance, low=0.0, high=1.0)
  base.check_number("drafter_cost", drafter_cost, low=0.0)
  check_disjoint(prompts, eval_prompts)
  points = grid_points(grid)

  def accuracy(decoded: Decoded) -> float:
    return float(np.mean([bool(score(r, a)) for r, a in zip(decoded.responses, answers)]))

  ref = ar_decode(prompts)
  ar_accuracy = accuracy(ref)
  trials = []
  for thresholds in points:
    out = decode(thresholds, prompts)
    trials.append(Trial(
        thresholds=dict(thresholds), accuracy=accuracy(out),
        tokens_per_forward=per_forward(out.committed, out.target_forwards,
                                       out.drafter_forwards, drafter_cost),
        committed=out.committed, target_forwards=out.target_forwards,
        drafter_forwards=out.drafter_forwards))
  chosen = select(trials, ar_accuracy, tolerance)
  return CalibrationResult(
      options=dict(chosen.thresholds), chosen=chosen, ar_accuracy=ar_accuracy,
      ar_tokens_per_forward=per_forward(ref.committed, ref.target_forwards, 0, drafter_cost),
      tolerance=tolerance, drafter_cost=drafter_cost, trials=trials)


def model_decoders(target_params, target_cfg, drafter_params, drafter_cfg, *,
                   batch_size: int = 64, **options):
  """(decode, ar_decode) for `calibrate` from the trained models.

  Prompts are left padded to one length and decoded in batches of `batch_size` (the last
  batch padded by repeating its last prompt, dropped after), so the sweep compiles once.
  `options`: adaptive_generate's static options (gen_length, draft_length, draft_steps,
  task_modes; temperature etc.); `gen_length` is shared with the AR reference.
  """
  gen_length = options.get("gen_length", base.GEN_LENGTH)

  def batches(prompts, tasks=None):
    tokens, valid = base.pad_prompts([list(p) for p in prompts],
                                     base.output_pad_id(target_cfg))
    n = len(prompts)
    for start in range(0, n, batch_size):
      rows = np.arange(start, start + batch_size).clip(max=n - 1)
      row_tasks = None if tasks is None else [tasks[r] for r in rows]
      yield tokens[rows], valid[rows], min(batch_size, n - start), row_tasks

  def collect(outs):
    responses, committed, tf, df = [], 0, 0, 0
    for out, used, target_f, drafter_f in outs:
      toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
      responses += [toks[r, :lens[r]].tolist() for r in range(used)]
      committed += int(np.asarray(out.committed)[:used].sum())
      tf, df = tf + target_f, df + drafter_f
    return Decoded(responses, committed, tf, df)

  def decode(thresholds, prompts, tasks=None, task_modes=None):
    """`tasks`: one tag per prompt; `task_modes` replaces the options' tag map."""
    modes = {} if task_modes is None else {"task_modes": dict(task_modes)}
    def run(tokens, valid, used, row_tasks):
      out, st = adaptive.adaptive_generate(
          target_params, target_cfg, tokens, valid, drafter_params=drafter_params,
          drafter_cfg=drafter_cfg, return_stats=True, tasks=row_tasks,
          **{**options, **modes}, **thresholds)
      return out, used, int(st.target_forwards), int(st.drafter_forwards)
    return collect(run(*b) for b in batches(prompts, tasks))

  def ar_decode(prompts):
    def run(tokens, valid, used, _):
      out = ar.ar_generate(target_params, target_cfg, tokens, valid, gen_length=gen_length)
      return out, used, int(out.nfe), 0
    return collect(run(*b) for b in batches(prompts))

  return decode, ar_decode
