"""dllm_jax.data.gsm8k against lm-evaluation-harness itself: the same n-shot prompts as its
`gsm8k` task builds from a local JSONL, and the same strict / flexible verdicts as its filters
and exact_match metric give on tricky responses."""

import json

import numpy as np
import pytest
import yaml

from dllm_jax.data import gsm8k

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.metrics import exact_match_hf_evaluate  # noqa: E402
from lm_eval.filters.extraction import RegexFilter  # noqa: E402
from lm_eval.filters.selection import TakeFirstFilter  # noqa: E402


def _records(n, offset=0):
  return [{"question": f"Tom has {i + offset} apples and buys {2 * i + 1}. How many now?",
           "answer": f"He has {i + offset}+{2 * i + 1}=<<{i + offset}+{2 * i + 1}="
                     f"{3 * i + 1 + offset}>>{3 * i + 1 + offset} apples.\n"
                     f"#### {3 * i + 1 + offset:,}"} for i in range(n)]


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def _lm_eval_task(tmp_path, files: dict, fewshot_split: str):
  """lm-eval's own gsm8k task, pointed at local JSONL splits (nothing is downloaded)."""
  from lm_eval.api.task import ConfigurableTask
  with open(f"{lm_eval.__path__[0]}/tasks/gsm8k/gsm8k.yaml") as f:
    config = yaml.safe_load(f)
  config.pop("tag", None)
  config.update(task="gsm8k_local", dataset_path="json", dataset_name=None,
                dataset_kwargs={"data_files": {k: str(v) for k, v in files.items()},
                                "cache_dir": str(tmp_path / "hf_cache")},
                training_split="train" if "train" in files else None,
                fewshot_split=fewshot_split)
  task = ConfigurableTask(config=config)
  task.set_fewshot_seed(gsm8k.FEWSHOT_SEED)
  return task


@pytest.mark.parametrize("pool", ["test", "train"])
def test_prompts_equal_lm_eval_gsm8k_contexts(tmp_path, pool):
  test = _write(tmp_path / "test.jsonl", _records(16))
  files = {"test": test}
  if pool == "train":
    files["train"] = _write(tmp_path / "train.jsonl", _records(12, offset=100))
  task = _lm_eval_task(tmp_path, files, fewshot_split=pool)
  want = [task.fewshot_context(doc, num_fewshot=4) for doc in task.test_docs()]
  problems = gsm8k.read(test)
  if pool == "train":
    got = gsm8k.fewshot_prompts(problems, gsm8k.read(files["train"]), n_shot=4)
  else:
    got = gsm8k.fewshot_prompts(problems, n_shot=4)
  assert got == want
  assert gsm8k.UNTIL == tuple(task.config.generation_kwargs["until"])


# Responses that exercise every filter step and normalisation: commas and dollars, trailing
# periods, negative and decimal numbers, no number at all, several "####", text after the
# answer, an answer only the flexible extract finds, case, a stop string in the middle.
TRICKY = [
    "She pays 3*4=12 dollars.\n#### 12",
    "#### 1,234",
    "The total is $1,234.",
    "#### $1,234.",
    "So the answer is 12.\nQuestion: next one #### 99",
    "#### -5",
    "It drops by 5, to -5",
    "#### 2.50",
    "The cost is 2.5",
    "no digits here",
    "#### 12 #### 13",
    "The answer is 7",
    "#### 7 apples",
    "3 + 4 = 7. Then 7 * 2 = 14.\n\n#### 14</s>garbage 15",
    "",
    "####12",
    "The ANSWER: 1,000,000",
    "#### 1,000,000.",
    "a 5.",
    "Result .5",
]
REFERENCES = ["x\n#### 12", "x\n#### 1,234", "x\n#### 1234", "x\n#### 1234", "x\n#### 12",
              "x\n#### -5", "x\n#### -5", "x\n#### 2.50", "x\n#### 2.5", "x\n#### 3",
              "x\n#### 12", "x\n#### 7", "x\n#### 7", "x\n#### 14", "x\n#### 0", "x\n#### 12",
              "x\n#### 1000000", "x\n#### 1,000,000", "x\n#### 5", "x\n#### .5"]


def _lm_eval_scores(responses, references):
  """lm-eval's pipeline: until cut (its HF model), then each filter, then exact_match."""
  cut = [gsm8k.cut(r, gsm8k.UNTIL) for r in responses]
  out = {}
  for name, pattern, group in (("strict", gsm8k.STRICT_PATTERN, 0),
                               ("flexible", gsm8k.FLEXIBLE_PATTERN, -1)):
    filtered = RegexFilter(regex_pattern=pattern, group_select=group).apply(
        [[r] for r in cut], None)
    preds = list(TakeFirstFilter().apply(filtered, None))
    out[name] = [bool(exact_match_hf_evaluate(
        [p], [ref], regexes_to_ignore=list(gsm8k.IGNORE), ignore_case=True,
        ignore_punctuation=False)["exact_match"]) for p, ref in zip(preds, references)]
  return out


def test_scorer_agrees_with_lm_eval_filters_and_metric():
  want = _lm_eval_scores(TRICKY, REFERENCES)
  got = [gsm8k.score(r, ref) for r, ref in zip(TRICKY, REFERENCES)]
  assert [g["strict"] for g in got] == want["strict"]
  assert [g["flexible"] for g in got] == want["flexible"]
  # Both filters say something on this set: neither list is constant.
  assert len(set(want["strict"])) == 2 and len(set(want["flexible"])) == 2
  assert sum(want["flexible"]) > sum(want["strict"])


def test_task_yaml_holds_the_restated_settings():
  with open(f"{lm_eval.__path__[0]}/tasks/gsm8k/gsm8k.yaml") as f:
    config = yaml.safe_load(f)
  metric = config["metric_list"][0]
  assert tuple(metric["regexes_to_ignore"]) == gsm8k.IGNORE
  assert metric["ignore_case"] and not metric["ignore_punctuation"]
  filters = {f["name"]: f["filter"][0] for f in config["filter_list"]}
  assert filters["strict-match"]["regex_pattern"] == gsm8k.STRICT_PATTERN
  assert filters["flexible-extract"]["regex_pattern"] == gsm8k.FLEXIBLE_PATTERN
  assert filters["flexible-extract"]["group_select"] == -1
  assert config["doc_to_text"] == gsm8k.question_text("{{question}}")


def test_read_jsonl_parquet_and_limit(tmp_path):
  records = _records(5)
  jsonl = _write(tmp_path / "g.jsonl", records)
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(records), tmp_path / "g.parquet")
  for path in (jsonl, tmp_path / "g.parquet"):
    problems = gsm8k.read(path, limit=3)
    assert [p.question for p in problems] == [r["question"] for r in records[:3]]
    assert problems[2].target == str(3 * 2 + 1)
  assert len(gsm8k.read(jsonl)) == 5


def test_bad_input_errors_name_the_fix(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    gsm8k.read(tmp_path / "missing.jsonl")
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"question": "q", "answer": "no final number"}\n')
  with pytest.raises(ValueError, match="line 1.*'#### '"):
    gsm8k.read(bad)
  bad.write_text('{"question": "q"}\n')
  with pytest.raises(ValueError, match=r"lacks string field\(s\) \['answer'\]"):
    gsm8k.read(bad)
  with pytest.raises(ValueError, match="limit"):
    gsm8k.read(bad, limit=0)
  problems = gsm8k.read(_write(tmp_path / "g.jsonl", _records(3)))
  with pytest.raises(ValueError, match="need 4 problems"):
    gsm8k.fewshot_prompts(problems, n_shot=3)


def test_hub_name_offline_is_a_clear_error(monkeypatch):
  datasets = pytest.importorskip("datasets")

  def offline(*args, **kwargs):
    raise ConnectionError("no network")
  monkeypatch.setattr(datasets, "load_dataset", offline)
  with pytest.raises(ValueError, match="offline.*local .jsonl or .parquet"):
    gsm8k.read("openai/gsm8k")


def test_shots_never_include_the_question_itself():
  problems = [gsm8k.Problem(r["question"], r["answer"]) for r in _records(6)]
  for p, shots in zip(problems, gsm8k.fewshot_shots(problems, problems, 5, exclude_self=True)):
    assert p not in shots and len(shots) == 5
  assert np.all([len(s) == 0 for s in gsm8k.fewshot_shots(problems, problems, 0)])
