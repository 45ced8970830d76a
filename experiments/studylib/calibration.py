"""The study's calibration step: an adaptive cell's task-tag map fitted on a held-out split.

A cell with `calibrate: True` (adaptive, with `task_tags`) leaves its `task_modes` to the
study. Before the evaluation cells run, the study decodes the calibration split (records
`[n_eval, n_eval + eval.calibration_prompts)` of the eval split: held out from training and
disjoint from the evaluation prompts, checked) with AR and with the cell forced into each
mode (its task tags mapping every task to that mode: exactly what the evaluated cell runs for
a task given that mode), timed and scored exactly as the evaluation cells are
(`runner.run_cells`, at the study's first batch size). Each task then gets the fastest mode
within `eval.calibration_tolerance` of AR's accuracy on its calibration prompts
(`adaptive_calibration.choose_task_modes`), and the cell decodes the evaluation prompts with
that map. Every figure of the calibration is stored in the study's JSON (`calibration`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

from dllm_jax.data.sources import record_to_example
from studylib import adaptive_calibration
from dllm_jax.training import data as data_lib
from studylib import runner


def needs_calibration(cells: Sequence[dict]) -> bool:
  return any(c.get("calibrate") for c in cells)


def calibration_examples(data_cfg, n_eval: int, n: int) -> list:
  """Records [n_eval, n_eval + n) of the eval split (the evaluation uses [0, n_eval)).
  ValueError if the split is too small to hold both."""
  _, eval_source = data_lib.make_sources(data_cfg)
  if n_eval + n > len(eval_source):
    raise ValueError(
        f"the eval split holds {len(eval_source)} records, fewer than the {n_eval} evaluation "
        f"prompts plus {n} calibration prompts; raise data.eval_size or lower "
        "eval.calibration_prompts.")
  return [record_to_example(eval_source[i]) for i in range(n_eval, n_eval + n)]


def forced_cell(cell: dict, mode: str, tasks: Sequence[str]) -> dict:
  """The adaptive cell with every task's rows forced into `mode` by their task tags."""
  forced = copy.deepcopy(cell)
  forced.pop("calibrate", None)
  forced["options"]["task_modes"] = {t: mode for t in tasks}
  forced["label"] = f"{cell['label']} [calibration: {mode}]"
  return forced


def calibrate_cells(cells: Sequence[dict], bind: Callable, *, examples: Sequence,
                    eval_examples: Sequence, layout, suite, batch_size: int,
                    tolerance: float, seed: int, repeats: int,
                    ar_label: str = "ar") -> tuple[list[dict], dict]:
  """(cells with each `calibrate` cell's task_modes filled, {label: calibration record}).

  Args:
    cells: the study's cells (dicts); `bind(cell) -> runner.Cell` binds one at batch_size.
    examples: the calibration split; eval_examples: the evaluation prompts (checked
      disjoint from it).
    ar_label: the AR cell, decoded on the calibration split as the accuracy reference.
  """
  adaptive_calibration.check_disjoint([ex.prompt for ex in examples],
                                      [ex.prompt for ex in eval_examples])
  ar_cell = next((c for c in cells if c["label"] == ar_label), None)
  if ar_cell is None:
    raise ValueError(f"calibration needs the AR cell {ar_label!r} as its reference.")
  tasks = sorted({ex.task for ex in examples})
  unseen = sorted({ex.task for ex in eval_examples} - set(tasks))
  if unseen:
    raise ValueError(f"the calibration split has no prompt of tasks {unseen}, which the "
                     "evaluation prompts have, so no mode can be chosen for them; raise "
                     "eval.calibration_prompts.")
  out, records = [], {}
  for cell in cells:
    if not cell.get("calibrate"):
      out.append(cell)
      continue
    if cell["method"] != "adaptive" or not cell.get("task_tags"):
      raise ValueError(f"cell {cell['label']!r}: calibrate applies to adaptive cells with "
                       "task_tags.")
    modes = list(adaptive_calibration.CALIBRATED_MODES)
    candidates = [ar_cell] + [forced_cell(cell, m, tasks) for m in modes]
    results = runner.run_cells([bind(c) for c in candidates], layout=layout, suite=suite,
                               examples=examples, prompt_len=layout.prompt_len, seed=seed,
                               repeats=repeats)
    ar, forced = results[0], dict(zip(modes, results[1:]))
    trials = {m: {t: (r.task_accuracy(t), r.task_tokens_per_s(t)) for t in tasks}
              for m, r in forced.items()}
    ar_accuracy = {t: ar.task_accuracy(t) for t in tasks}
    task_modes = adaptive_calibration.choose_task_modes(ar_accuracy, trials,
                                                        tolerance=tolerance)
    filled = copy.deepcopy(cell)
    filled["options"]["task_modes"] = task_modes
    out.append(filled)
    records[cell["label"]] = {
        "prompts": len(examples), "batch_size": batch_size, "tolerance": tolerance,
        "task_modes": task_modes,
        "prompts_per_task": {t: ar.per_task[t][1] for t in tasks},
        "ar": {t: {"accuracy": ar.task_accuracy(t), "tokens_per_s": ar.task_tokens_per_s(t)}
               for t in tasks},
        "modes": {m: {t: {"accuracy": a, "tokens_per_s": s} for t, (a, s) in per.items()}
                  for m, per in trials.items()}}
  return out, records


def calibration_text(records: dict) -> str:
  """One paragraph per calibrated cell: each task's mode and the figures that chose it."""
  lines = []
  for label, rec in records.items():
    lines.append(f"Calibration of {label!r} on {rec['prompts']} held-out prompts (not the "
                 f"evaluation's), batch {rec['batch_size']}, tolerance "
                 f"{100 * rec['tolerance']:.1f} points against AR:")
    for task, mode in rec["task_modes"].items():
      ar = rec["ar"][task]
      figures = ", ".join(
          f"{m} {100 * per[task]['accuracy']:.1f}% at "
          f"{per[task]['tokens_per_s'] / ar['tokens_per_s']:.2f}x"
          for m, per in rec["modes"].items())
      lines.append(f"  {task} ({rec['prompts_per_task'][task]} prompts; AR "
                   f"{100 * ar['accuracy']:.1f}%) -> {mode}: {figures}")
  return "\n".join(lines)
