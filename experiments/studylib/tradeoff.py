"""The trade-off mode's summary: accuracy against forwards and tokens/s, one curve per decoder
x schedule, with AUP, the best schedule at each forward budget, and the training schedules.

    summary = summarize(results, config=doc["config"], training=doc["training"])
    print(summary_text(summary)); plot(summary, "runs/study/tradeoff.png")

Every cell of the mode's grid carries `curve` (decoder x schedule, e.g. "llada cosine") and
`knob` (the option swept along it: steps, entropy_bound, a threshold) in its setting. From the
measured cells alone this module computes, per curve:
  * each point's accuracy, forwards per prompt (NFE), tokens per forward (TPF: response
    tokens per forward per row) and tokens/s, as a multiple of AR's and of the accelerated
    AR's (speculative AR with a narrow AR drafter) on the same prompts;
  * AUP, accuracy under parallelism (d3LLM, Qian et al. 2026), over the curve's (TPF,
    accuracy) points: sorted by TPF, points more than `AUP_OFFSET` points below the first
    (lowest-TPF) point's accuracy y_1 are dropped, and
        AUP = rho_1 y_1 + sum_i (rho_i - rho_{i-1}) (W(y_i) y_i + W(y_{i-1}) y_{i-1}) / 2,
        W(y) = min(exp(-alpha (1 - y / y_max)), 1),  alpha = AUP_ALPHA,
    accuracy in percent, y_max the most accurate cell of the run (AR's, usually). A curve
    that keeps its accuracy while its TPF grows scores high; one that buys TPF with accuracy
    is penalised by W. Hardware-free, like TPF.
  * each point's bootstrap 95% interval over prompts (accuracy, tokens/s and its ratio to
    AR's: intervals.py), and for each step-counted curve its *bend*: the accuracy at its
    fewest forwards against its most, the drop with its paired interval (a curve bends when
    fewer steps cost at least BEND_POINTS points);
and, per decoder family (LLaDA, block diffusion) and over both, the most accurate cell within
each forward budget (forwards per prompt <= budget): which schedule wins at that budget.
The training-schedule rows put each MDM's training wall time and masked-token eval accuracy
(from its training run; measured at that schedule's own masking rate, so it does not compare
across schedules) beside its decode accuracy at every step count, which does.

`summarize` reads only the stored cells, the config and the training records, so
`check_recomputes(doc)` can rebuild the stored summary exactly from tradeoff.json.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from dllm_jax.decoding.unmasking import SCHEDULES
from studylib import intervals as intervals_lib
from studylib.accounting import MethodResult

AUP_ALPHA = 3.0   # the quality penalty's rate (d3LLM's default)
AUP_OFFSET = 5.0  # points below the first point's accuracy that a curve may fall and count
FAMILIES = ("llada", "block diffusion")  # the decoders compared across unmasking schedules
STEP_KNOBS = ("steps", "steps_per_block")  # the curves whose bend (fewest vs most) is shown
BEND_POINTS = 10.0  # a curve bends when its fewest forwards lose at least this many points


def aup(points: Sequence[tuple[float, float]], y_max: float, *, alpha: float = AUP_ALPHA,
        offset: float = AUP_OFFSET) -> float:
  """Accuracy under parallelism of (tokens per forward, accuracy in percent) points (module
  docstring). ValueError for no points, a non-positive TPF or y_max."""
  if not points:
    raise ValueError("aup needs at least one (tokens per forward, accuracy) point.")
  if not y_max > 0 or any(not rho > 0 for rho, _ in points):
    raise ValueError(f"aup needs positive tokens per forward and y_max, got {list(points)} "
                     f"and y_max={y_max}.")
  ordered = sorted(points)
  floor = ordered[0][1] - offset
  kept = [(rho, y) for rho, y in ordered if y >= floor]
  weight = lambda y: min(math.exp(-alpha * (1.0 - y / y_max)), 1.0)  # noqa: E731
  total = kept[0][0] * kept[0][1]
  for (rho0, y0), (rho1, y1) in zip(kept, kept[1:]):
    total += 0.5 * (rho1 - rho0) * (weight(y1) * y1 + weight(y0) * y0)
  return total


def split_curve(curve: str) -> tuple[str, str | None]:
  """("llada", "cosine") from "llada cosine"; (curve, None) when it names no schedule."""
  family, _, last = curve.rpartition(" ")
  return (family, last) if family and last in SCHEDULES else (curve, None)


def _ratio(a: float, b: float | None) -> float | None:
  return a / b if b else None


def _point(r: MethodResult, ar: MethodResult | None, fast_ar: MethodResult | None) -> dict:
  knob = r.setting.get("knob")
  own = intervals_lib.own(r)
  return {"label": r.label, "knob_value": r.setting.get(knob) if knob else None,
          "accuracy": r.accuracy, "accuracy_ci95": own["accuracy_ci95"],
          "num_correct": r.num_correct,
          "nfe_per_prompt": r.nfe_per_prompt, "tokens_per_forward": r.tokens_per_forward,
          "tokens_per_s": r.tokens_per_s, "tokens_per_s_ci95": own["tokens_per_s_ci95"],
          "speedup_vs_ar": _ratio(r.tokens_per_s, ar.tokens_per_s if ar else None),
          "speedup_vs_ar_ci95": (None if ar is None else
                                 intervals_lib.versus(r, ar, None, None)["speedup_ci95"]),
          "speedup_vs_accelerated_ar": _ratio(r.tokens_per_s,
                                              fast_ar.tokens_per_s if fast_ar else None)}


def bend(curve: str, members: Sequence[MethodResult]) -> dict | None:
  """Whether a step-counted curve bends: its accuracy at the fewest forwards per prompt
  against its accuracy at the most, in points, with the paired 95% interval of that drop over
  the same prompts; `bends` when the drop is at least BEND_POINTS. None for a curve of one
  point."""
  if len(members) < 2:
    return None
  few = min(members, key=lambda r: (r.nfe_per_prompt, r.label))
  most = max(members, key=lambda r: (r.nfe_per_prompt, r.label))
  drop = 100.0 * (most.accuracy - few.accuracy)
  ci = intervals_lib.versus(few, most, None, None)["accuracy_delta_ci95"]
  return {"curve": curve, "most_forwards": most.label, "fewest_forwards": few.label,
          "most_forwards_accuracy": most.accuracy, "fewest_forwards_accuracy": few.accuracy,
          "drop_points": drop, "drop_ci95": None if ci is None else [-ci[1], -ci[0]],
          "bends": drop >= BEND_POINTS}


def best_by_budget(curves: Sequence[dict], budgets: Sequence[float]) -> list[dict]:
  """For each budget, the most accurate point of `curves` using at most that many forwards
  per prompt (ties: fewer forwards, then the curve listed first), or None where none fits;
  `tied` names every curve with a point as accurate within the budget (the schedules that
  do equally well there), the best's first."""
  out = []
  for budget in budgets:
    fits = [(c["curve"], p) for c in curves for p in c["points"]
            if p["nfe_per_prompt"] <= budget + 1e-9]
    best = max(fits, key=lambda cp: (cp[1]["num_correct"], -cp[1]["nfe_per_prompt"]),
               default=None)
    tied = [] if best is None else list(dict.fromkeys(
        [best[0]] + [curve for curve, p in fits
                     if p["num_correct"] == best[1]["num_correct"]]))
    out.append({"budget": budget,
                "best": None if best is None else {
                    "curve": best[0], "schedule": split_curve(best[0])[1],
                    "label": best[1]["label"], "accuracy": best[1]["accuracy"],
                    "nfe_per_prompt": best[1]["nfe_per_prompt"], "tied": tied}})
  return out


def summarize(results: Sequence[MethodResult], *, config: dict, training: dict) -> dict:
  """The mode's summary from its cells (batch size config eval.batch_sizes[0]), its config
  (a dict: eval labels, the tradeoff grid) and `training` ({model name: train record})."""
  batch = int(config["eval"]["batch_sizes"][0])
  cells = [r for r in results if r.batch_size == batch and "curve" in r.setting]
  by_label = {r.label: r for r in cells}
  ar = by_label.get("ar")
  fast_ar = by_label.get(config["eval"].get("accelerated_ar_label"))
  y_max = 100.0 * max((r.accuracy for r in cells), default=0.0)
  curves = []
  for name in dict.fromkeys(r.setting["curve"] for r in cells):
    members = sorted((r for r in cells if r.setting["curve"] == name),
                     key=lambda r: (r.nfe_per_prompt, r.label))
    points = [_point(r, ar, fast_ar) for r in members]
    tpf = [(p["tokens_per_forward"], 100.0 * p["accuracy"]) for p in points
           if p["tokens_per_forward"] > 0]
    family, schedule = split_curve(name)
    curves.append({"curve": name, "family": family, "schedule": schedule,
                   "method": members[0].method, "model": members[0].setting.get("model"),
                   "knob": members[0].setting.get("knob"), "points": points,
                   "aup": aup(tpf, y_max) if tpf and y_max > 0 else None,
                   "bend": (bend(name, members) if members[0].setting.get("knob") in STEP_KNOBS
                            else None)})
  t = config["tradeoff"]
  g = max((int(r.setting.get("gen_length", 0)) for r in cells), default=0)
  budgets = sorted({g // d for d in t["steps_divisors"] if g and g % d == 0})
  default_model = [c for c in curves if c["family"] in FAMILIES]
  best = {family: best_by_budget([c for c in default_model if c["family"] == family], budgets)
          for family in FAMILIES}
  best["all"] = best_by_budget(default_model, budgets)
  schedules = []
  for schedule in t["train_schedules"]:
    name = f"mdm_{schedule}"
    curve = next((c for c in curves if c["model"] == name), None)
    record = training.get(name) or {}
    final = record.get("final", {})
    schedules.append({
        "schedule": schedule, "model": name, "train_seconds": record.get("seconds"),
        "train_steps": record.get("steps"),
        "masked_token_accuracy": final.get("eval/accuracy"),
        "masked_fraction": final.get("eval/masked_frac"),
        "accuracy_by_steps": {} if curve is None else {
            str(p["knob_value"]): p["accuracy"] for p in curve["points"]},
        "aup": None if curve is None else curve["aup"]})
  return {"batch_size": batch, "y_max_points": y_max, "alpha": AUP_ALPHA,
          "offset_points": AUP_OFFSET, "budgets": budgets,
          "reference": {"ar": None if ar is None else _point(ar, ar, fast_ar),
                        "accelerated_ar": None if fast_ar is None else
                        _point(fast_ar, ar, fast_ar)},
          "curves": curves, "best_by_budget": best, "training_schedules": schedules}


def recompute(doc: dict) -> dict:
  """The summary of a tradeoff.json document, from its stored cells, config and training."""
  results = [MethodResult.from_json(row) for row in doc["results"]]
  return summarize(results, config=doc["config"], training=doc.get("training", {}))


def check_recomputes(doc: dict) -> None:
  """ValueError unless doc["tradeoff"], after a JSON round trip, is what its cells give."""
  stored = json.loads(json.dumps(doc))
  if recompute(stored) != stored.get("tradeoff"):
    raise ValueError("the tradeoff JSON's summary is not the one its stored cells give; "
                     "rebuild it with tradeoff.recompute(doc).")


def _f(x, spec: str) -> str:
  return "n/a" if x is None else format(x, spec)


def _pct(x):
  return None if x is None else 100 * x


def summary_text(s: dict) -> str:
  """Markdown: every curve's points, the AUP per curve, the best schedule per budget and the
  training schedules."""
  lines = [f"Trade-off curves at batch {s['batch_size']} (x AR and x spec AR: tokens/s "
           "against plain AR and against speculative AR with the narrow AR drafter; accuracy "
           "with its bootstrap 95% interval over prompts).", "",
           "| curve | cell | accuracy [95% CI] | NFE/prompt | tokens/forward | tokens/s | x AR "
           "| x spec AR |", "|" + "---|" * 8]
  refs = [("reference", s["reference"][k]) for k in ("ar", "accelerated_ar") if
          s["reference"][k]]
  rows = refs + [(c["curve"], p) for c in s["curves"] for p in c["points"]
                 if c["curve"] not in ("ar", "speculative ar")]
  for curve, p in rows:
    acc = p.get("accuracy_ci95")
    ci = "" if acc is None else f" [{100 * acc[0]:.1f}, {100 * acc[1]:.1f}]"
    lines.append(f"| {curve} | {p['label']} | {100 * p['accuracy']:.1f}%{ci} | "
                 f"{p['nfe_per_prompt']:.2f} | {p['tokens_per_forward']:.2f} | "
                 f"{p['tokens_per_s']:.1f} | {_f(p['speedup_vs_ar'], '.2f')}x | "
                 f"{_f(p['speedup_vs_accelerated_ar'], '.2f')}x |")
  lines += ["", f"AUP (accuracy under parallelism over tokens/forward; y_max = "
            f"{s['y_max_points']:.1f}%, alpha {s['alpha']:g}, points > {s['offset_points']:g} "
            "below the curve's first dropped), best tokens/s against AR:", "",
            "| curve | AUP | max tokens/forward | best x AR | best x spec AR |", "|---|---|---|---|---|"]
  for c in s["curves"]:
    best = lambda key: max((p[key] for p in c["points"] if p[key] is not None),  # noqa: E731
                           default=None)
    lines.append(f"| {c['curve']} | {_f(c['aup'], '.1f')} | "
                 f"{max(p['tokens_per_forward'] for p in c['points']):.2f} | "
                 f"{_f(best('speedup_vs_ar'), '.2f')}x | "
                 f"{_f(best('speedup_vs_accelerated_ar'), '.2f')}x |")
  bends = [c["bend"] for c in s["curves"] if c.get("bend")]
  if bends:
    lines += ["", f"Does each step-counted curve bend? Accuracy at its fewest forwards against "
              f"its most, the drop with its paired 95% interval (bends: >= {BEND_POINTS:g} "
              "points):", "", "| curve | most forwards | fewest forwards | drop (points) "
              "[95% CI] | bends |", "|---|---|---|---|---|"]
    for b in bends:
      ci = "" if b["drop_ci95"] is None else (f" [{b['drop_ci95'][0]:+.1f}, "
                                              f"{b['drop_ci95'][1]:+.1f}]")
      lines.append(f"| {b['curve']} | {b['most_forwards']}: "
                   f"{100 * b['most_forwards_accuracy']:.1f}% | {b['fewest_forwards']}: "
                   f"{100 * b['fewest_forwards_accuracy']:.1f}% | {b['drop_points']:+.1f}{ci} | "
                   f"{'yes' if b['bends'] else 'no'} |")
  families = list(s["best_by_budget"])
  lines += ["", "Most accurate cell within each budget of forwards per prompt (its schedule):",
            "", "| budget | " + " | ".join(families) + " |", "|---|" + "---|" * len(families)]
  for i, budget in enumerate(s["budgets"]):
    row = []
    for family in families:
      b = s["best_by_budget"][family][i]["best"]
      # Within a family its schedule names the curve; across families ("all") the curve.
      names = ([] if b is None else b["tied"] if family == "all" else
               [split_curve(c)[1] or c for c in b["tied"]])
      row.append("none" if b is None else
                 f"{' = '.join(names)}: {b['label']}, {100 * b['accuracy']:.1f}%")
    lines.append(f"| <= {budget} | " + " | ".join(row) + " |")
  steps = [str(v) for v in sorted({int(k) for t in s["training_schedules"]
                                   for k in t["accuracy_by_steps"]}, reverse=True)]
  lines += ["", "Training noise schedules (same data, steps and seed; LLaDA decoding, even "
            "split). The masked-token eval accuracy is at each schedule's own masking rate "
            "(its masked fraction beside it), so only the decode columns compare across "
            "schedules:", "", "| alpha(t) | train steps | train s | masked-token eval "
            "(masked fraction) | "
            + " | ".join(f"s={k}" for k in steps) + " | AUP |",
            "|" + "---|" * (5 + len(steps))]
  for t in s["training_schedules"]:
    acc = [_f(_pct(t["accuracy_by_steps"].get(k)), ".1f") for k in steps]
    lines.append(f"| {t['schedule']} | {_f(t['train_steps'], 'd')} | "
                 f"{_f(t['train_seconds'], '.0f')} | "
                 f"{_f(_pct(t['masked_token_accuracy']), '.1f')} "
                 f"({_f(t['masked_fraction'], '.2f')}) | " + " | ".join(acc)
                 + f" | {_f(t['aup'], '.1f')} |")
  return "\n".join(lines)


def plot(s: dict, path: str, *, title: str = "") -> None:
  """Three panels: accuracy against forwards per prompt and against tokens/s, one line per
  decoder x schedule on the default mode's models; accuracy against forwards per prompt for
  each training noise schedule. AR and speculative AR are marked on every panel."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(19.0, 7.4))
  ar, fast_ar = s["reference"]["ar"], s["reference"]["accelerated_ar"]
  decoders = [c for c in s["curves"] if c["curve"] not in ("ar", "speculative ar")
              and not c["curve"].startswith("mdm trained")]
  trained = [c for c in s["curves"] if c["curve"].startswith("mdm trained")]
  families = list(dict.fromkeys(c["family"] for c in decoders + trained))
  colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
  styles = {None: "-", "even": "-", "cosine": "--", "entropy_bound": ":"}
  panels = ((axes[0], decoders, "nfe_per_prompt", "forwards per prompt (log)"),
            (axes[1], decoders, "tokens_per_s", "response tokens/s (log)"),
            (axes[2], trained, "nfe_per_prompt", "forwards per prompt (log)"))
  for i, (ax, curves, x, xlabel) in enumerate(panels):
    for c in curves:
      pts = sorted(c["points"], key=lambda p: p[x])
      color = plt.get_cmap("tab10")(3 + trained.index(c)) if i == 2 else colors[c["family"]]
      ax.plot([p[x] for p in pts], [100 * p["accuracy"] for p in pts], marker="o", ms=3.5,
              color=color, ls="-" if i == 2 else styles.get(c["schedule"], "-."),
              label=c["curve"] + (f" (AUP {c['aup']:.0f})" if c["aup"] is not None else ""))
      bars = [p for p in pts if p.get("accuracy_ci95")]  # each point's 95% interval
      if bars:
        ax.errorbar([p[x] for p in bars], [100 * p["accuracy"] for p in bars],
                    yerr=[[100 * (p["accuracy"] - p["accuracy_ci95"][0]) for p in bars],
                          [100 * (p["accuracy_ci95"][1] - p["accuracy"]) for p in bars]],
                    fmt="none", ecolor=color, elinewidth=0.7, capsize=1.5, alpha=0.6)
    for ref, marker, name in ((ar, "*", "AR"), (fast_ar, "D", "speculative AR")):
      if ref is not None:
        ax.scatter([ref[x]], [100 * ref["accuracy"]], marker=marker, s=90, color="k",
                   zorder=4, label=name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3, which="both")
    # Below the panel: the curves crowd wherever the accuracies are, so no corner is free.
    ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2,
              frameon=False)
  axes[0].set_title("steps x unmasking schedule: accuracy vs forwards", fontsize=10)
  axes[1].set_title("... and vs tokens/s (this machine)", fontsize=10)
  axes[2].set_title("training noise schedule alpha(t) (LLaDA, even split)", fontsize=10)
  if title:
    fig.suptitle(title, fontsize=11)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
