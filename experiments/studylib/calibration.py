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

A cell with `router: "prompt_format"` (adaptive without task tags) is fitted from the same
forced decodes, regrouped by each prompt's format instead of its task (router.py, with the
rule's own "auto" among the modes); it then tags each evaluation row with its prompt's format,
computed from the prompt text alone. Cells that share a decoder share its forced decodes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence

from dllm_jax.data.sources import record_to_example
from studylib import adaptive_calibration
from dllm_jax.training import data as data_lib
from studylib import router as router_lib
from studylib import runner

ROUTER = "prompt_format"  # the router a cell may name (`router`: router.py)


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
  if forced.pop("router", None):  # a routed cell's forced decode tags rows by task, as any
    forced["task_tags"] = True
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
  if unseen and any(c.get("calibrate") and c.get("task_tags") for c in cells):
    raise ValueError(f"the calibration split has no prompt of tasks {unseen}, which the "
                     "evaluation prompts have, so no mode can be chosen for their task tags; "
                     "raise eval.calibration_prompts.")
  out, records = [], {}
  decoded = {}  # (the cell's decoder, mode) -> its calibration tally: shared between cells

  def forced_results(cell, modes):
    key = json.dumps([cell["model"], cell.get("drafter"), cell["options"]], sort_keys=True,
                     default=str)
    todo = [m for m in modes if (key, m) not in decoded]
    fresh = ([] if "ar" in decoded else [ar_cell]) + [forced_cell(cell, m, tasks) for m in todo]
    if fresh:
      got = runner.run_cells([bind(c) for c in fresh], layout=layout, suite=suite,
                             examples=examples, prompt_len=layout.prompt_len, seed=seed,
                             repeats=repeats)
      if "ar" not in decoded:
        decoded["ar"], got = got[0], got[1:]
      decoded.update({(key, m): r for m, r in zip(todo, got)})
    return decoded["ar"], {m: decoded[(key, m)] for m in modes}

  for cell in cells:
    if not cell.get("calibrate"):
      out.append(cell)
      continue
    routed = cell.get("router")
    if cell["method"] != "adaptive" or not (cell.get("task_tags") or routed):
      raise ValueError(f"cell {cell['label']!r}: calibrate applies to adaptive cells with "
                       "task_tags or a router.")
    if routed:
      if routed != ROUTER:
        raise ValueError(f"cell {cell['label']!r}: router {routed!r} is not one the study "
                         f"fits; use {ROUTER!r}.")
      if batch_size != 1:
        raise ValueError(f"the prompt router is fitted on batch-1 timings (one wall time a "
                         f"prompt); the study's first batch size is {batch_size}.")
      ar, forced = forced_results(cell, router_lib.MODES)
      trials = {m: {"correct": r.per_prompt["correct"], "tokens": r.per_prompt["tokens"],
                    "wall_s": r.per_batch["wall_s"]} for m, r in forced.items()}
      fitted, formats = router_lib.fit([ex.prompt for ex in examples],
                                       ar.per_prompt["correct"], trials, tolerance=tolerance)
      filled = copy.deepcopy(cell)
      filled["options"]["task_modes"] = fitted.task_modes()
      filled["route"] = dict(fitted.modes)
      out.append(filled)
      records[cell["label"]] = {"router": routed, "prompts": len(examples),
                                "batch_size": batch_size, "tolerance": tolerance,
                                "task_modes": fitted.task_modes(), "formats": formats}
      continue
    ar, forced = forced_results(cell, adaptive_calibration.CALIBRATED_MODES)
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
  """One paragraph per calibrated cell: each task's (or prompt format's) mode and the figures
  that chose it."""
  lines = []
  for label, rec in records.items():
    lines.append(f"Calibration of {label!r} on {rec['prompts']} held-out prompts (not the "
                 f"evaluation's), batch {rec['batch_size']}, tolerance "
                 f"{100 * rec['tolerance']:.1f} points against AR"
                 + (", routed by prompt format (no task tags):" if rec.get("router") else ":"))
    if rec.get("router"):
      for fmt, f in rec["formats"].items():
        ar_speed = f["modes"]["ar"]["tokens_per_s"]
        figures = ", ".join(f"{m} {100 * x['accuracy']:.1f}% at "
                            f"{x['tokens_per_s'] / ar_speed:.2f}x" for m, x in f["modes"].items())
        lines.append(f"  {fmt!r} ({f['prompts']} prompts; AR {100 * f['ar_accuracy']:.1f}%) -> "
                     f"{f['mode']}: {figures}")
      lines.append(f"  any other format -> {router_lib.FALLBACK}")
      continue
    for task, mode in rec["task_modes"].items():
      ar = rec["ar"][task]
      figures = ", ".join(
          f"{m} {100 * per[task]['accuracy']:.1f}% at "
          f"{per[task]['tokens_per_s'] / ar['tokens_per_s']:.2f}x"
          for m, per in rec["modes"].items())
      lines.append(f"  {task} ({rec['prompts_per_task'][task]} prompts; AR "
                   f"{100 * ar['accuracy']:.1f}%) -> {mode}: {figures}")
  return "\n".join(lines)
