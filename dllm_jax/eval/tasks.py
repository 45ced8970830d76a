"""lm-eval tasks that ship with dllm_jax, usable offline.

  demo_sums   64 two-digit additions ("37+48=" -> "85"): the task the `demo` models are
              trained on, in GSM8K's answer format ("#### 85") and scored by exact match
              of the response (strict) and of its last number (flexible), as lm-eval's
              gsm8k scores. `python -m dllm_jax.eval --model_args checkpoint=demo
              --tasks demo_sums` checks a whole decode + scoring path with nothing
              downloaded.

`task_dir()` writes the tasks (a JSONL and its YAML, whose data path must be absolute) under
`$DLLM_JAX_CACHE/lm_eval_tasks/` (default ~/.cache/dllm_jax) and returns that directory, for
lm-eval's `--include_path` / `TaskManager(include_path=...)`; `python -m dllm_jax.eval` adds
it when a task of `TASKS` is asked for.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

TASKS = ("demo_sums",)
SEED, COUNT = 2024, 64

# The lm-eval gsm8k task's filters (lm_eval/tasks/gsm8k/gsm8k.yaml): a strict "#### N" or a
# bare answer, and the last number of the response.
_YAML = """task: demo_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  do_sample: false
num_fewshot: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "^\\\\s*(-?[0-9]+)\\\\s*$"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
metadata:
  version: 1.0
"""


def demo_sums(count: int = COUNT, seed: int = SEED) -> list[dict]:
  """[{"question": "a+b=", "answer": "#### a+b"}] with a, b in [0, 100) (fixed seed)."""
  rng = np.random.default_rng(seed)
  pairs = rng.integers(0, 100, (count, 2))
  return [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"} for a, b in pairs.tolist()]


def cache_dir() -> Path:
  root = os.environ.get("DLLM_JAX_CACHE")
  return (Path(root).expanduser() if root else Path.home() / ".cache" / "dllm_jax") / \
      "lm_eval_tasks"


def task_dir(directory: Path | None = None) -> Path:
  """Writes every task of TASKS (data + YAML) into `directory` (default `cache_dir()`), each
  file written whole then renamed into place, and returns the directory."""
  directory = cache_dir() if directory is None else Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  data = directory / "demo_sums.jsonl"
  files = {data: "".join(json.dumps(r) + "\n" for r in demo_sums()),
           directory / "demo_sums.yaml": _YAML.format(data=json.dumps(str(data)))}
  for path, text in files.items():
    if not path.is_file() or path.read_text() != text:
      partial = path.with_name(f".{path.name}.{os.getpid()}")
      partial.write_text(text)
      partial.replace(path)
  return directory
