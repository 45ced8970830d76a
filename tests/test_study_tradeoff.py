"""The trade-off mode: AUP, the curves' summary (recomputable from the cells), its config grid
(the default mode's models reused as they are), and a seconds-long end-to-end run."""

import importlib.util
import json
import math
import os

import pytest
from ml_collections import config_dict

from dllm_jax.decoding import unmasking
from dllm_jax.training import config as config_lib
from studylib import accounting, study, tradeoff, verdict
from studylib import models as models_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study_config(mode=""):
  spec = importlib.util.spec_from_file_location("study_cfg", os.path.join(ROOT, "configs",
                                                                          "study.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(mode)


# ----------------------------------------------------------------------------- AUP

def test_aup_is_the_weighted_trapezoid_by_hand():
  # y_max 90: W(90) = 1, W(88) = exp(-3 * 2/90), W(80) = exp(-3 * 10/90).
  pts = [(4.0, 88.0), (1.0, 90.0), (2.0, 90.0)]  # unsorted on purpose
  w88 = math.exp(-3 * (1 - 88 / 90))
  want = 1.0 * 90 + 0.5 * (2 - 1) * (90 + 90) + 0.5 * (4 - 2) * (w88 * 88 + 90)
  assert tradeoff.aup(pts, 90.0) == pytest.approx(want, rel=1e-12)
  # A point more than 5 points below the first (lowest-TPF) point's accuracy is dropped.
  assert tradeoff.aup(pts + [(8.0, 84.9)], 90.0) == pytest.approx(want, rel=1e-12)
  w85 = math.exp(-3 * (1 - 85 / 90))
  assert tradeoff.aup(pts + [(8.0, 85.0)], 90.0) == pytest.approx(
      want + 0.5 * 4 * (w85 * 85 + w88 * 88), rel=1e-12)
  # Above y_max the weight is capped at 1; one point is its rectangle.
  assert tradeoff.aup([(3.0, 95.0)], 90.0) == pytest.approx(285.0)


def test_aup_rejects_what_it_cannot_measure():
  with pytest.raises(ValueError, match="at least one"):
    tradeoff.aup([], 90.0)
  with pytest.raises(ValueError, match="positive"):
    tradeoff.aup([(0.0, 50.0)], 90.0)
  with pytest.raises(ValueError, match="positive"):
    tradeoff.aup([(1.0, 50.0)], 0.0)


def test_split_curve():
  assert tradeoff.split_curve("llada cosine") == ("llada", "cosine")
  assert tradeoff.split_curve("block diffusion entropy_bound") == ("block diffusion",
                                                                   "entropy_bound")
  assert tradeoff.split_curve("d2f threshold") == ("d2f threshold", None)


# ----------------------------------------------------------------------------- summary

def _cell(label, method, curve, knob, value, correct, tokens, wall, nfe, model="mdm"):
  setting = {"model": model, "gen_length": 16, "curve": curve, "knob": knob}
  if knob:
    setting[knob] = value
  return accounting.MethodResult(method, label, setting, 1, 10, correct, tokens, wall, 0.1,
                                 nfe, nfe)


def _config():
  return {"eval": {"batch_sizes": [1], "accelerated_ar_label": "speculative ar k=4"},
          "tradeoff": {"steps_divisors": [1, 2, 4, 8, 16],
                       "train_schedules": ["linear", "cosine"]}}


def _cells():
  return [
      _cell("ar", "ar", "ar", None, None, 10, 30, 1.0, 40, model="ar"),
      _cell("speculative ar k=4", "speculative", "speculative ar", "draft_length", 4, 10, 30,
            0.5, 30, model="ar"),
      _cell("llada even s=16", "llada", "llada even", "steps", 16, 10, 30, 4.0, 160),
      _cell("llada even s=4", "llada", "llada even", "steps", 4, 8, 30, 1.0, 40),
      _cell("llada cosine s=4", "llada", "llada cosine", "steps", 4, 9, 30, 1.0, 40),
      _cell("llada cosine s=16", "llada", "llada cosine", "steps", 16, 10, 30, 4.0, 160),
      _cell("block diffusion even s=1", "block_diffusion", "block diffusion even",
            "steps_per_block", 1, 6, 30, 0.5, 20, model="d2f"),
      _cell("d2f tau=0.9", "d2f", "d2f threshold", "tau_conf", 0.9, 9, 30, 0.4, 20,
            model="d2f"),
      _cell("mdm linear s=16", "llada", "mdm trained linear", "steps", 16, 7, 30, 4.0, 160,
            model="mdm_linear"),
      _cell("mdm cosine s=16", "llada", "mdm trained cosine", "steps", 16, 8, 30, 4.0, 160,
            model="mdm_cosine"),
      _cell("mdm cosine s=1", "llada", "mdm trained cosine", "steps", 1, 2, 30, 0.3, 10,
            model="mdm_cosine"),
  ]


def test_summary_points_ratios_and_curves():
  training = {"mdm_linear": {"seconds": 12.0, "steps": 100, "final": {"eval/accuracy": 0.5}}}
  s = tradeoff.summarize(_cells(), config=_config(), training=training)
  curves = {c["curve"]: c for c in s["curves"]}
  # Points sorted by forwards per prompt; each ratio is tokens/s over AR's (30 tok/s) and the
  # accelerated AR's (60 tok/s).
  cosine = curves["llada cosine"]
  assert [p["label"] for p in cosine["points"]] == ["llada cosine s=4", "llada cosine s=16"]
  p = cosine["points"][0]
  assert p["nfe_per_prompt"] == 4.0 and p["tokens_per_forward"] == 0.75
  assert p["speedup_vs_ar"] == pytest.approx(1.0) and p["speedup_vs_accelerated_ar"] == 0.5
  assert p["knob_value"] == 4 and cosine["family"] == "llada" and cosine["schedule"] == "cosine"
  assert s["y_max_points"] == 100.0
  assert cosine["aup"] == pytest.approx(tradeoff.aup([(0.75, 90.0), (0.1875, 100.0)], 100.0))
  assert s["reference"]["accelerated_ar"]["speedup_vs_ar"] == pytest.approx(2.0)
  # The budgets are G / d; at 4 forwards cosine (9 correct) beats even (8); at 2 only the
  # one-step block diffusion fits; at 1 nothing does.
  assert s["budgets"] == [1, 2, 4, 8, 16]
  best = {b["budget"]: b["best"] for b in s["best_by_budget"]["all"]}
  assert best[4]["curve"] == "llada cosine" and best[4]["schedule"] == "cosine"
  assert best[2]["label"] == "block diffusion even s=1" and best[1] is None
  assert best[16]["label"] == "llada even s=16"  # ties: fewer forwards, then listed first
  assert best[16]["tied"] == ["llada even", "llada cosine"]  # both reach 10/10 within 16
  assert best[4]["tied"] == ["llada cosine"]
  llada = {b["budget"]: b["best"] for b in s["best_by_budget"]["llada"]}
  assert llada[2] is None
  # Training schedules: the record beside the decode accuracy at each step count.
  rows = {t["schedule"]: t for t in s["training_schedules"]}
  assert rows["linear"]["train_seconds"] == 12.0
  assert rows["linear"]["masked_token_accuracy"] == 0.5
  assert rows["cosine"]["accuracy_by_steps"] == {"1": 0.2, "16": 0.8}
  assert rows["cosine"]["train_seconds"] is None  # no record: reported as unknown
  text = tradeoff.summary_text(s)
  assert "| llada cosine | llada cosine s=4 | 90.0% | 4.00 | 0.75 | 30.0 | 1.00x | 0.50x |" \
      in text
  assert "cosine: llada cosine s=4, 90.0%" in text
  assert "even = cosine: llada even s=16, 100.0%" in text
  # The bend of each step-counted curve: fewest forwards against most (>= 10 points: bends).
  b = curves["llada even"]["bend"]
  assert (b["most_forwards"], b["fewest_forwards"]) == ("llada even s=16", "llada even s=4")
  assert b["drop_points"] == pytest.approx(20.0) and b["bends"]
  assert b["drop_ci95"] is None  # these cells stored no per-prompt results
  assert curves["mdm trained cosine"]["bend"]["drop_points"] == pytest.approx(60.0)
  assert curves["d2f threshold"]["bend"] is None  # a threshold sweep, not a step count
  assert curves["block diffusion even"]["bend"] is None  # one point
  assert "| llada even | llada even s=16: 100.0% | llada even s=4: 80.0% | +20.0 | yes |" \
      in text


def test_summary_recomputes_from_the_stored_cells():
  training = {"mdm_linear": {"seconds": 12.0, "steps": 100, "final": {}}}
  results = _cells()
  doc = accounting.results_json(results, machine={"platform": "cpu"}, config=_config(),
                                extra={"training": training})
  doc["tradeoff"] = tradeoff.summarize(results, config=_config(), training=training)
  tradeoff.check_recomputes(doc)
  doc["tradeoff"]["curves"][2]["aup"] += 1.0  # a figure written by hand
  with pytest.raises(ValueError, match="not the one its stored cells give"):
    tradeoff.check_recomputes(doc)


def test_plot_writes_three_panels(tmp_path):
  s = tradeoff.summarize(_cells(), config=_config(), training={})
  tradeoff.plot(s, str(tmp_path / "t.png"), title="t")
  assert (tmp_path / "t.png").stat().st_size > 10_000


# ----------------------------------------------------------------------------- config

def test_tradeoff_config_reuses_the_default_models_and_sweeps_every_schedule(tmp_path):
  """On the default mode's long worked answers (G = 32), with its models."""
  default, trade = _study_config(""), _study_config("tradeoff")
  # The default mode's models are the same training runs (so their cache is loaded).
  for name in ("ar", "mdm", "d2f", "ar_draft"):
    a = models_lib.training_config(default, name, tmp_path)
    b = models_lib.training_config(trade, name, tmp_path)
    assert config_lib.config_differences(config_lib.to_json(a), b) == [], name
  assert study.default_workdir(trade) == study.default_workdir(default) == "runs/study"
  assert trade.data.tasks == default.data.tasks
  # The drafter: the AR recipe at a smaller width; the schedule MDMs: the MDM recipe with
  # their alpha(t), all at the same steps and seed.
  draft = models_lib.training_config(trade, "ar_draft", tmp_path)
  diffs = config_lib.config_differences(
      config_lib.to_json(models_lib.training_config(trade, "ar", tmp_path)), draft)
  assert {d.split(":")[0] for d in diffs} == {f"model.{k}" for k in
                                              ("d_model", "n_layers", "n_heads", "n_kv_heads",
                                               "mlp_dim")}
  steps = {trade.models[f"mdm_{s}"].train.steps for s in trade.tradeoff.train_schedules}
  assert len(steps) == 1 and set(trade.tradeoff.train_schedules) == {"linear", "cosine",
                                                                     "polynomial"}
  mdm = config_lib.to_json(models_lib.training_config(trade, "mdm", tmp_path))
  for s in trade.tradeoff.train_schedules:
    assert trade.models[f"mdm_{s}"].objective.options["schedule"] == s
    diffs = config_lib.config_differences(
        mdm, models_lib.training_config(trade, f"mdm_{s}", tmp_path))
    # (train.steps is not compared: a resumed run may extend it; it is checked above)
    assert {d.split(":")[0] for d in diffs} == {"objective.options.schedule"}
  # Every curve of the step-counted decoders exists under all three unmasking schedules,
  # at k / d steps per block for each d that divides k; Fast-dLLM and D2F at the threshold
  # sweep; the accelerated AR beside AR.
  curves = {}
  for m in trade.methods:
    curves.setdefault(m["curve"], []).append(m)
  for family, k, key in (("llada", 32, "steps"), ("block diffusion", 16, "steps_per_block")):
    for schedule in unmasking.SCHEDULES:
      cells = curves[f"{family} {schedule}"]
      if schedule == "entropy_bound":
        assert [c["options"]["entropy_bound"] for c in cells] == list(
            trade.tradeoff.entropy_bounds)
      else:
        assert [c["options"][key] for c in cells] == [k // d for d in (1, 2, 4, 8, 16)
                                                      if k % d == 0]
      assert all(c["options"]["unmasking"] == schedule for c in cells)
  for curve, key in (("fast-dllm threshold", "threshold"), ("d2f threshold", "tau_conf")):
    assert [c["options"][key] for c in curves[curve]] == list(trade.tradeoff.thresholds)
  assert trade.eval.accelerated_ar_label in [c["label"] for c in curves["speculative ar"]]
  assert all(c["drafter"] == "ar_draft" for c in curves["speculative ar"])
  assert len({m["label"] for m in trade.methods}) == len(trade.methods)


def test_training_order_puts_sources_first():
  trade = _study_config("tradeoff")
  order = models_lib.training_order(trade)
  assert order[:3] == ["ar", "mdm", "d2f"] and sorted(order[3:]) == [
      "ar_draft", "mdm_cosine", "mdm_linear", "mdm_polynomial"]


def test_training_order_puts_a_started_model_after_its_source(monkeypatch):
  """A model of STARTS_FROM trains right after its source whatever the key order (the
  default mode's bd_draft after ar_draft; a ConfigDict lists its keys sorted)."""
  default = _study_config("")
  assert models_lib.training_order(default) == ["ar", "mdm", "d2f", "ar_draft", "bd_draft",
                                                "selfspec"]
  assert models_lib.init_source(default, "selfspec") == "ar"
  assert models_lib.init_source(default, "bd_draft") == "ar_draft"
  monkeypatch.setitem(models_lib.STARTS_FROM, "a_child", "z_source")
  fake = config_dict.ConfigDict({"models": {"a_child": {}, "ar": {}, "z_source": {}}})
  assert models_lib.training_order(fake) == ["ar", "z_source", "a_child"]


def test_tradeoff_flag_expands():
  assert study.expand_mode_flags(["study.py", "--tradeoff"]) == [
      "study.py", "--config=configs/study.py:tradeoff"]
  with pytest.raises(ValueError, match="one study mode"):
    study.expand_mode_flags(["study.py", "--tradeoff", "--short"])


# ----------------------------------------------------------------------------- end to end

def _micro_tradeoff():
  c = config_dict.ConfigDict(_study_config("tradeoff").to_dict())
  for name, m in c.models.items():
    m.train.steps, m.train.batch_size, m.train.log_every = 3, 8, 1
    m.opt.warmup_steps = 1
    m.model.d_model, m.model.n_layers, m.model.mlp_dim = 32, 1, 64
    m.model.n_heads = m.model.n_kv_heads = 2
    if name == "ar_draft":
      m.model.d_model, m.model.mlp_dim = 16, 32
  del c.models["mdm_polynomial"]
  c.tradeoff.train_schedules = ("linear", "cosine")
  c.data.train_size, c.data.eval_size = 64, 16
  c.eval.num_prompts = 3
  c.eval.timing_repeats = 1
  keep = {"ar", "speculative ar k=4", "llada even s=16", "llada even s=4", "llada cosine s=4",
          "llada entropy_bound=0.1", "block diffusion cosine s=2", "fast-dllm tau=0.9",
          "d2f tau=0.9", "mdm linear s=16", "mdm cosine s=16", "mdm cosine s=2"}
  c.methods = [m for m in c.methods if m["label"] in keep]
  return c


@pytest.mark.slow
def test_micro_tradeoff_end_to_end(tmp_path):
  doc = study.run(_micro_tradeoff(), tmp_path, log=lambda *_: None)
  for f in ("tradeoff.md", "tradeoff.json", "tradeoff.png"):
    assert (tmp_path / f).stat().st_size > 0
  assert len(doc["results"]) == 12
  stored = json.loads((tmp_path / "tradeoff.json").read_text())
  assert tradeoff.recompute(stored) == stored["tradeoff"]
  assert verdict.recompute(stored) == stored["verdict"]
  # Every model trained here has its training record (wall time, steps, final metrics).
  for name in ("ar", "ar_draft", "mdm", "d2f", "mdm_linear", "mdm_cosine"):
    record = stored["training"][name]
    assert record["steps"] == 3 and record["seconds"] > 0 and "eval/loss" in record["final"]
  for row in doc["tradeoff"]["training_schedules"]:  # the MDMs' masked-token eval accuracy
    assert row["masked_token_accuracy"] == stored["training"][row["model"]]["final"][
        "eval/accuracy"]
  # Speculative AR is AR's greedy output: the same answers and response tokens.
  by = {r["label"]: r for r in doc["results"]}
  spec, ar = by["speculative ar k=4"], by["ar"]
  assert (spec["num_correct"], spec["response_tokens"]) == (ar["num_correct"],
                                                            ar["response_tokens"])
  assert by["llada even s=4"]["nfe"] == 3 * 4  # steps=4 and no early stop, per prompt
  assert "Training noise schedules" in (tmp_path / "tradeoff.md").read_text()
