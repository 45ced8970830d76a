"""`--seeds N`: every model trained at each seed, each claim judged per seed and on the cells
pooled over the seeds (intervals resampled within each seed)."""

import dataclasses
import importlib.util
import os

import numpy as np
import pytest

from studylib import intervals, seeds, verdict
from test_study_intervals import tiny_run

STUDY_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "study.py")


def test_seed_config_trains_every_model_at_its_seed_on_the_shared_data(tmp_path):
  spec = importlib.util.spec_from_file_location("study_config", STUDY_CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  base = module.get_config("")
  c = seeds.seed_config(base, 2, tmp_path)
  assert {m.train.seed for m in c.models.values()} == {2}
  assert c.data.data_dir == str(tmp_path / "data")
  assert c.methods == base.methods and c.data.tasks == base.data.tasks
  assert seeds.seed_workdir(tmp_path, 0) == tmp_path
  assert seeds.seed_workdir(tmp_path, 2) == tmp_path / "seed2"


def test_pooled_cells_sum_each_seed_and_resample_within_it():
  first, second = tiny_run(), tiny_run()
  second = [dataclasses.replace(second[0]),  # AR as before; D2F right everywhere at seed 1
            dataclasses.replace(second[1], num_correct=second[1].num_prompts,
                                per_task={"arithmetic": [40, 40]},
                                per_prompt={**second[1].per_prompt, "correct": [1] * 40})]
  pooled = seeds.pool([first, second])
  ar, d2f = pooled
  assert (d2f.num_prompts, d2f.num_correct) == (80, 32 + 40)
  assert d2f.per_task == {"arithmetic": [72, 80]}
  assert d2f.wall_s == pytest.approx(first[1].wall_s + second[1].wall_s)
  assert d2f.per_batch["seed"] == [0] * 40 + [1] * 40
  assert intervals.batch_figures(d2f.per_prompt, d2f.per_batch)["strata"] == [40, 40]
  ci = intervals.versus(d2f, ar, None, None)["accuracy_delta_ci95"]
  # Re-stated: resample 40 prompts within each seed, as intervals.weights draws them.
  rng = np.random.default_rng(intervals.SEED)
  draws = [rng.integers(0, 40, size=(intervals.RESAMPLES, 40)) for _ in range(2)]
  c = np.array(d2f.per_prompt["correct"]).reshape(2, 40)
  values = [100 * (c[0, a].sum() + c[1, b].sum() - 80) / 80 for a, b in zip(*draws)]
  assert ci == pytest.approx(list(np.percentile(values, [2.5, 97.5])))
  v = verdict.judge(pooled, task="arithmetic", llada_label="llada")
  rows = seeds.summary([verdict.judge(r, task="arithmetic", llada_label="llada")
                        for r in (first, second)], v)
  d2f_row = next(r for r in rows if r["id"] == "d2f_vs_ar")
  assert [b["accuracy_delta_points"] for b in d2f_row["seeds"]] == [-20.0, 0.0]
  assert d2f_row["pooled"]["accuracy_delta_points"] == -10.0
  text = seeds.summary_text(rows)
  assert "| d2f_vs_ar | " in text and "| seed 0 | seed 1 | pooled |" in text
  with pytest.raises(ValueError, match="missing from a seed"):
    seeds.pool([first, second[:1]])


@pytest.mark.slow
def test_two_seeds_end_to_end(tmp_path):
  """The micro study at two training seeds: seed 0 in the workdir, seed 1 in seed1/, both on
  the workdir's data; every claim reported per seed and pooled, recomputable."""
  import json as json_lib
  from studylib import study
  from test_study import _micro_config
  out = seeds.run(_micro_config(), tmp_path, 2, study.run, log=lambda *_: None)
  assert (tmp_path / "study.json").exists() and (tmp_path / "seed1" / "study.json").exists()
  assert not (tmp_path / "seed1" / "data").exists()  # the data is shared
  docs = [json_lib.loads((d / "study.json").read_text()) for d in (tmp_path, tmp_path / "seed1")]
  assert [d["config"]["models"]["ar"]["train"]["seed"] for d in docs] == [0, 1]
  stored = json_lib.loads((tmp_path / "seeds.json").read_text())
  assert [len(c["seeds"]) for c in stored["claims"]] == [2] * len(verdict.CLAIMS)
  pooled = seeds.pool([[verdict.MethodResult.from_json(r) for r in d["results"]] for d in docs])
  config = _micro_config()
  assert stored["pooled_verdict"] == json_lib.loads(json_lib.dumps(verdict.judge(
      pooled, task=config.eval.headline_task, llada_label=config.eval.llada_vanilla_label,
      platform=docs[0]["machine"]["platform"],
      accelerated_ar_label=config.eval.get("accelerated_ar_label"))))
  assert "| d2f_vs_ar |" in (tmp_path / "seeds.md").read_text() and out["seeds"] == 2
