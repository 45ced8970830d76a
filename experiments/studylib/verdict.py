"""The verdict on the published claims, computed from the study's measured cells.

    v = judge(results, task="arithmetic", llada_label="llada steps=G", platform="cpu")
    print(verdict_text(v))
    assert recompute(json.loads(open("runs/study/study.json").read())) == v

Every claim in CLAIMS is judged on the batch-1 cells of its method against one baseline cell
(AR; vanilla LLaDA: steps = G over blocks of 32, low-confidence remasking; or, for
self-speculation, the same network's own AR decode), and nothing is filtered away:
every judged cell is stored with its figures. A claim judged on the headline task takes its
accuracy AND its speed from that task's prompts (each batch-1 prompt is timed on its own, so
`per_task_time` holds every task's own tokens, time, forwards and loop steps); a claim on the
mixed suite ("all tasks") uses every prompt. The lossless hybrid takes its accuracy from every
prompt (AR's answers exactly, everywhere) and its speed and tokens per verifier forward from
the headline task's (the claim is about long answers). A cell's speedup over its baseline splits into
measured factors,

    speedup = tokens_ratio * nfe_ratio / forward_cost_ratio,

tokens_ratio = response tokens per prompt over the baseline's, nfe_ratio = the baseline's
forwards per prompt over the cell's, forward_cost_ratio = the cell's wall time per forward over
the baseline's. The first two are the algorithm's (`speedup_at_equal_forward_cost`); the last
is the hardware's: where a batch-1 forward is bound by weight reads (an accelerator) it tends
to 1, on a CPU a wider forward costs more.

A D2F cell also carries its pipeline's ceiling: D2F appends at most one block of k slots per
forward, so it commits at most k response tokens a forward, and whatever its model,

    speedup_at_equal_forward_cost <= pipeline_ceiling = k * baseline forwards per prompt
                                                        / baseline response tokens per prompt.

Both figures are projections for a weight-bound accelerator; the status is judged on the
measured tokens/s (below), and the projection is printed beside it, named as one.

Status of a claim (one rule for every claim):
  met                  some cell meets the claim on its MEASURED figures: tokens/s over the
                       baseline's at or above the threshold, and accuracy within the
                       tolerance (the same number of correct answers for an exact claim),
                       judged on the point estimates; each figure's paired bootstrap 95%
                       interval over prompts (intervals.py) is printed beside it;
  not met              no cell does (or none is accurate enough); the equal-cost projection
                       (`projection`: what the fewer forwards alone would give where a
                       forward costs the baseline's, with the D2F pipeline's ceiling) is
                       printed beside the measurement as a projection, never in its place;
  not measurable here  only where the baseline answers (almost) nothing: its tolerance admits
                       a decoder answering nothing (vanilla LLaDA at 1 of 100 against "within
                       2 points"; an exact claim against a baseline with no correct answer),
                       so a "met" would be speed alone;
  not measured         the run has no cell of the method (or of its baseline).
The adaptive claim's premise (D2F alone loses more than 5 points on the suite) is measured
and named in its reason; it does not change the status.

Every claim against AR is also set against an *accelerated AR* where the study names one
(`accelerated_ar_label`: speculative AR decoding with a small AR drafter): each of its cells
carries its figures against that cell too (`vs_accelerated_ar`), for the reader only; the
status is judged against plain AR. The lossless-hybrid claim is about a diffusion drafter, so
it judges no speculative cell with an AR drafter (`setting["drafter"] == "ar"`), and no claim
judges the accelerated AR cell itself.

Schema (study.json "verdict"): {task, ar, llada_vanilla, accelerated_ar (its label as
configured, or null), platform, batch_size: 1, claims: [
  {id, text, method, baseline (label), threshold {speedup, speedup_strict,
   accuracy_tolerance_points, exact_accuracy[, tokens_per_verifier_forward]
   [, premise_d2f_loss_points]}, published, accuracy_on (task or "all tasks"), speed_on
   (likewise; absent from documents written before it), gen_length (the
   baseline's G), baseline_setting, cells [per judged cell: label, method, speedup,
   speedup_median, accuracy, accuracy_delta_points, num_correct, tokens_ratio, nfe_ratio,
   forward_cost_ratio, speedup_at_equal_forward_cost, nfe_per_prompt, speed_on (the task
   whose prompts the speed is measured on, or "all tasks")
   [, block_length, pipeline_ceiling: D2F cells whose setting names block_length]
   [, tokens_per_verifier_forward, draft_length]
   [, vs_accelerated_ar {baseline (the accelerated AR's label), speedup, speedup_median,
     accuracy_delta_points, nfe_ratio, forward_cost_ratio, tokens_ratio,
     speedup_at_equal_forward_cost}: only in a claim against AR, and only where the
     accelerated AR's batch-1 cell exists]], figure (one of cells or null), premise
   (adaptive: {best_d2f_label, best_d2f_accuracy_delta_points}, else null), projection
   ({label, speedup_at_equal_forward_cost, nfe_ratio, forward_cost_ratio,
   one_forward_ceiling, pipeline_ceiling, pipeline_block_length, reaches_threshold,
   baseline, gen_length} or null), status, reason, deciding_factor {name, value} or null
   [, oracle: the method's cells given the generator's task names (setting task_tags), with
   compare's figures: shown as an upper bound, never judged]}]}. Every judged cell also carries speedup_ci95 and accuracy_delta_ci95 ([lo, hi], paired
   bootstrap 95% intervals over prompts; null where the cells stored no per-prompt results).
   Ratios that cannot be formed are null.

The verdict reads only the stored cells (`results`), the config's headline task, vanilla
LLaDA label and accelerated AR label (`eval.accelerated_ar_label`, optional), and the machine's
platform, so `recompute(study_json)` rebuilds it exactly: a verdict written by hand would not
survive that check.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from studylib import intervals as intervals_lib
from studylib.accounting import MethodResult
from studylib.claims import CLAIMS, Claim  # noqa: F401  (re-exported: verdict.CLAIMS)
from studylib.verdict_report import fmt as _fmt, fmt_ratio as _x
from studylib.verdict_report import projection_text, verdict_text  # noqa: F401  (re-exported)

MET, NOT_MET, NOT_MEASURABLE, NOT_MEASURED = ("met", "not met", "not measurable here",
                                              "not measured")
STATUSES = (MET, NOT_MET, NOT_MEASURABLE, NOT_MEASURED)


def _ratio(a, b):
  return a / b if a is not None and b else None


def _counts(r: MethodResult, task: str | None) -> tuple[int, int]:
  """(correct, prompts) on `task` (None: every prompt)."""
  if task is None:
    return r.num_correct, r.num_prompts
  correct, total = r.per_task.get(task, (0, 0))
  return int(correct), int(total)


def _delta_points(r: MethodResult, base: MethodResult, task: str | None) -> float | None:
  """100 * (accuracy of r - accuracy of base), from integer counts: one rounding, so a cell
  exactly at a whole-point tolerance (e.g. 88/100 against 90/100) is not lost to float error."""
  (c, n), (cb, nb) = _counts(r, task), _counts(base, task)
  if not n or not nb:
    return None
  return 100.0 * (c * nb - cb * n) / (n * nb)


@dataclasses.dataclass(frozen=True)
class _Speed:
  """What a cell's speed is judged on: all its prompts, or one task's prompts."""
  tokens: int
  prompts: int
  wall_s: float
  wall_median_s: float
  nfe_per_prompt: float | None
  scope: str  # the task, or "all tasks"
  loop_steps: int | None = None  # decode-loop steps (a speculative round: one verifier forward)

  @property
  def tokens_per_s(self):
    return _ratio(self.tokens, self.wall_s)

  @property
  def tokens_per_s_median(self):
    return _ratio(self.tokens, self.wall_median_s)

  @property
  def latency_per_prompt_s(self):
    return _ratio(self.wall_s, self.prompts)


def speed_on(r: MethodResult, task: str | None) -> _Speed:
  """The cell's speed on `task`'s prompts, where they were all timed in single-task batches
  (`per_task_time`: always at batch 1), else on every prompt (task None, or no such timing)."""
  timed = r.per_task_time.get(task) if task is not None else None
  if timed and len(timed) >= 5 and timed[4] == _counts(r, task)[1] and timed[1] > 0:
    tokens, wall, nfe, median, prompts = timed[:5]
    steps = int(timed[5]) if len(timed) > 5 else None
    return _Speed(int(tokens), int(prompts), float(wall), float(median),
                  _ratio(nfe * r.batch_size, prompts), task, steps)
  return _Speed(r.response_tokens, r.num_prompts, r.wall_s, r.wall_median_s,
                r.nfe_per_prompt, "all tasks", r.loop_steps)


def compare(r: MethodResult, base: MethodResult, task: str | None,
            speed_task: str | None) -> dict:
  """The figures of cell `r` against `base`: speedup, its split, accuracy delta (points).
  Accuracy is measured on `task`'s prompts and speed on `speed_task`'s (`speed_on`); None
  is every prompt."""
  correct, total = _counts(r, task)
  sr, sb = speed_on(r, speed_task), speed_on(base, speed_task)
  scope = sr.scope if sr.scope == sb.scope else None  # None: the two timed differently
  ci = intervals_lib.versus(r, base, task, None if scope == "all tasks" else scope)
  if scope is None:
    ci["speedup_ci95"] = None
  tokens_ratio = _ratio(_ratio(sr.tokens, sr.prompts), _ratio(sb.tokens, sb.prompts))
  nfe_ratio = _ratio(sb.nfe_per_prompt, sr.nfe_per_prompt)
  cost = _ratio(_ratio(sr.latency_per_prompt_s, sr.nfe_per_prompt),
                _ratio(sb.latency_per_prompt_s, sb.nfe_per_prompt))
  algorithmic = (tokens_ratio * nfe_ratio if tokens_ratio is not None and nfe_ratio is not None
                 else None)
  out = {"label": r.label, "method": r.method,
         "speedup": _ratio(sr.tokens_per_s, sb.tokens_per_s),
         "speedup_median": _ratio(sr.tokens_per_s_median, sb.tokens_per_s_median),
         "accuracy": correct / total if total else None,
         "accuracy_delta_points": _delta_points(r, base, task),
         "num_correct": r.num_correct, "tokens_ratio": tokens_ratio, "nfe_ratio": nfe_ratio,
         "forward_cost_ratio": cost, "speedup_at_equal_forward_cost": algorithmic,
         "nfe_per_prompt": sr.nfe_per_prompt,
         "speed_on": sr.scope if sr.scope == sb.scope else "mixed", **ci}
  k = r.setting.get("block_length") if r.method == "d2f" else None
  if k:  # D2F appends one block of k per forward: it commits at most k tokens a forward
    out["block_length"] = k
    out["pipeline_ceiling"] = _ratio(
        None if sb.nfe_per_prompt is None else k * sb.nfe_per_prompt,
        _ratio(sb.tokens, sb.prompts))
  if r.method in ("speculative", "selfspec"):  # one verifier forward a round (.steps)
    out["tokens_per_verifier_forward"] = _ratio(
        sr.tokens, None if sr.loop_steps is None else sr.loop_steps * r.batch_size)
    out["draft_length"] = r.setting.get("draft_length")
  return out


# The figures of a cell against the accelerated AR (`vs_accelerated_ar`), after its label.
VS_ACCELERATED_AR = ("speedup", "speedup_median", "accuracy_delta_points", "nfe_ratio",
                     "forward_cost_ratio", "tokens_ratio", "speedup_at_equal_forward_cost",
                     "speedup_ci95", "accuracy_delta_ci95")


def versus_accelerated_ar(r: MethodResult, accelerated: MethodResult, task: str | None,
                          speed_task: str | None) -> dict:
  """Cell `r`'s speed and accuracy figures against the accelerated AR cell (`compare`)."""
  full = compare(r, accelerated, task, speed_task)
  return {"baseline": accelerated.label, **{k: full[k] for k in VS_ACCELERATED_AR}}


def _fast_enough(claim: Claim, speedup) -> bool:
  if speedup is None:
    return False
  return speedup > claim.speedup if claim.strict_speedup else speedup >= claim.speedup


def _accurate(claim: Claim, c: dict, base: MethodResult) -> bool:
  if claim.exact:
    return c["num_correct"] == base.num_correct
  delta = c["accuracy_delta_points"]
  return delta is not None and delta >= -claim.tolerance_points


def _vacuous_accuracy(claim: Claim, base: MethodResult, task: str | None) -> float | None:
  """The baseline's accuracy in points where the claim's accuracy bar would pass a decoder
  with no correct answer (exact: the baseline has none; else at most `tolerance_points`),
  else None."""
  correct, total = _counts(base, task)
  if not total:
    return None
  points = 100.0 * correct / total
  if (correct == 0) if claim.exact else (100 * correct <= claim.tolerance_points * total):
    return points
  return None


def _meets(claim: Claim, c: dict) -> bool:
  if not _fast_enough(claim, c["speedup"]):
    return False
  bar = claim.tokens_per_verifier_forward
  return bar is None or (c.get("tokens_per_verifier_forward") or 0.0) >= bar


def _delta(c: dict) -> float:
  """Sort key: the accuracy delta, a cell without one last."""
  d = c["accuracy_delta_points"]
  return -1e9 if d is None else d


def _judge_claim(claim: Claim, cells: Sequence[MethodResult], base: MethodResult | None,
                 base_label: str, d2f: Sequence[MethodResult], *, task: str,
                 accelerated: MethodResult | None = None) -> dict:
  """One claim's entry (module docstring); `accelerated`: the accelerated AR cell every
  judged cell is also set against (figures only: the status is judged against `base`)."""
  accuracy_task = task if claim.accuracy_on == "task" else None
  speed_task = task if (claim.speed_on or claim.accuracy_on) == "task" else None
  entry = {"id": claim.id, "text": claim.text, "method": claim.method,
           "baseline": base_label, "threshold": claim.threshold(),
           "published": claim.published,
           "accuracy_on": task if accuracy_task else "all tasks",
           "speed_on": task if speed_task else "all tasks",
           "gen_length": None if base is None else base.setting.get("gen_length"),
           "baseline_setting": None if base is None else dict(base.setting),
           "cells": [], "figure": None, "premise": None, "projection": None,
           "status": NOT_MEASURED,
           "reason": "", "deciding_factor": None}

  def done(status, reason, factor=None, value=None):
    entry.update(status=status, reason=reason,
                 deciding_factor=None if factor is None else {"name": factor, "value": value})
    return entry

  if not cells:
    return done(NOT_MEASURED, f"no {claim.method} cell at batch 1 in this run")
  if base is None:
    return done(NOT_MEASURED, f"no baseline cell {base_label!r} at batch 1 in this run")
  rows = [compare(r, base, accuracy_task, speed_task) for r in cells]
  if accelerated is not None:
    for r, row in zip(cells, rows):
      row["vs_accelerated_ar"] = versus_accelerated_ar(r, accelerated, accuracy_task,
                                                       speed_task)
  entry["cells"] = rows
  accurate = [c for c in rows if _accurate(claim, c, base)]
  speed = lambda c: -1.0 if c["speedup"] is None else c["speedup"]  # noqa: E731
  if accurate:
    entry["figure"] = max(accurate, key=speed)
  else:  # the closest miss: the most accurate cell, then the fastest
    entry["figure"] = max(rows, key=lambda c: (c["num_correct"] if claim.exact else
                                               _delta(c), speed(c)))
  fig = entry["figure"]
  met = [c for c in accurate if _meets(claim, c)]

  vacuous = _vacuous_accuracy(claim, base, accuracy_task)
  if vacuous is not None:
    correct, total = _counts(base, accuracy_task)
    bar = ("the same number of correct answers" if claim.exact
           else f"within {claim.tolerance_points:g} points")
    fast = sum(_meets(claim, c) for c in rows)
    return done(NOT_MEASURABLE, f"{base_label} answers {correct} of {total} prompts "
                f"correctly ({vacuous:.1f}%), so {bar} admits a decoder that answers none: the "
                "accuracy half of the claim cannot tell a decoder that keeps the baseline's "
                f"quality from one that has none on these models ({fast} of {len(rows)} "
                f"{claim.method} cells reach the speed alone)", "baseline_accuracy_points",
                vacuous)

  entry["projection"] = _projection(claim, rows, accurate, base, base_label, speed_task,
                                    entry["gen_length"])
  if claim.premise_d2f_loss_points is not None and d2f:  # the suite must make D2F fail
    best = max((compare(r, base, accuracy_task, accuracy_task) for r in d2f),
               key=lambda c: (_delta(c), speed(c)))
    entry["premise"] = {"best_d2f_label": best["label"],
                        "best_d2f_accuracy_delta_points": best["accuracy_delta_points"]}
  premise = _premise_text(claim, entry["premise"])

  if met:
    fig = entry["figure"] = max(met, key=speed)
    return done(MET, f"{len(met)} of {len(rows)} {claim.method} cells meet it; the figure is "
                f"the fastest{premise}", "speedup", fig["speedup"])
  if not accurate:
    what = (f"has {base_label}'s number of correct answers ({base.num_correct})"
            if claim.exact else f"is within {claim.tolerance_points:g} points of {base_label}")
    return done(NOT_MET, f"no {claim.method} cell {what}; closest: {fig['label']} at "
                f"{_fmt(fig['accuracy_delta_points'], '+.1f')} points{premise}",
                "accuracy_delta_points", fig["accuracy_delta_points"])
  bar = claim.tokens_per_verifier_forward
  fast = [c for c in accurate if _fast_enough(claim, c["speedup"])]
  if bar is not None and fast:  # fast enough, but too few tokens per verifier forward
    fig = entry["figure"] = max(fast, key=lambda c: c.get("tokens_per_verifier_forward") or 0)
    return done(NOT_MET, f"best cell at {base_label}'s accuracy and speed, {fig['label']}: "
                f"{_fmt(fig.get('tokens_per_verifier_forward'))} tokens per verifier forward, "
                f"below {bar:g}{premise}", "tokens_per_verifier_forward",
                fig.get("tokens_per_verifier_forward"))
  extra = ""
  if bar is not None:
    extra = f", {_fmt(fig.get('tokens_per_verifier_forward'))} tokens per verifier forward"
  return done(NOT_MET, f"best cell within tolerance, {fig['label']}: measured "
              f"{_x(fig['speedup'])} {base_label} tokens/s{extra}, below "
              f"{claim.speedup:g}x{premise}", "speedup", fig["speedup"])


def _premise_text(claim: Claim, premise: dict | None) -> str:
  """`; premise: ...`: whether D2F alone loses more than the claim's premise (adaptive)."""
  if claim.premise_d2f_loss_points is None:
    return ""
  if premise is None:
    return "; premise unmeasured (no d2f cell at batch 1)"
  loss = premise["best_d2f_accuracy_delta_points"]
  holds = loss is not None and -loss > claim.premise_d2f_loss_points
  return (f"; premise: D2F alone loses {_fmt(None if loss is None else -loss, '.1f')} points "
          f"at best ({premise['best_d2f_label']}), "
          + (f"> {claim.premise_d2f_loss_points:g}: switching has something to rescue" if holds
             else f"not > {claim.premise_d2f_loss_points:g}: on this suite D2F alone would do"))


def _projection(claim: Claim, rows: Sequence[dict], accurate: Sequence[dict],
                base: MethodResult, base_label: str, speed_task: str | None,
                gen_length) -> dict:
  """What the claim would read at equal cost per forward (a weight-bound accelerator), as a
  projection beside the measurement, never in its place: the accurate cell with the highest
  `speedup_at_equal_forward_cost` (the most accurate cell when none is accurate), the
  one-forward ceiling (the baseline's forwards per prompt: a decoder writing its tokens in
  one forward) and, for D2F, the widest block's pipeline ceiling."""
  pool = list(accurate) or [max(rows, key=_delta)]
  best = max(pool, key=lambda c: c["speedup_at_equal_forward_cost"] or 0.0)
  pipeline = _pipeline_ceiling(rows)
  return {"label": best["label"],
          "speedup_at_equal_forward_cost": best["speedup_at_equal_forward_cost"],
          "nfe_ratio": best["nfe_ratio"], "forward_cost_ratio": best["forward_cost_ratio"],
          "one_forward_ceiling": speed_on(base, speed_task).nfe_per_prompt,
          "pipeline_ceiling": None if pipeline is None else pipeline["pipeline_ceiling"],
          "pipeline_block_length": None if pipeline is None else pipeline["block_length"],
          "reaches_threshold": _fast_enough(claim, best["speedup_at_equal_forward_cost"]),
          "baseline": base_label, "gen_length": gen_length}


def _pipeline_ceiling(rows: Sequence[dict]) -> dict | None:
  """The judged cell with the highest `pipeline_ceiling` (the widest D2F block), or None
  unless every judged cell has one (a cell without it is not bounded by it)."""
  if not rows or any(c.get("pipeline_ceiling") is None for c in rows):
    return None
  return max(rows, key=lambda c: c["pipeline_ceiling"])


def _judged(claim: Claim, r: MethodResult, accelerated_ar_label: str | None) -> bool:
  """Whether cell `r` is one of the claim's: its method, not the accelerated AR baseline,
  not a drafter the claim excludes, and no oracle (a cell given the generator's task names,
  `setting["task_tags"]`, which no user has: its figures are an upper bound, `oracle`)."""
  return (r.method == claim.method and r.label != accelerated_ar_label
          and r.setting.get("drafter") not in claim.exclude_drafters
          and not r.setting.get("task_tags"))


SELFSPEC_AR_LABEL = "ar (selfspec model)"  # the self-speculative model's own AR decode


def judge(results: Sequence[MethodResult], *, task: str, llada_label: str,
          ar_label: str = "ar", platform: str = "cpu", claims=CLAIMS,
          accelerated_ar_label: str | None = None,
          selfspec_ar_label: str = SELFSPEC_AR_LABEL) -> dict:
  """Judges every claim on the batch-1 cells of `results` (see the module docstring).

  accelerated_ar_label: the accelerated AR cell (e.g. "speculative ar k=4"); where its
  batch-1 cell exists, every cell of a claim against AR also gets `vs_accelerated_ar`.
  """
  at1 = [r for r in results if r.batch_size == 1]
  by_label = {r.label: r for r in at1}
  labels = {"ar": ar_label, "llada": llada_label, "selfspec_ar": selfspec_ar_label}
  accelerated = by_label.get(accelerated_ar_label)
  d2f = [r for r in at1 if r.method == "d2f"]
  out = []
  for claim in claims:
    base_label = labels[claim.baseline]
    cells = [r for r in at1 if _judged(claim, r, accelerated_ar_label)]
    entry = _judge_claim(claim, cells, by_label.get(base_label), base_label, d2f,
                         task=task,
                         accelerated=accelerated if claim.baseline == "ar" else None)
    oracle = [r for r in at1 if r.method == claim.method and r.setting.get("task_tags")]
    if oracle and by_label.get(base_label) is not None:  # shown, never judged
      entry["oracle"] = [compare(r, by_label[base_label],
                                 task if claim.accuracy_on == "task" else None,
                                 task if (claim.speed_on or claim.accuracy_on) == "task"
                                 else None) for r in oracle]
    out.append(entry)
  return {"task": task, "ar": ar_label, "llada_vanilla": llada_label,
          "accelerated_ar": accelerated_ar_label, "platform": platform, "batch_size": 1,
          "claims": out}


def recompute(doc: dict) -> dict:
  """The verdict of a study JSON document, from its stored cells, config and machine."""
  results = [MethodResult.from_json(row) for row in doc["results"]]
  ev = doc["config"]["eval"]
  return judge(results, task=ev["headline_task"], llada_label=ev["llada_vanilla_label"],
               platform=doc["machine"]["platform"],
               accelerated_ar_label=ev.get("accelerated_ar_label"))


def check_recomputes(doc: dict) -> None:
  """Raises ValueError unless `doc["verdict"]`, after a JSON round trip, is exactly the
  verdict its stored cells give (what a reader of study.json can check)."""
  stored = json.loads(json.dumps(doc))
  if recompute(stored) != stored.get("verdict"):
    raise ValueError("the study JSON's verdict is not the one its stored cells give; "
                     "rebuild it with verdict.recompute(doc).")
