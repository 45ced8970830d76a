"""`--seeds N`: the study at N training seeds, each claim judged per seed and pooled.

    python experiments/study.py --seeds 3           # the default mode at training seeds 0, 1, 2
    python experiments/study.py --long --seeds 3 --config.data.gen_length=384 \
        --workdir runs/study_long384

Seed s trains every model with `train.seed = s` (the data, the prompts and the cells stay the
same) and runs the mode's study in `<workdir>` for s = 0 (the one-seed study's own models and
report) and in `<workdir>/seed<s>` for the others, all reading the data files under
`<workdir>/data`. Each seed's run writes its own report. Then every cell is pooled over the
seeds (`pool`: counts, tokens, forwards and times summed; per-prompt results concatenated,
each batch marked with its seed so the bootstrap resamples within each seed) and the verdict
is judged again on the pooled cells. `seeds.md` and `seeds.json` in `<workdir>` hold, per
claim, its status and figure with its intervals at every seed and pooled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from ml_collections import config_dict

from studylib import models as models_lib
from studylib import verdict as verdict_lib
from studylib.accounting import MethodResult

_ADDED = ("num_prompts", "num_correct", "response_tokens", "wall_s", "compile_s", "nfe",
          "loop_steps", "wall_median_s")


def seed_workdir(workdir, seed: int) -> Path:
  """Where seed `seed` trains and reports: the workdir itself for seed 0."""
  return Path(workdir) if seed == 0 else Path(workdir) / f"seed{seed}"


def seed_config(study_config, seed: int, workdir) -> config_dict.ConfigDict:
  """The study config with every model trained at `train.seed = seed`, reading the data files
  of `<workdir>/data` (the data is the same at every seed)."""
  c = config_dict.ConfigDict(study_config.to_dict())
  for name in c.models:
    c.models[name].train.seed = int(seed)
  if c.data.source == "tfds" and not c.data.data_dir:
    c.data.data_dir = str(Path(workdir) / models_lib.DATA_DIR)
  c.lock()
  return c


def pool(per_seed: Sequence[Sequence[MethodResult]]) -> list[MethodResult]:
  """Each (label, batch size) cell pooled over the seeds' runs (module docstring); the cells
  of the first run, in its order. ValueError if a run lacks one of them."""
  keyed = [{(r.label, r.batch_size): r for r in results} for results in per_seed]
  out = []
  for r0 in per_seed[0]:
    key = (r0.label, r0.batch_size)
    if any(key not in k for k in keyed):
      raise ValueError(f"cell {key} is missing from a seed's run: the seeds must run the same "
                       "cells.")
    cells = [k[key] for k in keyed]
    pooled = MethodResult(r0.method, r0.label, dict(r0.setting), r0.batch_size,
                          **{f: type(getattr(r0, f))(sum(getattr(c, f) for c in cells))
                             for f in _ADDED})
    for seed, c in enumerate(cells):
      for task, (hit, total) in c.per_task.items():
        old = pooled.per_task.get(task, [0, 0])
        pooled.per_task[task] = [old[0] + hit, old[1] + total]
      for task, figures in c.per_task_time.items():
        old = pooled.per_task_time.get(task, [0] * len(figures))
        pooled.per_task_time[task] = [a + b for a, b in zip(old, figures)]
      for name, values in c.per_prompt.items():
        pooled.per_prompt.setdefault(name, []).extend(values)
      for name, values in c.per_batch.items():
        pooled.per_batch.setdefault(name, []).extend(values)
      if c.per_batch:
        pooled.per_batch.setdefault("seed", []).extend([seed] * len(c.per_batch["rows"]))
    out.append(pooled)
  return out


def summary(verdicts: Sequence[dict], pooled: dict) -> list[dict]:
  """Per claim: {id, text, seeds: [{status, figure label, speedup, speedup_ci95,
  accuracy_delta_points, accuracy_delta_ci95}], pooled: the same}."""
  def brief(entry):
    fig = entry["figure"] or {}
    return {"status": entry["status"], "figure": fig.get("label"),
            **{k: fig.get(k) for k in ("speedup", "speedup_ci95", "accuracy_delta_points",
                                       "accuracy_delta_ci95")}}
  out = []
  for i, claim in enumerate(pooled["claims"]):
    out.append({"id": claim["id"], "text": claim["text"],
                "seeds": [brief(v["claims"][i]) for v in verdicts], "pooled": brief(claim)})
  return out


def summary_text(rows: Sequence[dict]) -> str:
  """A table: one row per claim, its status and figure at each seed and pooled."""
  n = len(rows[0]["seeds"]) if rows else 0

  def cell(b):
    if b["figure"] is None:
      return b["status"].upper()
    speed = "n/a" if b["speedup"] is None else f"{b['speedup']:.2f}x"
    if b["speedup_ci95"]:
      speed += f" [{b['speedup_ci95'][0]:.2f}, {b['speedup_ci95'][1]:.2f}]"
    delta = "n/a" if b["accuracy_delta_points"] is None else f"{b['accuracy_delta_points']:+.1f}"
    if b["accuracy_delta_ci95"]:
      delta += f" [{b['accuracy_delta_ci95'][0]:+.1f}, {b['accuracy_delta_ci95'][1]:+.1f}]"
    return f"{b['status'].upper()}: {b['figure']}, {speed}, {delta} pts"

  head = "| claim | " + " | ".join(f"seed {s}" for s in range(n)) + " | pooled |"
  lines = [f"Each claim at {n} training seeds and pooled (status: figure, tokens/s ratio "
           "[95% CI], accuracy difference [95% CI]):", "", head, "|" + "---|" * (n + 2)]
  for r in rows:
    lines.append(f"| {r['id']} | " + " | ".join(cell(b) for b in r["seeds"])
                 + f" | {cell(r['pooled'])} |")
  return "\n".join(lines)


def run(study_config, workdir, seeds: int, run_one: Callable, *, log=print) -> dict:
  """Runs the study (`run_one(config, workdir) -> its JSON`, study.run) at training seeds
  0..seeds-1, pools the cells and writes seeds.md / seeds.json; returns the JSON."""
  if seeds < 1:
    raise ValueError(f"--seeds must be >= 1, got {seeds}.")
  workdir = Path(workdir)
  docs = []
  for s in range(seeds):
    log(f"[study] training seed {s} of {seeds}: {seed_workdir(workdir, s)}")
    docs.append(run_one(seed_config(study_config, s, workdir), seed_workdir(workdir, s)))
  per_seed = [[MethodResult.from_json(row) for row in d["results"]] for d in docs]
  pooled = pool(per_seed)
  ev = study_config.eval
  v = verdict_lib.judge(pooled, task=ev.headline_task, llada_label=ev.llada_vanilla_label,
                        platform=docs[0]["machine"]["platform"],
                        accelerated_ar_label=ev.get("accelerated_ar_label"))
  rows = summary([d["verdict"] for d in docs], v)
  out = {"seeds": seeds, "workdirs": [str(seed_workdir(workdir, s)) for s in range(seeds)],
         "claims": rows, "pooled_verdict": v,
         "pooled_results": [r.to_json() for r in pooled]}
  text = summary_text(rows) + "\n\n" + verdict_lib.verdict_text(v) + "\n"
  (workdir / "seeds.md").write_text(text)
  (workdir / "seeds.json").write_text(json.dumps(out, indent=1))
  log(text)
  log(f"[study] wrote {workdir / 'seeds.md'} and seeds.json")
  return out
