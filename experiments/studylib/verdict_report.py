"""The verdict's printed report (`verdict_text`): each claim's status, its measured figure
with the 95% intervals beside it, the reason, the equal-cost projection (named as one) and
its cells. Reads only the verdict dict that `verdict.judge` builds."""

from __future__ import annotations


def fmt(x, spec=".2f") -> str:
  return "n/a" if x is None else format(x, spec)


def fmt_ratio(x) -> str:
  """A ratio as `2.50x`, or n/a."""
  return "n/a" if x is None else f"{x:.2f}x"


def _ci(interval, spec=".2f", suffix="") -> str:
  """` [lo, hi]`: a 95% interval beside its figure ("" where none was computed)."""
  if interval is None:
    return ""
  return f" [{format(interval[0], spec)}{suffix}, {format(interval[1], spec)}{suffix}]"


def _vs_accelerated(c: dict) -> str:
  """`; 0.85x speculative ar k=4`: the cell's speedup over the accelerated AR, if judged."""
  vs = c.get("vs_accelerated_ar")
  if vs is None:
    return ""
  return f"; {fmt_ratio(vs['speedup'])}{_ci(vs.get('speedup_ci95'))} {vs['baseline']}"


def _cell_line(c: dict, base: str) -> str:
  line = (f"      {c['label']}: {fmt_ratio(c['speedup'])}{_ci(c.get('speedup_ci95'))} {base} "
          f"tokens/s ({fmt_ratio(c['speedup_median'])} by median times), accuracy "
          f"{fmt(c['accuracy_delta_points'], '+.1f')}"
          f"{_ci(c.get('accuracy_delta_ci95'), '+.1f')} points; "
          f"{fmt_ratio(c['nfe_ratio'])} fewer forwards, each "
          f"{fmt_ratio(c['forward_cost_ratio'])} a "
          f"{base} forward's time, tokens {fmt_ratio(c['tokens_ratio'])}")
  if "tokens_per_verifier_forward" in c:
    line += f"; {fmt(c['tokens_per_verifier_forward'])} tokens per verifier forward"
  if "pipeline_ceiling" in c:
    line += f"; at most {fmt_ratio(c['pipeline_ceiling'])} at equal cost (one block a forward)"
  return line + _vs_accelerated(c)


def _scopes(accuracy_on: str, speed_on: str, task: str) -> str:
  """How the figure line names what its accuracy and speed were measured on."""
  if accuracy_on == task:
    return "" if speed_on == "all tasks" else f", speed on {speed_on} prompts"
  speed = speed_on if speed_on == "all tasks" else f"{speed_on} prompts"
  return f", accuracy on {accuracy_on}, speed on {speed}"


def projection_text(p: dict | None, threshold: float) -> str:
  """The equal-cost projection of a claim, named as one (module docstring)."""
  if p is None:
    return ""
  text = (f"projection, not a measurement: at equal cost per forward {p['label']} would run "
          f"{fmt_ratio(p['speedup_at_equal_forward_cost'])} {p['baseline']} "
          f"({fmt_ratio(p['nfe_ratio'])} fewer forwards; measured, each costs "
          f"{fmt_ratio(p['forward_cost_ratio'])} a {p['baseline']} forward's time here), "
          + ("reaching" if p["reaches_threshold"] else "below") + f" {threshold:g}x")
  if p.get("pipeline_ceiling") is not None:
    text += (f"; one D2F block a forward bounds it at {fmt_ratio(p['pipeline_ceiling'])} "
             f"(k={p['pipeline_block_length']}, G={p['gen_length']})")
  return text


def verdict_text(v: dict) -> str:
  """The printed report: each claim's status, its measured figure with the 95% intervals
  beside it, the reason, the equal-cost projection (labelled as one), then its cells (each
  set of cells once: the 10x and 50x LLaDA claims share theirs)."""
  lines = [f"Claims checked at batch 1 (accuracy and speed on {v['task']!r} unless noted; AR = "
           f"{v['ar']!r}, vanilla LLaDA = {v['llada_vanilla']!r}, platform {v['platform']}; "
           "[lo, hi]: paired bootstrap 95% intervals over prompts):"]
  shown = set()
  for c in v["claims"]:
    lines.append(f"  [{c['status'].upper()}] {c['text']}")
    fig = c["figure"]
    if fig is not None:
      on = fig.get("speed_on", "all tasks")
      lines.append(f"    figure: {fig['label']}: {fmt_ratio(fig['speedup'])}"
                   f"{_ci(fig.get('speedup_ci95'))}, accuracy "
                   f"{fmt(fig['accuracy_delta_points'], '+.1f')}"
                   f"{_ci(fig.get('accuracy_delta_ci95'), '+.1f')} points"
                   + (f" (G={c['gen_length']})" if c["gen_length"] else "")
                   + _scopes(c.get("accuracy_on", v["task"]), on, v["task"])
                   + _vs_accelerated(fig))
    lines.append(f"    {c['reason']}")
    if c.get("projection"):
      lines.append(f"    {projection_text(c['projection'], c['threshold']['speedup'])}")
    lines.append(f"    published: {c['published']}")
    key = (c["method"], c["baseline"])
    if c["cells"] and key not in shown:
      shown.add(key)
      lines.append(f"    every {c['method']} cell against {c['baseline']}:")
      lines += [_cell_line(x, c["baseline"]) for x in c["cells"]]
    if c.get("oracle"):
      lines.append("    oracle upper bound (the generator's task names as tags; not judged):")
      lines += [_cell_line(x, c["baseline"]) for x in c["oracle"]]
  return "\n".join(lines)
