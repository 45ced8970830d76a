"""The study: binding cells to decoders, the runner's timing, calibration, and seconds-long
end-to-end runs (its accounting and report: test_study_report.py)."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import config_dict

from dllm_jax.data.tasks import Example, TaskSuite
from dllm_jax.data.tokenizers import CharTokenizer
from dllm_jax.data.tasks import TASK_ALPHABET
from dllm_jax.models import forward, get_preset, init_params
from dllm_jax.models.lora import add_lora, has_lora
from dllm_jax.decoding.base import DecodeOutput
from dllm_jax.training.checkpoint import CheckpointError, TrainedModel
from studylib import accounting, report, router, runner, study, verdict
from studylib import journal as journal_lib
from studylib import models as models_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_for_decoding_merges_adapters_into_the_same_logits():
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0))
  lcfg, lparams = add_lora(params, cfg, jax.random.key(1), rank=4, alpha=8.0)
  lparams = jax.tree.map(lambda x: x + 0.05, lparams)  # nonzero lora_b: a real adapter
  trained = TrainedModel(lparams, lcfg, config_dict.ConfigDict())
  merged = models_lib.for_decoding(trained)
  assert merged.model_cfg.lora_rank == 0 and not has_lora(merged.params)
  tokens = jnp.arange(10, dtype=jnp.int32)[None] % cfg.vocab_size
  want = forward(lparams, lcfg, tokens, attention="bidirectional")
  got = forward(merged.params, merged.model_cfg, tokens, attention="bidirectional")
  assert float(jnp.max(jnp.abs(want - forward(params, cfg, tokens,
                                              attention="bidirectional")))) > 1e-2
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert models_lib.for_decoding(merged) is merged  # nothing to merge: unchanged
  bounded = models_lib.with_active_vocab(merged, 40)
  assert bounded.model_cfg.active_vocab_size == 40 and bounded.params is merged.params
  assert models_lib.with_active_vocab(merged, cfg.vocab_size) is merged


def test_bind_cell_gives_speculative_its_drafter():
  """A speculative cell decodes with the AR model as target and the named study model as
  drafter (greedy: AR's tokens exactly); the setting names the drafter, never its params."""
  cfg = get_preset("tiny").replace(mask_token_id=3, eos_token_id=2, vocab_size=64)
  ar = TrainedModel(init_params(cfg, jax.random.key(0)), cfg, None)
  drafter = TrainedModel(init_params(cfg, jax.random.key(1)), cfg, None)
  trained = {"ar": ar, "d2f": drafter}
  cell = {"method": "speculative", "label": "spec", "model": "ar", "drafter": "d2f",
          "options": {"drafter": "d2f", "draft_length": 4}}
  decode, params, setting = study.bind_cell(cell, trained, 8)
  assert params is ar.params
  assert setting == {"model": "ar", "drafter_model": "d2f", "gen_length": 8, "drafter": "d2f",
                     "draft_length": 4}
  tokens = np.arange(4, 10, dtype=np.int32)[None]
  valid = np.ones_like(tokens, bool)
  got = decode(params, tokens, valid, jax.random.key(0))
  ar_decode, ar_params, _ = study.bind_cell(
      {"method": "ar", "label": "ar", "model": "ar", "options": {}}, trained, 8)
  want = ar_decode(ar_params, tokens, valid, jax.random.key(0))
  np.testing.assert_array_equal(got.tokens, want.tokens)
  with pytest.raises(ValueError, match="needs 'drafter' naming one of"):
    study.bind_cell({**cell, "drafter": "mdm"}, trained, 8)
  with pytest.raises(ValueError, match="'drafter' applies to"):
    study.bind_cell({"method": "ar", "label": "x", "model": "ar", "drafter": "d2f"}, trained, 8)


def test_bind_cell_gives_adaptive_its_drafter_and_task_tags():
  """An adaptive cell binds the D2F student as drafter; with task_tags its decoder takes each
  row's task name, and a task forced to verify (or AR) decodes AR's tokens exactly, while an
  untagged row is left to the rule."""
  cfg = get_preset("tiny").replace(mask_token_id=3, eos_token_id=2, vocab_size=64)
  ar = TrainedModel(init_params(cfg, jax.random.key(0)), cfg, None)
  drafter = TrainedModel(init_params(cfg, jax.random.key(1)), cfg, None)
  trained = {"ar": ar, "d2f": drafter}
  cell = {"method": "adaptive", "label": "adaptive tags", "model": "ar", "drafter": "d2f",
          "task_tags": True, "options": {"draft_length": 4, "task_modes": {
              "running_sum": "verify", "arithmetic": "ar", "sorting": "auto"}}}
  decode, params, setting = study.bind_cell(cell, trained, 8)
  assert params is ar.params
  assert setting["drafter_model"] == "d2f" and setting["task_tags"] is True
  assert "drafter_params" not in setting
  tokens = np.stack([np.arange(4, 10), np.arange(11, 17)]).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  ar_decode, ar_params, _ = study.bind_cell(
      {"method": "ar", "label": "ar", "model": "ar", "options": {}}, trained, 8)
  want = ar_decode(ar_params, tokens, valid, jax.random.key(0))
  got = decode(params, tokens, valid, jax.random.key(0), tasks=["running_sum", "arithmetic"])
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.modes, [1, 2])  # verify, AR: as the tags force
  got = decode(params, tokens, valid, jax.random.key(0), tasks=["sorting", "sorting"])
  assert set(np.asarray(got.modes).tolist()) <= {0, 1, 2}  # the rule's choice
  with pytest.raises(ValueError, match="unknown task tag 'between'"):
    decode(params, tokens, valid, jax.random.key(0), tasks=["between", "sorting"])
  with pytest.raises(ValueError, match="task_tags applies to"):
    study.bind_cell({"method": "ar", "label": "x", "model": "ar", "task_tags": True,
                     "options": {}}, trained, 8)


def test_resolve_options():
  assert study.resolve_options({"steps_fraction": 0.5}, 16) == {"gen_length": 16, "steps": 8}
  with pytest.raises(ValueError, match="steps_fraction"):
    study.resolve_options({"steps_fraction": 0}, 16)
  # Block lengths given as a share of G (vanilla LLaDA's one block, Fast-dLLM's two).
  assert study.resolve_options({"block_fraction": 1, "steps_fraction": 0.5}, 384) == {
      "gen_length": 384, "block_length": 384, "steps": 192}
  assert study.resolve_options({"block_fraction": 0.5}, 192)["block_length"] == 96
  for bad in (0, 1.5, 0.3):  # 0.3 * 16 is no whole block
    with pytest.raises(ValueError, match="block_fraction"):
      study.resolve_options({"block_fraction": bad}, 16)
  with pytest.raises(ValueError, match="not both"):
    study.resolve_options({"block_fraction": 1, "block_length": 16}, 16)


def _study_config(mode: str) -> config_dict.ConfigDict:
  """An unlocked copy of configs/study.py's config of `mode`."""
  spec = importlib.util.spec_from_file_location("study_cfg", os.path.join(ROOT, "configs",
                                                                          "study.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return config_dict.ConfigDict(module.get_config(mode).to_dict())


def _micro_config():
  c = _study_config("short")
  _shrink_models(c)
  c.data.train_size, c.data.eval_size = 64, 16
  c.eval.num_prompts = 3
  c.eval.batch_sizes = (1, 2)
  keep = {"ar", "llada steps=G", "llada steps=G/2", "fast-dllm tau=0.9 dual",
          "d2f k=4 tau=0.9", "block diffusion k=4", "speculative d2f k=4", "adaptive k=4",
          "speculative ar k=4"}
  c.methods = [m for m in c.methods if m["label"] in keep]
  return c


def _shrink_models(c):
  for name, m in c.models.items():
    m.train.steps, m.train.batch_size, m.train.log_every = 3, 8, 1
    m.opt.warmup_steps = 1
    m.model.d_model, m.model.n_layers, m.model.mlp_dim = 32, 1, 64
    m.model.n_heads = m.model.n_kv_heads = 2


@pytest.mark.slow
def test_micro_study_end_to_end(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # a relative workdir, as the README command passes
  doc = study.run(_micro_config(), "study", log=lambda *_: None)
  tmp_path = tmp_path / "study"
  accounting.validate_json(doc)
  host = doc["host"]  # wall time beside process CPU time and the host's steal
  assert host["wall_s"] == doc["total_s"] and host["process_cpu_s"] > 0
  assert host["host_steal_frac"] is None or 0 <= host["host_steal_frac"] <= 1
  for f in ("study.md", "study.json", "study_pareto.png"):
    assert (tmp_path / f).stat().st_size > 0
  assert len(doc["results"]) == 9 * 2
  g = doc["gen_length"]
  for row in doc["results"]:
    assert row["num_prompts"] == 3
    assert 0 <= row["response_tokens"] <= 3 * g
    if row["label"] == "llada steps=G" and row["batch_size"] == 1:
      # One token per step and no early exit before every slot is decided or EOS is final.
      assert row["nfe"] <= 3 * g
  # Deterministic decoders give the same answers at batch 1 and batch 2.
  by = {(r["label"], r["batch_size"]): r for r in doc["results"]}
  for label in {r["label"] for r in doc["results"]}:
    assert by[(label, 1)]["num_correct"] == by[(label, 2)]["num_correct"], label
    assert by[(label, 1)]["response_tokens"] == by[(label, 2)]["response_tokens"], label
  # AR at batch 1 against the weight-streaming bound of its own weights.
  ar1 = by[("ar", 1)]
  bound = doc["roofline"]
  assert bound["measured_step_s"] == pytest.approx(ar1["wall_s"] / ar1["nfe"])
  assert bound["weight_read_s"] == pytest.approx(
      bound["param_bytes"] / (bound["bandwidth_gbps"] * 1e9))
  assert bound["param_bytes"] > 0 and 0 < bound["fraction_of_bound"]
  assert "weight-streaming bound" in (tmp_path / "study.md").read_text()
  # The stored verdict is the one the stored cells give, every claim named.
  stored = json.loads((tmp_path / "study.json").read_text())
  assert verdict.recompute(stored) == stored["verdict"]
  assert [c["id"] for c in stored["verdict"]["claims"]] == [c.id for c in verdict.CLAIMS]
  # The accelerated AR (speculative AR, narrow AR drafter) writes AR's greedy answers, and
  # every claim against AR also carries its figures against it.
  spec_ar, ar = by[("speculative ar k=4", 1)], by[("ar", 1)]
  assert (spec_ar["num_correct"], spec_ar["response_tokens"]) == (ar["num_correct"],
                                                                  ar["response_tokens"])
  d2f_claim = next(c for c in stored["verdict"]["claims"] if c["id"] == "d2f_vs_ar")
  assert d2f_claim["cells"] and all(
      c["vs_accelerated_ar"]["baseline"] == "speculative ar k=4" for c in d2f_claim["cells"])
  # Every model's training record, and where the wall time went, on which CPU.
  config = _micro_config()
  assert list(stored["training"]) == models_lib.training_order(config)
  for name, record in stored["training"].items():
    assert record["steps"] == config.models[name].train.steps and record["seconds"] > 0
    assert record["first_step"] == 0  # trained in one go
    assert record == models_lib.train_record(tmp_path, name)
  assert 0 < stored["train_or_load_s"] < stored["total_s"]
  assert stored["machine"]["cpu_model"]
  assert (tmp_path / "study.md").read_text().endswith(report.time_text(stored) + "\n")
  # A finished study leaves no decode journal: a rerun times every cell afresh.
  assert stored["decode_restored_rounds"] == {"1": 0, "2": 0}
  assert not (tmp_path / study.JOURNAL_DIR).exists()
  # A second run is killed while decoding: after batch 1's first round (9 cells), one cell into
  # its second.
  record, recorded = journal_lib.Journal.record, []

  def record_then_die(self, *args):
    record(self, *args)
    recorded.append(args)
    if len(recorded) == 9 + 1:
      raise KeyboardInterrupt
  with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
    patch.setattr(journal_lib.Journal, "record", record_then_die)
    study.run(_micro_config(), "study", log=lambda *_: None)
  assert [p.name for p in (tmp_path / study.JOURNAL_DIR).iterdir()] == ["batch1.jsonl"]
  # The third run loads the cached models instead of training (their records stay the run's
  # that trained them) and replays the finished rounds: every count is the first run's.
  logs = []
  again = study.run(_micro_config(), "study", log=logs.append)
  assert any("cached model" in line for line in logs)
  assert any("batch 1: 1 of 3 rounds restored" in line for line in logs)
  assert again["decode_restored_rounds"] == {"1": 1, "2": 0}
  assert not (tmp_path / study.JOURNAL_DIR).exists()
  counts = ("num_prompts", "num_correct", "response_tokens", "nfe", "loop_steps", "per_task")
  assert [[r[k] for k in counts] for r in again["results"]] == [
      [r[k] for k in counts] for r in doc["results"]]
  assert again["training"] == stored["training"]
  assert again["train_or_load_s"] < stored["train_or_load_s"]
  # A cached model trained with another config is refused, never silently reused.
  changed = _micro_config()
  with changed.unlocked():
    changed.models.ar.opt.lr = 0.5
  with pytest.raises(CheckpointError, match=r"(?s)cached ar model.*opt\.lr: .* -> 0\.5"):
    study.run(changed, "study", log=lambda *_: None)


@pytest.mark.slow
def test_default_study_calibrates_its_task_tags_on_held_out_prompts(tmp_path):
  """The default (mixed-suite) mode's task-tagged adaptive cell gets its tag -> mode map from
  the calibration split: records after the evaluation prompts; every task of the suite gets
  the mode choose_task_modes picks from the stored figures; the stored verdict is the one the
  stored cells give."""
  from studylib import adaptive_calibration
  from studylib import calibration
  c = _study_config("")
  _shrink_models(c)
  c.data.train_size, c.data.eval_size = 64, 40
  c.eval.num_prompts, c.eval.calibration_prompts, c.eval.timing_repeats = 4, 24, 1
  oracle, routed = "adaptive k=16 task tags (oracle upper bound)", "adaptive k=16 prompt router"
  c.methods = [m for m in c.methods if m["label"] in ("ar", oracle, routed)]
  doc = study.run(c, tmp_path, log=lambda *_: None)
  record = doc["calibration"][oracle]
  tasks = {t.split(":")[0] for t in c.data.tasks.split(",")}
  assert set(record["task_modes"]) <= tasks and record["prompts"] == 24
  assert sum(record["prompts_per_task"].values()) == 24
  ar_accuracy = {t: f["accuracy"] for t, f in record["ar"].items()}
  trials = {m: {t: (f["accuracy"], f["tokens_per_s"]) for t, f in per.items()}
            for m, per in record["modes"].items()}
  assert record["task_modes"] == adaptive_calibration.choose_task_modes(
      ar_accuracy, trials, tolerance=record["tolerance"])
  row = next(r for r in doc["results"] if r["label"] == oracle)
  assert row["setting"]["calibrated"] is True and row["setting"]["task_tags"] is True
  assert verdict.recompute(json.loads((tmp_path / "study.json").read_text())) == doc["verdict"]
  assert f"Calibration of {oracle!r}" in (tmp_path / "study.md").read_text()
  # The router: fitted on the calibration prompts' formats; the oracle shown, never judged.
  routed_record = doc["calibration"][routed]
  formats = {router.prompt_format(e.prompt)
             for e in calibration.calibration_examples(models_lib.study_data(c, tmp_path), 4,
                                                       24)}
  assert set(routed_record["formats"]) == formats
  assert routed_record["task_modes"][router.UNSEEN] == "ar"
  row = next(r for r in doc["results"] if r["label"] == routed)
  assert row["setting"]["router"] == "prompt_format" and "task_tags" not in row["setting"]
  claim = next(x for x in doc["verdict"]["claims"] if x["id"] == "adaptive_switching")
  assert [x["label"] for x in claim["cells"]] == [routed]
  assert [x["label"] for x in claim["oracle"]] == [oracle]
  # The calibration split never overlaps the evaluation prompts, and must fit the eval split.
  data = models_lib.study_data(c, tmp_path)
  held = calibration.calibration_examples(data, 4, 24)
  evaluated = study.held_out(c, tmp_path)[3]
  assert not {e.prompt for e in held} & {e.prompt for e in evaluated}
  with pytest.raises(ValueError, match="raise data.eval_size or lower"):
    calibration.calibration_examples(data, 4, 37)
  other = [dataclasses.replace(e, prompt=e.prompt + "0", task="between") for e in held[:1]]
  with pytest.raises(ValueError, match=r"no prompt of tasks \['between'\]"):
    calibration.calibrate_cells(c.methods, None, examples=held, eval_examples=other,
                                layout=None, suite=None, batch_size=1, tolerance=0.0, seed=0,
                                repeats=1)
  with pytest.raises(ValueError, match="calibration prompts are also evaluation prompts"):
    calibration.calibrate_cells(c.methods, None, examples=held, eval_examples=held[:1],
                                layout=None, suite=None, batch_size=1, tolerance=0.0, seed=0,
                                repeats=1)


def test_a_calibration_split_the_eval_split_cannot_hold_is_refused_before_training(tmp_path):
  """Named before any model trains (not after ten minutes), and one line from the CLI."""
  c = _study_config("")
  c.data.eval_size = 100
  with pytest.raises(study.StudyConfigError, match=r"eval.num_prompts=160 evaluation prompts "
                                                   r"plus eval.calibration_prompts=192 .*"
                                                   r"data.eval_size=100"):
    study.run(c, tmp_path / "w", log=lambda *_: None)
  assert not (tmp_path / "w").exists()
  script = os.path.join(ROOT, "experiments", "study.py")
  proc = subprocess.run([sys.executable, script, "--config.data.eval_size=100",
                         f"--workdir={tmp_path}/w"], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "experiments/study.py: eval.num_prompts=160 evaluation prompts")
  assert not (tmp_path / "w").exists()


def test_bind_cell_refuses_an_uncalibrated_cell():
  cell = {"method": "adaptive", "label": "a", "model": "ar", "drafter": "d2f",
          "task_tags": True, "calibrate": True, "options": {"draft_length": 4}}
  with pytest.raises(ValueError, match="fitted by the study's calibration step"):
    study.bind_cell(cell, {"ar": None, "d2f": None}, 8)


def answered(tokens, offset: int, nfe: int | None = None, steps: int = 1) -> DecodeOutput:
  """A fake decoder's output for RowIndexLayout rows: prompt i answered `i + offset`, with
  `nfe` forwards (default: the batch's first prompt index + 1)."""
  tok = RowIndexLayout.tokenizer
  answers = [tok.encode(str(int(r[0]) + offset)) for r in tokens]
  out = np.zeros((len(answers), max(map(len, answers))), np.int32)
  for r, a in enumerate(answers):
    out[r, :len(a)] = a
  n = np.array([len(a) for a in answers])
  return DecodeOutput(tokens=out, lengths=n,
                      nfe=np.array(int(tokens[0, 0]) + 1 if nfe is None else nfe),
                      steps=np.array(steps), committed=n, done=np.ones(len(answers), bool))


class RowIndexLayout:
  """A layout whose encoded prompt i is a row of i's: a fake decoder can tell which prompt it
  got (the runner's tests; test_study_journal.py too)."""
  tokenizer = CharTokenizer(TASK_ALPHABET)

  def encode_prompts(self, prompts, length):
    rows = np.repeat(np.arange(len(prompts))[:, None], length, 1).astype(np.int32)
    return {"tokens": rows, "valid": np.ones_like(rows, bool)}


def test_run_cells_interleaves_batches_and_keeps_the_fastest_repeat():
  examples = [Example(f"{i}+1=", str(i + 1), str(i + 1), "arithmetic") for i in range(5)]

  calls = []

  def decoder(label, offset):
    def decode(params, tokens, valid, rng):
      first = int(tokens[0, 0])
      calls.append((label, first))
      if len(calls) % 2:  # every other call is slow: the fastest repeat must be the one kept
        time.sleep(0.02)
      return answered(tokens, offset, nfe=3, steps=3)
    return decode

  cells = [runner.Cell(decoder("good", 1), None, "ar", "good", {}, 2),
           runner.Cell(decoder("bad", 2), None, "d2f", "bad", {}, 2)]
  good, bad = runner.run_cells(cells, layout=RowIndexLayout(),
                               suite=TaskSuite.parse("arithmetic:1"),
                               examples=examples, prompt_len=4, repeats=2)
  compile_calls, timed = calls[:2], calls[2:]
  assert compile_calls == [("good", 0), ("bad", 0)]
  # Round-robin by batch, the cells' order rotating each round.
  order = {0: ("good", "good", "bad", "bad"), 2: ("bad", "bad", "good", "good")}
  assert timed == [(label, b) for b in (0, 2, 4) for label in order[b % 4]]
  assert runner.rotated(3, 0) == [0, 1, 2] and runner.rotated(3, 4) == [1, 2, 0]
  assert (good.num_correct, bad.num_correct) == (5, 0)
  assert good.num_prompts == bad.num_prompts == 5 and good.nfe == 9
  assert good.response_tokens == sum(len(str(i + 1)) for i in range(5))
  assert good.wall_s < 0.02 and bad.wall_s < 0.02  # every batch had one fast repeat
  assert good.wall_median_s > 0.02  # ... and one slow one, which the median keeps
  with pytest.raises(ValueError, match="one batch size"):
    runner.run_cells([cells[0], dataclasses.replace(cells[1], batch_size=4)],
                     layout=RowIndexLayout(),
                     suite=None, examples=examples, prompt_len=4)
  with pytest.raises(ValueError, match="repeats"):
    runner.run_cells(cells, layout=RowIndexLayout(), suite=None, examples=examples, prompt_len=4,
                     repeats=0)


def test_run_cells_passes_task_tags_and_times_each_task():
  """A task_tags cell gets the task name of every row it decodes (padding rows repeat
  prompts, and their names); at batch 1 each task's tokens, time, forwards and prompts are
  tallied on their own, and the per-task table reads them."""
  examples = [Example(f"{i}+1=", str(i + 1), str(i + 1), "arithmetic" if i % 2 else "sorting")
              for i in range(5)]

  seen = []

  def decode(params, tokens, valid, rng, tasks=None):
    seen.append((tokens[:, 0].tolist(), tasks))
    return answered(tokens, 1)

  suite = TaskSuite.parse("arithmetic:1,sorting:1")
  (tagged,) = runner.run_cells([runner.Cell(decode, None, "adaptive", "a", {}, 2,
                                            task_tags=True)],
                               layout=RowIndexLayout(), suite=suite, examples=examples,
                               prompt_len=3)
  names = [ex.task for ex in examples]
  assert seen[0] == ([0, 1], names[:2])  # the untimed compile call
  assert seen[1:] == [([0, 1], names[:2]), ([2, 3], names[2:4]), ([4, 0], [names[4], names[0]])]
  # Only the last batch (row 4 and a padding row) has one real task: it alone is timed.
  assert list(tagged.per_task_time) == ["sorting"]
  assert [tagged.per_task_time["sorting"][i] for i in (0, 2, 4)] == [1, 5, 1]
  seen.clear()
  (one,) = runner.run_cells([runner.Cell(decode, None, "ar", "ar", {}, 1)],
                            layout=RowIndexLayout(),
                            suite=suite, examples=examples, prompt_len=3)
  assert all(tasks is None for _, tasks in seen)  # an untagged cell gets no tags
  timed = one.per_task_time
  assert sorted(timed) == ["arithmetic", "sorting"]
  # [response tokens, wall, forwards, median wall, prompts]: sorting rows 0, 2, 4 answer
  # 1, 3, 5 (one token each, forwards 1 + 3 + 5), arithmetic rows 1, 3 answer 2, 4.
  assert (timed["sorting"][0], timed["sorting"][2], timed["sorting"][4]) == (3, 9, 3)
  assert (timed["arithmetic"][0], timed["arithmetic"][2], timed["arithmetic"][4]) == (2, 6, 2)
  assert sum(v[1] for v in timed.values()) == pytest.approx(one.wall_s)
  assert one.task_tokens_per_s("sorting") == pytest.approx(3 / timed["sorting"][1])
  table = report.per_task_table([one], baseline="ar")
  assert "| ar | 100.0%, 1.00x [1.00, 1.00] | 100.0%, 1.00x [1.00, 1.00] |" in table
  assert report.per_task_table([dataclasses.replace(one, per_task={"a": [1, 1]})]) == ""
