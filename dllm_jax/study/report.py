"""Tables and plots of study results: Markdown for humans, PNG for the Pareto picture."""

from __future__ import annotations

from collections.abc import Sequence

from dllm_jax.study.accounting import MethodResult


def markdown_table(results: Sequence[MethodResult], *, baseline: str | None = None) -> str:
  """One row per cell: accuracy, tokens/s (and ratio to `baseline`'s label), latency, NFE."""
  base = {}
  if baseline is not None:
    for r in results:
      if r.label == baseline:
        base[r.batch_size] = r.tokens_per_s
  head = ("| method | setting | batch | accuracy | tokens/s | vs AR | latency/prompt (ms) "
          "| NFE/prompt | tokens/forward | response tokens |")
  lines = [head, "|" + "---|" * 10]
  for r in results:
    ratio = r.tokens_per_s / base[r.batch_size] if base.get(r.batch_size) else float("nan")
    lines.append(
        f"| {r.method} | {r.label} | {r.batch_size} | {100 * r.accuracy:.1f}% | "
        f"{r.tokens_per_s:.1f} | {ratio:.2f}x | {1000 * r.latency_per_prompt_s:.1f} | "
        f"{r.nfe_per_prompt:.1f} | {r.tokens_per_forward:.2f} | {r.response_tokens} |")
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


def pareto_plot(results: Sequence[MethodResult], path: str, *, title: str = "") -> None:
  """Accuracy against tokens/s, one point per (method, setting), one panel per batch size."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  batches = sorted({r.batch_size for r in results})
  fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 5), squeeze=False)
  methods = sorted({r.method for r in results})
  colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
  for ax, b in zip(axes[0], batches):
    cells = [r for r in results if r.batch_size == b]
    for m in methods:
      pts = [r for r in cells if r.method == m]
      if not pts:
        continue
      ax.scatter([r.tokens_per_s for r in pts], [100 * r.accuracy for r in pts],
                 color=colors[m], label=m, s=40)
      for r in pts:
        ax.annotate(r.label, (r.tokens_per_s, 100 * r.accuracy), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    front = sorted(pareto_front(cells), key=lambda r: r.tokens_per_s)
    ax.plot([r.tokens_per_s for r in front], [100 * r.accuracy for r in front], "k--", lw=0.8,
            label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("response tokens/s (log)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{title} batch {b}".strip())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
