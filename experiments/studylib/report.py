"""Tables and plots of study results: Markdown for humans, PNG for the Pareto picture."""

from __future__ import annotations

from collections.abc import Sequence

from studylib import intervals as intervals_lib
from studylib.accounting import MethodResult


def markdown_table(results: Sequence[MethodResult], *, baseline: str | None = None) -> str:
  """One row per cell: accuracy, tokens/s (and ratio to `baseline`'s label), latency, NFE.
  Against the baseline cell of the same batch size, the accuracy difference and the tokens/s
  ratio carry their paired bootstrap 95% intervals over prompts ([lo, hi], intervals.py)
  where the cells stored their per-prompt results."""
  base = {}
  if baseline is not None:
    for r in results:
      if r.label == baseline:
        base[r.batch_size] = r
  head = ("| method | setting | batch | accuracy | Δ accuracy vs AR (points) [95% CI] "
          "| tokens/s | vs AR [95% CI] | latency/prompt (ms) | NFE/prompt | tokens/forward "
          "| response tokens |")
  lines = [head, "|" + "---|" * 11]
  for r in results:
    delta, ratio = versus_text(r, base.get(r.batch_size))
    lines.append(
        f"| {r.method} | {r.label} | {r.batch_size} | {100 * r.accuracy:.1f}% | {delta} | "
        f"{r.tokens_per_s:.1f} | {ratio} | {1000 * r.latency_per_prompt_s:.1f} | "
        f"{r.nfe_per_prompt:.1f} | {r.tokens_per_forward:.2f} | {r.response_tokens} |")
  return "\n".join(lines)


def versus_text(r: MethodResult, base: MethodResult | None) -> tuple[str, str]:
  """(`-1.2 [-3.1, +0.6]`, `1.23x [1.10, 1.35]`): r's accuracy difference in points and its
  tokens/s ratio against `base`, each with its paired 95% interval where one exists."""
  if base is None or not base.tokens_per_s:
    return "n/a", "nan"
  ci = intervals_lib.versus(r, base, None, None)
  delta = 100 * (r.accuracy - base.accuracy)
  text = f"{delta:+.1f}"
  if ci["accuracy_delta_ci95"] is not None:
    lo, hi = ci["accuracy_delta_ci95"]
    text += f" [{lo:+.1f}, {hi:+.1f}]"
  ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x"
  if ci["speedup_ci95"] is not None:
    lo, hi = ci["speedup_ci95"]
    ratio += f" [{lo:.2f}, {hi:.2f}]"
  return text, ratio


def per_task_table(results: Sequence[MethodResult], *, baseline: str | None = None,
                   batch_size: int = 1) -> str:
  """One row per cell at `batch_size`, one column per task: accuracy and, where the cell's
  batches of that task were timed on their own (always at batch 1), tokens/s as a multiple
  of the `baseline` cell's on the same task. "" when the cells cover fewer than two tasks."""
  cells = [r for r in results if r.batch_size == batch_size]
  tasks = sorted({t for r in cells for t in r.per_task})
  if len(tasks) < 2:
    return ""
  base = next((r for r in cells if r.label == baseline), None)
  counts = {t: max(r.per_task.get(t, (0, 0))[1] for r in cells) for t in tasks}
  head = "| setting | " + " | ".join(f"{t} ({counts[t]})" for t in tasks) + " |"
  lines = [f"Per task at batch {batch_size}: accuracy, and tokens/s against "
           f"{baseline or 'the baseline'} on the same task's prompts [paired 95% interval].",
           "", head,
           "|" + "---|" * (len(tasks) + 1)]
  for r in cells:
    row = []
    for t in tasks:
      if t not in r.per_task:
        row.append("n/a")
        continue
      text = f"{100 * r.task_accuracy(t):.1f}%"
      speed, ref = r.task_tokens_per_s(t), base.task_tokens_per_s(t) if base else float("nan")
      if speed == speed and ref == ref and ref > 0:  # both timed (not nan)
        text += f", {speed / ref:.2f}x"
        ci = intervals_lib.versus(r, base, t, t)["speedup_ci95"]
        if ci is not None:
          text += f" [{ci[0]:.2f}, {ci[1]:.2f}]"
      row.append(text)
    lines.append(f"| {r.label} | " + " | ".join(row) + " |")
  return "\n".join(lines)


def time_text(doc: dict) -> str:
  """Where a study run's wall time went, on which CPU, and each model's training record, e.g.

    Time: 1982 s in all on <cpu_model> (family/model 23/1, avx2; 2 CPUs): 1696 s building the
    data and training or loading the models, 286 s decoding (calibration included).
    Training records (a model loaded from the cache shows the run that trained it): ar 900
    steps in 354 s (2.54 steps/s), mdm 1500 steps in 658 s (2.28 steps/s).

  From study.json's `total_s`, `train_or_load_s`, `machine`, `training` (one
  models.train_record per model, None for one trained before records were kept) and
  `decode_restored_rounds` (a last line only when a decode resumed from its journal). The
  README's 15-minute budget is a wall time on 2 cores; this line says which part of it a
  run spent where, and on how fast a CPU (BENCHMARKS.md section 1)."""
  m = doc["machine"]
  cpu = m.get("cpu_model") or m["processor"]
  detail = []
  if m.get("cpu_family_model"):
    detail.append(f"family/model {m['cpu_family_model']}")
  if m.get("cpu_simd"):
    detail.append(m["cpu_simd"])
  cpus = f"{m['cpu_count']} CPUs"
  where = f"{cpu} ({', '.join(detail)}; {cpus})" if detail else f"{cpu} ({cpus})"
  if m["platform"] != "cpu":
    where += f", decoding on {m['device_count']} x {m['device_kind']}"
  if m.get("code_revision"):
    where += f", code at {m['code_revision']}"
  total, train = doc["total_s"], doc["train_or_load_s"]
  lines = [f"Time: {total:.0f} s in all on {where}: {train:.0f} s building the data and "
           f"training or loading the models, {total - train:.0f} s decoding (calibration "
           "included)."]
  records = []
  for name, record in doc.get("training", {}).items():
    if record is None:
      records.append(f"{name} (no record: trained before records were kept)")
    elif record.get("first_step"):  # resumed: the seconds cover the finishing call's steps
      done = record["steps"] - record["first_step"]
      records.append(f"{name} {record['steps']} steps, the last {done} (resumed at step "
                     f"{record['first_step']}) in {record['seconds']:.0f} s "
                     f"({done / record['seconds']:.2f} steps/s)")
    else:
      records.append(f"{name} {record['steps']} steps in {record['seconds']:.0f} s "
                     f"({record['steps'] / record['seconds']:.2f} steps/s)")
  if records:
    lines.append("Training records (a model loaded from the cache shows the run that trained "
                 "it): " + ", ".join(records) + ".")
  restored = {b: n for b, n in doc.get("decode_restored_rounds", {}).items() if n}
  if restored:
    lines.append("Decoding resumed: " + ", ".join(
        f"{n} batch-{b} rounds" for b, n in restored.items()) + " were timed by the "
        "interrupted run and replayed from its journal (each round's cells side by side).")
  return "\n".join(lines)


def pareto_front(results: Sequence[MethodResult]) -> list[MethodResult]:
  """Cells not beaten on both accuracy and tokens/s by another cell of the same batch size."""
  front = []
  for r in results:
    dominated = any(
        o is not r and o.batch_size == r.batch_size and o.accuracy >= r.accuracy and
        o.tokens_per_s >= r.tokens_per_s and
        (o.accuracy > r.accuracy or o.tokens_per_s > r.tokens_per_s) for o in results)
    if not dominated:
      front.append(r)
  return front


def accuracy_window(accuracies: Sequence[float], *, span: float = 25.0):
  """(lo, hi, below) of a Pareto panel's accuracy axis, in percent.

  The axis covers the cells within `span` points of the best one, so that a few far-off
  cells (an undistilled model at 9%, say) do not squash the ones being compared near the
  top; `below` lists the indices of the cells under `lo`, which are drawn on the bottom
  edge with their accuracy written beside them. When most cells are far off (fewer than
  half within `span`), they are the comparison, and the axis covers every cell.
  """
  best = max(accuracies)
  near = [a for a in accuracies if a >= best - span]
  if 2 * len(near) < len(accuracies):
    near = list(accuracies)
  lo = max(0.0, min(near) - 0.1 * (best - min(near)) - 1.0)
  hi = min(100.0, best) + 0.5
  return lo, hi, [i for i, a in enumerate(accuracies) if a < lo]


def pareto_plot(results: Sequence[MethodResult], path: str, *, title: str = "",
                baseline: str | None = None, llada_label: str | None = None) -> None:
  """Accuracy against tokens/s, one point per (method, setting), one panel per batch size.

  Every cell is numbered (its row in the table, counted per batch size) beside its marker,
  with bars of its bootstrap 95% intervals over prompts (accuracy and tokens/s) where it
  stored its per-prompt results,
  and a key lists the numbers, so dense clusters stay readable. The Pareto front is a dashed
  staircase. Vertical lines mark the `baseline` cell's tokens/s and 2.5x it (the published
  D2F-over-AR ratio), and 10x the `llada_label` cell's (the published ratio over vanilla
  LLaDA), when those cells exist.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib import ticker

  batches = sorted({r.batch_size for r in results})
  fig, axes = plt.subplots(1, len(batches), figsize=(6.0 * len(batches) + 3.2, 5.4),
                           squeeze=False)
  methods = sorted({r.method for r in results})
  colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
  key = []
  for ax, b in zip(axes[0], batches):
    cells = [r for r in results if r.batch_size == b]
    acc = [100 * r.accuracy for r in cells]
    lo, hi, below = accuracy_window(acc)
    for i, r in enumerate(cells, 1):
      off = i - 1 in below
      y = lo if off else acc[i - 1]
      ax.scatter([r.tokens_per_s], [y], color=colors[r.method], s=36, zorder=3,
                 marker="v" if off else "o", clip_on=False)
      bars = intervals_lib.own(r)  # 95% intervals of the cell's accuracy and tokens/s
      if not off and bars["accuracy_ci95"] is not None:
        yerr = [[y - 100 * bars["accuracy_ci95"][0]], [100 * bars["accuracy_ci95"][1] - y]]
        xerr = None
        if bars["tokens_per_s_ci95"] is not None and bars["tokens_per_s_ci95"][0] > 0:
          lo_x, hi_x = bars["tokens_per_s_ci95"]  # (a log axis: no bar down to 0)
          xerr = [[r.tokens_per_s - lo_x], [hi_x - r.tokens_per_s]]
        ax.errorbar([r.tokens_per_s], [y], yerr=yerr, xerr=xerr, color=colors[r.method],
                    lw=0.8, capsize=2, zorder=2, alpha=0.7)
      text = f"{i} ({acc[i - 1]:.0f}%)" if off else str(i)
      # Alternate above/below (stagger the edge labels upwards), so that the numbers of
      # near-identical cells stay apart.
      shift = (3, 4 + 8 * (below.index(i - 1) % 3)) if off else (3, 4) if i % 2 else (3, -10)
      ax.annotate(text, (r.tokens_per_s, y), fontsize=7, textcoords="offset points",
                  xytext=shift)
      if b == batches[0]:
        key.append(f"{i:>2} {r.label}")
    front = sorted(pareto_front(cells), key=lambda r: r.tokens_per_s)
    ax.plot([r.tokens_per_s for r in front], [max(lo, 100 * r.accuracy) for r in front],
            "k--", lw=0.9, drawstyle="steps-pre", label="Pareto front", zorder=2)
    marks = []
    ref = {r.label: r.tokens_per_s for r in cells}
    if baseline in ref:
      marks += [(ref[baseline], "-", "AR"), (2.5 * ref[baseline], ":", "2.5x AR")]
    if llada_label in ref:
      marks.append((10 * ref[llada_label], "-.", "10x vanilla LLaDA"))
    for x, style, name in marks:
      ax.axvline(x, color="0.45", ls=style, lw=0.9, label=name, zorder=1)
    for m in methods:  # legend entries, one per method
      ax.scatter([], [], color=colors[m], s=36, label=m)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_ylim(lo, hi)
    ax.set_xlabel("response tokens/s (log)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{title} batch {b}".strip(), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower left")
  fig.text(1 - 3.0 / fig.get_figwidth(), 0.93, "cells (table order)\n" + "\n".join(key),
           fontsize=7, family="monospace", va="top", ha="left")
  fig.tight_layout(rect=(0, 0, 1 - 3.1 / fig.get_figwidth(), 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)
