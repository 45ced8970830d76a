"""Honest accounting for the speed/quality study: what counts as a token, a forward, a hit.

Rules (dllm-algorithms.md section 10):
  * tokens/s counts generated **response** tokens only: no prompt, no EOS, nothing after the
    first EOS, no padding rows added to fill the last batch;
  * NFE (batched model forward passes) is reported beside tokens/s, per prompt and per token;
  * accuracy is exact-match of the task's final answer on the decoded response;
  * wall time excludes compilation (a warm-up call on the same shapes runs first) and includes
    everything else the caller waits for (the loop, host transfer of the result).

Shape legend: B batch rows, G response slots.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
from pathlib import Path
from collections.abc import Sequence

import jax
import numpy as np

SCHEMA_VERSION = 2  # 2: wall_median_s and tokens_per_s_median per result


@dataclasses.dataclass
class MethodResult:
  """Every figure of one (method, setting, batch size) cell of the study."""
  method: str
  label: str
  setting: dict
  batch_size: int
  num_prompts: int
  num_correct: int
  response_tokens: int
  wall_s: float
  compile_s: float
  nfe: int
  loop_steps: int
  per_task: dict = dataclasses.field(default_factory=dict)  # task -> [correct, total]
  # wall_s sums each batch's fastest timed decode; this sums their medians (same batches).
  wall_median_s: float = 0.0
  # task -> [response tokens, wall_s, nfe, wall_median_s, prompts, loop_steps] over the
  # batches whose real rows are all of that task (every batch at batch size 1): each task's
  # own speed, timed as wall_s is (documents written before loop_steps was added have 5).
  per_task_time: dict = dataclasses.field(default_factory=dict)
  # Each prompt in decoding order: {"task": [...], "correct": [0/1...], "tokens": [...]};
  # each timed batch: {"rows": prompts, "wall_s", "wall_median_s", "forwards", "steps"}. At
  # batch 1 a batch is a prompt. The paired bootstrap intervals (intervals.py) resample them.
  # Absent ({}) from documents written before them.
  per_prompt: dict = dataclasses.field(default_factory=dict)
  per_batch: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def from_json(cls, row: dict) -> "MethodResult":
    """The cell of one `results` row of a study JSON (its derived figures are recomputed)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in row.items() if k in names})

  def task_accuracy(self, task: str) -> float:
    correct, total = self.per_task.get(task, (0, 0))
    return correct / total if total else float("nan")

  def task_tokens_per_s(self, task: str) -> float:
    """Response tokens/s on the single-task batches of `task` (nan without any)."""
    tokens, wall = self.per_task_time.get(task, (0, 0.0))[:2]
    return tokens / wall if wall > 0 else float("nan")

  @property
  def accuracy(self) -> float:
    return self.num_correct / max(self.num_prompts, 1)

  @property
  def tokens_per_s(self) -> float:
    return self.response_tokens / self.wall_s if self.wall_s > 0 else 0.0

  @property
  def tokens_per_s_median(self) -> float:
    """tokens_per_s from the median instead of the fastest of each batch's timed repeats."""
    return self.response_tokens / self.wall_median_s if self.wall_median_s > 0 else 0.0

  @property
  def latency_per_prompt_s(self) -> float:
    return self.wall_s / max(self.num_prompts, 1)

  @property
  def nfe_per_prompt(self) -> float:
    """Forward passes per prompt; a batched forward serves all its rows."""
    return self.nfe * self.batch_size / max(self.num_prompts, 1)

  @property
  def tokens_per_forward(self) -> float:
    """Response tokens per forward pass per row (1.0 for AR, more for parallel decoders)."""
    return self.response_tokens / max(self.nfe * self.batch_size, 1)

  def to_json(self) -> dict:
    out = dataclasses.asdict(self)
    out.update(accuracy=self.accuracy, tokens_per_s=self.tokens_per_s,
               tokens_per_s_median=self.tokens_per_s_median,
               latency_per_prompt_s=self.latency_per_prompt_s,
               nfe_per_prompt=self.nfe_per_prompt, tokens_per_forward=self.tokens_per_forward)
    return out


class Tally:
  """Accumulates batches of one cell; padding rows of a short final batch are excluded."""

  def __init__(self, method: str, label: str, setting: dict, batch_size: int):
    self.result = MethodResult(method, label, dict(setting), batch_size, 0, 0, 0, 0.0, 0.0, 0, 0)

  def add(self, lengths: np.ndarray, correct: Sequence[bool], real_rows: int, wall_s: float,
          nfe: int, steps: int, tasks: Sequence[str] = (), wall_median_s: float | None = None
          ) -> None:
    lengths = np.asarray(lengths)[:real_rows]
    r = self.result
    for task, hit in zip(tasks[:real_rows], correct[:real_rows]):
      c, t = r.per_task.get(task, (0, 0))
      r.per_task[task] = [c + int(hit), t + 1]
    real_tasks = set(tasks[:real_rows])
    if len(real_tasks) == 1 and len(tasks) >= real_rows:
      (task,) = real_tasks
      median = float(wall_s if wall_median_s is None else wall_median_s)
      old = r.per_task_time.get(task, (0, 0.0, 0, 0.0, 0, 0))
      r.per_task_time[task] = [old[0] + int(np.sum(lengths)), old[1] + float(wall_s),
                               old[2] + int(nfe), old[3] + median, old[4] + real_rows,
                               old[5] + int(steps)]
    hits = [int(bool(c)) for c in list(correct)[:real_rows]]
    names = [str(t) for t in tasks[:real_rows]]
    names += [""] * (real_rows - len(names))  # a tally given no task names
    for key, values in (("task", names), ("correct", hits),
                        ("tokens", [int(x) for x in lengths])):
      r.per_prompt.setdefault(key, []).extend(values)
    for key, value in (("rows", int(real_rows)), ("wall_s", float(wall_s)),
                       ("wall_median_s", float(wall_s if wall_median_s is None
                                               else wall_median_s)),
                       ("forwards", int(nfe)), ("steps", int(steps))):
      r.per_batch.setdefault(key, []).append(value)
    r.num_prompts += real_rows
    r.num_correct += int(np.sum(np.asarray(correct, bool)[:real_rows]))
    r.response_tokens += int(np.sum(lengths))
    r.wall_s += float(wall_s)
    r.wall_median_s += float(wall_s if wall_median_s is None else wall_median_s)
    r.nfe += int(nfe)
    r.loop_steps += int(steps)


def response_texts(tokenizer, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
  """Decodes each row's response up to (not including) its first EOS.

  A model whose vocabulary is padded past the tokenizer's can emit ids the tokenizer does not
  know; each such id becomes U+FFFD, so the response still counts its tokens and scores wrong
  (never a crash, never a silently dropped token).
  """
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  texts = []
  for i in range(tokens.shape[0]):
    pieces, run = [], []
    for t in tokens[i, :lengths[i]].tolist():
      if 0 <= t < tokenizer.vocab_size:
        run.append(t)
        continue
      pieces += [tokenizer.decode(run), "\ufffd"]
      run = []
    texts.append("".join(pieces) + tokenizer.decode(run))
  return texts


def score(suite, examples, texts: Sequence[str]) -> list[bool]:
  """Exact-match correctness of each response under its task's rule."""
  if len(texts) < len(examples):
    raise ValueError(f"{len(texts)} responses for {len(examples)} examples.")
  return [bool(suite.score(t, ex)) for t, ex in zip(texts, examples)]


def machine_info() -> dict:
  """What the numbers were measured on. `cpu_model`, `cpu_family_model` and `cpu_simd` tell
  hosts apart that `processor` does not: CPU-bound figures of the same code differ by a factor
  of 2 or more between CPUs of the same core count (BENCHMARKS.md sections 1 and 3), and some
  CPUs report only their product family as the model name."""
  dev = jax.devices()[0]
  return {
      "platform": dev.platform,
      "device_kind": dev.device_kind,
      "device_count": jax.device_count(),
      "jax_version": jax.__version__,
      "cpu_count": os.cpu_count(),
      "threads": int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)),
      "python": platform.python_version(),
      "machine": platform.machine(),
      "processor": platform.processor() or platform.machine(),
      **cpu_identity(),
      "code_revision": code_revision(),
  }


# The checkout whose code produced a report: the repository holding this file.
_REPO = Path(__file__).resolve().parents[2]


def code_revision(repo: str | os.PathLike | None = None) -> str | None:
  """The git commit of `repo` (default: this checkout), short, with "+dirty" when tracked
  files differ from it; None outside a git checkout or without git. A report names the code
  that measured it, so figures from different commits are never pooled unknowingly."""
  cwd = str(repo or _REPO)
  try:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=cwd, check=True,
                          capture_output=True, text=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                           check=True, capture_output=True, text=True, timeout=10).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  return head + ("+dirty" if dirty.strip() else "") if head else None


CPU_INFO = "/proc/cpuinfo"
# Vector instruction sets, widest first: `cpu_simd` is the first one the CPU's flags list.
SIMD_FLAGS = ("avx512f", "avx2", "avx", "sse4_2", "asimd")


def cpu_identity(cpuinfo_text: str | None = None) -> dict:
  """{"cpu_model", "cpu_family_model", "cpu_simd"} of the first CPU in /proc/cpuinfo (or of
  `cpuinfo_text`): its model name, "family/model" (e.g. "23/1"), and the widest
  vector instruction set its flags list. Off Linux: the architecture, and None for the rest."""
  if cpuinfo_text is None:
    try:
      with open(CPU_INFO) as f:
        cpuinfo_text = f.read()
    except OSError:
      cpuinfo_text = ""
  first: dict[str, str] = {}
  for line in cpuinfo_text.splitlines():
    if not line.strip():
      if first:
        break  # the first processor's block ends at its blank line
      continue
    key, _, value = line.partition(":")
    first.setdefault(key.strip(), value.strip())
  flags = set(first.get("flags", first.get("Features", "")).split())
  family, model = first.get("cpu family"), first.get("model")
  return {"cpu_model": first.get("model name") or platform.machine(),
          "cpu_family_model": f"{family}/{model}" if family and model else None,
          "cpu_simd": next((f for f in SIMD_FLAGS if f in flags), None)}


def results_json(results: Sequence[MethodResult], *, machine: dict, config: dict,
                 extra: dict | None = None) -> dict:
  """The study's JSON document (see `validate_json` for the schema)."""
  return {"schema_version": SCHEMA_VERSION, "machine": machine, "config": config,
          "results": [r.to_json() for r in results], **(extra or {})}


_RESULT_FIELDS = {
    "method": str, "label": str, "setting": dict, "batch_size": int, "num_prompts": int,
    "num_correct": int, "response_tokens": int, "wall_s": float, "compile_s": float,
    "nfe": int, "loop_steps": int, "accuracy": float, "tokens_per_s": float,
    "latency_per_prompt_s": float, "nfe_per_prompt": float, "tokens_per_forward": float,
    "per_task": dict, "wall_median_s": float, "tokens_per_s_median": float,
}
# absent from documents written before them
_OPTIONAL_FIELDS = {"per_task_time": dict, "per_prompt": dict, "per_batch": dict}


def validate_json(doc: dict) -> None:
  """Raises ValueError if `doc` is not a study document of the current schema."""
  if doc.get("schema_version") != SCHEMA_VERSION:
    raise ValueError(f"schema_version {doc.get('schema_version')} != {SCHEMA_VERSION}.")
  for key in ("machine", "config", "results"):
    if key not in doc:
      raise ValueError(f"study JSON lacks {key!r}.")
  for i, row in enumerate(doc["results"]):
    for field, kind in {**_RESULT_FIELDS, **_OPTIONAL_FIELDS}.items():
      if field not in row:
        if field in _OPTIONAL_FIELDS:
          continue
        raise ValueError(f"result {i} lacks {field!r}.")
      value = row[field]
      ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
      if not ok or isinstance(value, bool):
        raise ValueError(f"result {i} field {field!r} has type {type(value).__name__}.")
    if not 0.0 <= row["accuracy"] <= 1.0:
      raise ValueError(f"result {i} accuracy {row['accuracy']} outside [0, 1].")
