"""GSM8K-format evaluation sets: read, prompt n-shot, and score as lm-eval's `gsm8k` task does.

    problems = gsm8k.read("gsm8k_test.jsonl", limit=200)        # or .parquet, "openai/gsm8k"
    prompts = gsm8k.fewshot_prompts(problems, pool, n_shot=4)   # "Question: ...\\nAnswer:"
    gsm8k.score(response, problems[0].answer)                   # {"strict": .., "flexible": ..}

A record has `question` and `answer`, the answer's worked solution ending in `#### N` (the
format of openai/gsm8k). The prompt and the scoring restate lm-evaluation-harness 0.4's
`gsm8k.yaml`, which the peers (LLaDA, Fast-dLLM, D2F, Dream) evaluate with:

  prompt   each shot "Question: {question}\\nAnswer: {answer}" followed by "\\n\\n", then
           "Question: {question}\\nAnswer:"; shots drawn by `random.Random(1234).sample` from
           the few-shot pool, one draw per evaluated question in order (lm-eval's default
           sampler and seed); a question is never its own shot;
  stops    generation ends at "Question:", "</s>" or "<|im_end|>" (the task's `until`);
  strict   the first match of `#### (\\-?[0-9\\.\\,]+)` ("[invalid]" when none);
  flexible the last match of `(-?[$0-9.,]{2,})|(-?[0-9]+)` ("[invalid]" when none);
  match    both sides (extracted prediction, full reference answer) lose every ",", "$",
           everything up to the last "#### " and a final "."; then lower-cased and compared.

The D2F paper's GSM8K table is 4-shot (its eval script), LLaDA's too; lm-eval's default is 5.
Hub and TFDS names load through `datasets` / `tensorflow_datasets`, imported only then; a
machine without network gets an error saying to pass a local file instead.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

N_SHOT = 4                       # the D2F paper's GSM8K table (and LLaDA's)
FEWSHOT_SEED = 1234              # lm-eval's default fewshot_random_seed
UNTIL = ("Question:", "</s>", "<|im_end|>")
STRICT_PATTERN = r"#### (\-?[0-9\.\,]+)"
FLEXIBLE_PATTERN = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
INVALID = "[invalid]"
IGNORE = (",", "\\$", "(?s).*#### ", "\\.$")   # the task's regexes_to_ignore, in order
FILTERS = ("strict", "flexible")
HF_NAME = "openai/gsm8k"         # the task's dataset_path (config "main")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One GSM8K record: the question and its worked answer ending in `#### N`."""
  question: str
  answer: str

  @property
  def target(self) -> str:
    """The final number after the answer's "#### " (as the reference side normalises it)."""
    return normalize(self.answer)


def _problem(record, where: str) -> Problem:
  if not isinstance(record, dict):
    raise ValueError(f"{where}: a GSM8K record must be an object with 'question' and 'answer', "
                     f"got {type(record).__name__}.")
  missing = [k for k in ("question", "answer") if not isinstance(record.get(k), str)]
  if missing:
    raise ValueError(f"{where}: the record lacks string field(s) {missing}; a GSM8K record "
                     "holds 'question' and 'answer' (the worked answer ending in '#### N').")
  if "#### " not in record["answer"]:
    raise ValueError(f"{where}: the answer {record['answer'][-60:]!r} has no final '#### N'; "
                     "GSM8K answers end with '#### ' and the number.")
  return Problem(record["question"], record["answer"])


def read(source, *, split: str = "test", limit: int | None = None) -> list[Problem]:
  """The problems of a GSM8K-format set, in file order, the first `limit` when given.

  Args:
    source: a local .jsonl / .json (one object a line) / .parquet file; a HF `datasets`
      name ("openai/gsm8k", config "main"); or "tfds:<name>" (e.g. "tfds:gsm8k").
    split: the split a hub / TFDS name is read from (a file is one split).
    limit: keep the first `limit` problems (None: all).
  """
  if limit is not None and (not isinstance(limit, int) or limit < 1):
    raise ValueError(f"limit must be a positive int or None, got {limit!r}.")
  text = str(source)
  path = Path(text).expanduser()
  if path.suffix in FILE_SUFFIXES or path.exists():
    problems = _read_file(path)
  elif text.startswith("tfds:"):
    problems = _read_tfds(text[len("tfds:"):], split)
  else:
    problems = _read_hub(text, split)
  if not problems:
    raise ValueError(f"{source} holds no GSM8K records.")
  return problems[:limit] if limit else problems


def _read_file(path: Path) -> list[Problem]:
  if not path.is_file():
    raise FileNotFoundError(f"{path} does not exist; pass a GSM8K-format .jsonl or .parquet "
                            "file (records with 'question' and 'answer').")
  if path.suffix == ".parquet":
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    rows = pq.read_table(path, columns=["question", "answer"]).to_pylist()
    return [_problem(r, f"{path} row {i}") for i, r in enumerate(rows)]
  problems = []
  for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} line {n} is not JSON ({e}); a GSM8K file holds one JSON "
                       "object per line.") from None
    problems.append(_problem(record, f"{path} line {n}"))
  return problems


def _offline(name: str, e: Exception) -> ValueError:
  return ValueError(f"could not load the GSM8K set {name!r} ({type(e).__name__}: {e}). This "
                    "machine may be offline: fetch the split once where the network is reached "
                    "and pass the local .jsonl or .parquet file instead.")


def _read_hub(name: str, split: str) -> list[Problem]:
  try:
    import datasets  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(f"{name!r} is neither a local file nor loadable: reading a hub name needs "
                     "the `datasets` package; pass a local .jsonl / .parquet file.") from None
  try:
    data = datasets.load_dataset(name, "main" if name == HF_NAME else None, split=split)
  except Exception as e:  # noqa: BLE001  (network, missing name, bad split: all say the same)
    raise _offline(name, e) from None
  return [_problem(dict(r), f"{name}[{split}] row {i}") for i, r in enumerate(data)]


def _read_tfds(name: str, split: str) -> list[Problem]:
  try:
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
    rows = tfds.as_numpy(tfds.load(name, split=split))
    records = [{k: (v.decode() if isinstance(v, bytes) else v) for k, v in r.items()}
               for r in rows]
  except Exception as e:  # noqa: BLE001
    raise _offline(f"tfds:{name}", e) from None
  return [_problem(r, f"tfds:{name}[{split}] row {i}") for i, r in enumerate(records)]


# --- prompts ---

def question_text(question: str) -> str:
  """The task's doc_to_text."""
  return f"Question: {question}\nAnswer:"


def shot_text(p: Problem) -> str:
  """One few-shot example: doc_to_text, the target delimiter " ", the full answer, "\\n\\n"."""
  return f"{question_text(p.question)} {p.answer}\n\n"


def fewshot_shots(problems: Sequence[Problem], pool: Sequence[Problem], n_shot: int, *,
                  exclude_self: bool = False, seed: int = FEWSHOT_SEED) -> list[list[Problem]]:
  """The shots of each problem, drawn as lm-eval's default sampler draws them: one
  `Random(seed)` for the whole set; per problem in order `rnd.sample(pool, n_shot)`, or, with
  `exclude_self` (the pool is the evaluated split itself), `rnd.sample(pool, n_shot + 1)`
  with the problem removed and the first n_shot kept."""
  if not isinstance(n_shot, int) or n_shot < 0:
    raise ValueError(f"n_shot must be an int >= 0, got {n_shot!r}.")
  if n_shot == 0:
    return [[] for _ in problems]
  pool = list(pool)
  if len(pool) < n_shot + exclude_self:
    raise ValueError(f"{n_shot}-shot prompts need {n_shot + exclude_self} problems in the "
                     f"few-shot pool, which holds {len(pool)}; pass a larger few-shot set.")
  rnd = random.Random(seed)
  shots = []
  for p in problems:
    if not exclude_self:
      shots.append(rnd.sample(pool, n_shot))
      continue
    drawn = [x for x in rnd.sample(pool, n_shot + 1) if x != p][:n_shot]
    if len(drawn) < n_shot:  # the problem appears more than once among the draws
      drawn = rnd.sample([x for x in pool if x != p], n_shot)
    shots.append(drawn)
  return shots


def fewshot_prompts(problems: Sequence[Problem], pool: Sequence[Problem] | None = None, *,
                    n_shot: int = N_SHOT, exclude_self: bool | None = None,
                    seed: int = FEWSHOT_SEED) -> list[str]:
  """Each problem's n-shot prompt (module docstring). `pool` defaults to `problems`;
  `exclude_self` (default: whether the pool was defaulted) keeps a problem out of its own
  shots, as lm-eval does when the few-shot split is the test split."""
  if exclude_self is None:
    exclude_self = pool is None
  pool = problems if pool is None else pool
  shots = fewshot_shots(problems, pool, n_shot, exclude_self=exclude_self, seed=seed)
  return ["".join(shot_text(s) for s in each) + question_text(p.question)
          for p, each in zip(problems, shots)]


# --- scoring ---

def cut(response: str, until: Sequence[str] = UNTIL) -> str:
  """The response before its first stop string (lm-eval cuts generations at `until`)."""
  for stop in until:
    if stop:
      response = response.split(stop)[0]
  return response


def _extract(pattern: str, text: str, index: int) -> str:
  """lm-eval's regex filter: findall, the match at `index`, a group tuple's first non-empty
  group, stripped; INVALID when nothing matches."""
  found = re.findall(pattern, text)
  if not found:
    return INVALID
  match = found[index]
  if isinstance(match, tuple):
    match = next((m for m in match if m), INVALID)
  return match.strip()


def strict_extract(text: str) -> str:
  return _extract(STRICT_PATTERN, text, 0)


def flexible_extract(text: str) -> str:
  return _extract(FLEXIBLE_PATTERN, text, -1)


def normalize(text: str) -> str:
  """The exact_match normalisation: regexes_to_ignore removed in order, then lower case."""
  for pattern in IGNORE:
    text = re.sub(pattern, "", text)
  return text.lower()


def score(response: str, answer: str, *, until: Sequence[str] = UNTIL) -> dict[str, bool]:
  """{"strict": .., "flexible": ..}: whether `response` (cut at `until`) matches the reference
  `answer` (the full worked answer) under each filter."""
  text = cut(response, until)
  reference = normalize(answer)
  return {"strict": normalize(strict_extract(text)) == reference,
          "flexible": normalize(flexible_extract(text)) == reference}
