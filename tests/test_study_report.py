"""The study's accounting and report: what counts as a response token and a hit, the JSON
schema, the machine and CPU identity, the time line, and the Pareto front and plot."""

import json
import subprocess

import numpy as np
import pytest

from dllm_jax.data.tasks import TASK_ALPHABET, Example, TaskSuite
from dllm_jax.data.tokenizers import CharTokenizer
from studylib import accounting, report


def test_response_tokens_stop_at_eos_and_skip_padding_rows():
  tally = accounting.Tally("d2f", "x", {}, batch_size=4)
  # Two real rows, two rows repeated to fill the batch: only the first two count.
  tally.add(lengths=np.array([3, 5, 7, 7]), correct=[True, False, True, True], real_rows=2,
            wall_s=0.5, nfe=4, steps=4, tasks=["arithmetic", "sorting", "x", "x"])
  r = tally.result
  assert r.response_tokens == 8 and r.num_prompts == 2 and r.num_correct == 1
  assert r.tokens_per_s == pytest.approx(16.0)
  assert r.nfe_per_prompt == pytest.approx(4 * 4 / 2)  # a batched forward serves every row
  assert r.tokens_per_forward == pytest.approx(8 / 16)
  assert r.per_task == {"arithmetic": [1, 1], "sorting": [0, 1]}
  assert r.task_accuracy("sorting") == 0.0 and np.isnan(r.task_accuracy("between"))


def test_response_texts_cut_at_length_and_scoring():
  tok = CharTokenizer(TASK_ALPHABET)
  ids = np.array([tok.encode("85") + [tok.eos_id, tok.eos_id],
                  tok.encode("8+1=9") + [tok.eos_id] * 0][:1] * 2)
  texts = accounting.response_texts(tok, ids, np.array([2, 1]))
  assert texts == ["85", "8"]
  # Ids past the tokenizer's vocabulary (a padded model vocab) decode as U+FFFD.
  assert accounting.response_texts(tok, np.array([[tok.encode("8")[0], tok.vocab_size + 3,
                                                   tok.encode("5")[0]]]), np.array([3])) == \
      ["8\ufffd5"]
  suite = TaskSuite.parse("arithmetic:1")
  ex = Example("37+48=", "85", "85", "arithmetic")
  assert accounting.score(suite, [ex, ex], texts) == [True, False]
  assert accounting.score(suite, [ex], ["37+48=85"]) == [True]  # final answer after '='
  with pytest.raises(ValueError, match="responses"):
    accounting.score(suite, [ex, ex], ["85"])


def _result(label, method, b, acc, tps):
  r = accounting.MethodResult(method, label, {}, b, 10, int(10 * acc), int(tps), 1.0, 0.1,
                              5, 5, {"arithmetic": [int(10 * acc), 10]})
  return r


def test_json_schema_and_validation():
  rows = [_result("ar", "ar", 1, 0.9, 10), _result("d2f a", "d2f", 1, 0.8, 40)]
  doc = accounting.results_json(rows, machine=accounting.machine_info(), config={"a": 1})
  accounting.validate_json(json.loads(json.dumps(doc)))
  broken = json.loads(json.dumps(doc))
  del broken["results"][0]["tokens_per_s"]
  with pytest.raises(ValueError, match="tokens_per_s"):
    accounting.validate_json(broken)
  broken = json.loads(json.dumps(doc))
  broken["results"][1]["accuracy"] = 1.5
  with pytest.raises(ValueError, match="accuracy"):
    accounting.validate_json(broken)


CPUINFO_TWO_CORES = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse4_2 avx avx2 fma

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: another name
flags\t\t: fpu sse4_2 avx avx2 avx512f

"""


def test_cpu_identity_reads_the_first_processor():
  assert accounting.cpu_identity(CPUINFO_TWO_CORES) == {
      "cpu_model": "AMD EPYC", "cpu_family_model": "23/1", "cpu_simd": "avx2"}
  arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm\nCPU part\t: 0xd0c\n"
  assert accounting.cpu_identity(arm)["cpu_simd"] == "asimd"
  bare = accounting.cpu_identity("")  # not Linux: the architecture, nothing else
  assert bare["cpu_family_model"] is None and bare["cpu_simd"] is None and bare["cpu_model"]
  machine = accounting.machine_info()
  assert set(accounting.cpu_identity()) <= set(machine)


def test_code_revision_names_the_commit_and_a_dirty_tree(tmp_path):
  assert accounting.code_revision(tmp_path) is None  # not a git checkout
  git = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, check=True,  # noqa: E731
                                     capture_output=True, text=True).stdout.strip()
  git("init", "-q")
  (tmp_path / "a.txt").write_text("one\n")
  git("add", "a.txt")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
  head = git("rev-parse", "--short=12", "HEAD")
  assert accounting.code_revision(tmp_path) == head
  (tmp_path / "b.txt").write_text("untracked files leave the code as it was\n")
  assert accounting.code_revision(tmp_path) == head
  (tmp_path / "a.txt").write_text("two\n")
  assert accounting.code_revision(tmp_path) == head + "+dirty"
  assert "code_revision" in accounting.machine_info()


def test_time_text_splits_the_wall_time_and_lists_training_records():
  doc = {"machine": {"platform": "cpu", "processor": "x86_64", "cpu_count": 2,
                     **accounting.cpu_identity(CPUINFO_TWO_CORES)},
         "total_s": 1982.4, "train_or_load_s": 1696.2,
         "training": {"ar": {"seconds": 354.2, "steps": 900, "first_step": 0, "final": {}},
                      "mdm": {"seconds": 250.0, "steps": 1500, "first_step": 1000, "final": {}},
                      "old": None}}
  assert report.time_text(doc).splitlines() == [
      "Time: 1982 s in all on AMD EPYC (family/model 23/1, avx2; 2 CPUs): 1696 s building the "
      "data and training or loading the models, 286 s decoding (calibration included).",
      "Training records (a model loaded from the cache shows the run that trained it): ar 900 "
      "steps in 354 s (2.54 steps/s), mdm 1500 steps, the last 500 (resumed at step 1000) in "
      "250 s (2.00 steps/s), old (no record: trained before records were kept)."]
  del doc["training"]["ar"]["first_step"]  # a record written before first_step was kept
  assert "ar 900 steps in 354 s (2.54 steps/s)" in report.time_text(doc)
  doc["decode_restored_rounds"] = {"1": 0}  # decoded in one go: nothing said
  assert "Decoding resumed" not in report.time_text(doc)
  doc["decode_restored_rounds"] = {"1": 40, "16": 0}
  assert report.time_text(doc).splitlines()[-1] == (
      "Decoding resumed: 40 batch-1 rounds were timed by the interrupted run and replayed "
      "from its journal (each round's cells side by side).")
  del doc["decode_restored_rounds"]
  doc["machine"].update(platform="gpu", device_count=1, device_kind="NVIDIA H200",
                        cpu_family_model=None, cpu_simd=None)
  del doc["training"]
  assert report.time_text(doc) == (
      "Time: 1982 s in all on AMD EPYC (2 CPUs), decoding on 1 x NVIDIA H200: 1696 s building "
      "the data and training or loading the models, 286 s decoding (calibration included).")


def test_pareto_front():
  rows = [_result("ar", "ar", 1, 0.9, 10), _result("llada", "llada", 1, 0.9, 1),
          _result("d2f fast", "d2f", 1, 0.6, 50), _result("d2f good", "d2f", 1, 0.9, 30),
          _result("d2f b16", "d2f", 16, 0.9, 300)]
  assert {r.label for r in report.pareto_front(rows)} == {"d2f fast", "d2f good", "d2f b16"}


def test_pareto_accuracy_window_and_plot_from_saved_json(tmp_path):
  lo, hi, below = report.accuracy_window([100.0, 99.2, 98.4, 9.4])
  assert below == [3] and 97.0 < lo < 98.4 and hi == 100.5  # the 9% cell sits on the edge
  lo, hi, below = report.accuracy_window([90.0, 80.0])
  assert below == [] and lo < 80.0 and hi == 90.5
  assert report.accuracy_window([0.0, 0.0])[0] == 0.0
  # most cells far below the best (the long mode's undertrained diffusion cells): all shown
  lo, hi, below = report.accuracy_window([100.0, 42.2, 4.7, 0.0, 56.2, 27.3, 100.0])
  assert below == [] and lo == 0.0 and hi == 100.5
  # Cells rebuilt from a study JSON row give the same figures and redraw the plot.
  rows = [_result("ar", "ar", 1, 1.0, 10), _result("llada", "llada", 1, 0.9, 1),
          _result("d2f", "d2f", 1, 0.1, 30), _result("ar", "ar", 16, 1.0, 40)]
  doc = accounting.results_json(rows, machine={}, config={})
  again = [accounting.MethodResult.from_json(r) for r in json.loads(json.dumps(doc))["results"]]
  assert [(r.tokens_per_s, r.accuracy, r.nfe_per_prompt) for r in again] == [
      (r.tokens_per_s, r.accuracy, r.nfe_per_prompt) for r in rows]
  report.pareto_plot(again, str(tmp_path / "p.png"), baseline="ar", llada_label="llada")
  assert (tmp_path / "p.png").stat().st_size > 10_000
