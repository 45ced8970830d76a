"""Random-access record sources: synthetic examples in memory, and a bytes -> str adapter.

A *source* is anything with `__len__` and `__getitem__(i) -> dict`, like the array_record data
source that `tfds.data_source` returns. The pipeline reads records by index (a batch's worth in
one `__getitems__(indices)` call where the source has one: array_record then reads them in one
pass, ~5x faster than one by one), so

  SyntheticSource(suite, n, seed)          # in memory, nothing to prepare
  load_source("synthetic_reasoning", ...)  # the same records, prepared with TFDS (builders.py)

are interchangeable. Records of synthetic sources are `{"prompt", "answer", "target", "task"}`
(str); TFDS gives bytes, which `TextSource` decodes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from dllm_jax.data.tasks import SPLITS, Example, TaskSuite

_SPLIT_CODES = {split: code for code, split in enumerate(SPLITS)}


class Source(Protocol):
  """Random access to records (dicts of str / numbers)."""

  def __len__(self) -> int: ...
  def __getitem__(self, index: int) -> dict[str, Any]: ...


def example_to_record(example: Example) -> dict[str, str]:
  return {"prompt": example.prompt, "answer": example.answer, "target": example.target,
          "task": example.task}


def record_to_example(record: dict[str, Any]) -> Example:
  """Rebuilds an `Example` (for scoring) from a synthetic record, str or bytes."""
  fields = {k: _to_str(record[k]) for k in ("prompt", "answer", "target", "task")}
  return Example(**fields)


def _to_str(value: Any) -> Any:
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.ndarray) and value.dtype == object:
    return [_to_str(v) for v in value.tolist()]
  return value


def _check_index(index: int, n: int) -> int:
  if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
    raise TypeError(f"source indices must be ints, got {type(index).__name__}")
  index = int(index)
  if index < 0:
    index += n
  if not 0 <= index < n:
    raise IndexError(f"index {index} out of range for a source of {n} records")
  return index


class SyntheticSource:
  """`n` examples of a `TaskSuite` split, generated on demand with per-index seeds.

  Record i is drawn from `np.random.default_rng([seed, split_code, i])`, so it is the same in
  every process, in any access order, and in the TFDS `synthetic_reasoning` builder (which
  writes exactly these records). The train and test splits never share a prompt (see
  `tasks.split_of`); with `unique=True` the records are generated once, up front, and repeated
  prompts within the split are skipped (use it for eval sets of easy levels).
  """

  def __init__(self, suite: TaskSuite, n: int, seed: int = 0, split: str = "train", *,
               unique: bool = False):
    if split not in _SPLIT_CODES:
      raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(n, (int, np.integer)) or n <= 0:
      raise ValueError(f"SyntheticSource needs n > 0 records, got {n!r}")
    self.suite, self.n, self.seed, self.split = suite, int(n), int(seed), split
    self._records: list[dict[str, str]] | None = None
    if unique:
      self._records = self._unique_records()

  def _generate(self, i: int) -> dict[str, str]:
    rng = np.random.default_rng([self.seed, _SPLIT_CODES[self.split], i])
    return example_to_record(self.suite.sample(rng, self.split))

  def _unique_records(self) -> list[dict[str, str]]:
    records, seen, i, misses = [], set(), 0, 0
    while len(records) < self.n:
      if misses > 1000 + 2 * len(seen):  # far beyond a coupon collector's wait: space exhausted
        raise ValueError(f"found only {len(records)} distinct {self.split!r} prompts in {i} "
                         f"draws, fewer than n={self.n}: lower n, raise the difficulty or pass "
                         "unique=False")
      record = self._generate(i)
      i += 1
      if record["prompt"] in seen:
        misses += 1
      else:
        seen.add(record["prompt"])
        records.append(record)
        misses = 0
    return records

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, index: int) -> dict[str, str]:
    index = _check_index(index, self.n)
    if self._records is not None:
      return dict(self._records[index])
    return self._generate(index)

  def __iter__(self) -> Iterator[dict[str, str]]:
    return (self[i] for i in range(self.n))

  def examples(self) -> list[Example]:
    return [record_to_example(r) for r in self]

  def __repr__(self) -> str:
    return (f"SyntheticSource({self.suite.spec_string()!r}, n={self.n}, seed={self.seed}, "
            f"split={self.split!r})")


class TextSource:
  """Wraps a source whose string fields are bytes (TFDS Text features) and decodes them."""

  def __init__(self, source: Sequence[dict[str, Any]]):
    self.source = source

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> dict[str, Any]:
    index = _check_index(index, len(self))
    return {k: _to_str(v) for k, v in self.source[index].items()}

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
    """`[self[i] for i in indices]`, read in one call where the wrapped source batches reads."""
    read = getattr(self.source, "__getitems__", None)
    if read is None:
      return [self[i] for i in indices]
    records = read([_check_index(i, len(self)) for i in indices])
    return [{k: _to_str(v) for k, v in record.items()} for record in records]

  def __iter__(self) -> Iterator[dict[str, Any]]:
    return (self[i] for i in range(len(self)))

  def __repr__(self) -> str:
    return f"TextSource({self.source!r})"
