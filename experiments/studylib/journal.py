"""A decode's timed rounds on disk, so that an interrupted study resumes where it stopped.

The study times its cells round-robin, one *round* (batch i of every cell) after another
(runner.py). At G = 384 vanilla LLaDA takes seconds a prompt, so decoding the long mode's grid
on a CPU is a long run; a killed run should not lose it. Each finished (round, cell) is one
JSON line of what `accounting.Tally.add` was given:

    {"fingerprint": "<sha256>"}                                   first line
    {"round": i, "cell": j, "add": {"lengths": [...], "correct": [...], ...}}

A rerun with the same fingerprint replays every *complete* round (all cells present) into its
tallies and decodes only the rest; a round that a kill cut short is decoded again for every
cell, so each round's cells are still timed side by side. The fingerprint covers what the
rounds' figures depend on: the cells (method, label, setting, batch size, the bytes of their
params), the prompts and references, the seed and the repeats. Anything else starts afresh.
The study deletes the journal once its report is written, so a rerun re-times from scratch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import numpy as np


def params_digest(trees: Iterable[object]) -> str:
  """sha256 of every array leaf's dtype, shape and bytes, over `trees` in order. A leaf that
  several trees share (one model bound to several cells) is hashed once and its digest reused;
  the result is the same as for unshared copies of the same bytes."""
  h = hashlib.sha256()
  cache: dict[int, bytes] = {}
  for tree in trees:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    h.update(str(treedef).encode())
    for leaf in leaves:
      if id(leaf) not in cache:
        a = np.asarray(leaf)
        cache[id(leaf)] = hashlib.sha256(
            f"{a.dtype}{a.shape}".encode() + np.ascontiguousarray(a).tobytes()).digest()
      h.update(cache[id(leaf)])
  return h.hexdigest()


def fingerprint(description: object, params: Iterable[object]) -> str:
  """sha256 of a JSON-able `description` and of the params' bytes (params_digest)."""
  text = json.dumps(description, sort_keys=True, default=str)
  return hashlib.sha256(text.encode() + params_digest(params).encode()).hexdigest()


class Journal:
  """The rounds of one `run_cells` call recorded at `path` (created, with its folder, if
  absent). `restored[i]` holds round i's `Tally.add` arguments, one dict per cell, for every
  round the file held complete under the same fingerprint."""

  def __init__(self, path: str | os.PathLike, fingerprint: str, num_cells: int):
    self.path = Path(path)
    self.restored: dict[int, list[dict]] = {}
    self._fingerprint = fingerprint
    rows = self._read(num_cells)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = self.path.with_name(self.path.name + ".tmp")
    with open(tmp, "w") as f:  # the header and the complete rounds, nothing half-written
      f.write(json.dumps({"fingerprint": fingerprint}) + "\n")
      for i in sorted(rows):
        if len(rows[i]) == num_cells:
          self.restored[i] = [rows[i][j] for j in range(num_cells)]
          for j in range(num_cells):
            f.write(json.dumps({"round": i, "cell": j, "add": rows[i][j]}) + "\n")
    os.replace(tmp, self.path)
    self._file = open(self.path, "a")

  def _read(self, num_cells: int) -> dict[int, dict[int, dict]]:
    """{round: {cell: add}} from an existing journal of the same fingerprint, else {}."""
    if not self.path.exists():
      return {}
    rows: dict[int, dict[int, dict]] = {}
    with open(self.path) as f:
      lines = f.read().splitlines()
    try:
      header = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
      return {}
    if header.get("fingerprint") != self._fingerprint:
      return {}
    for line in lines[1:]:
      try:
        row = json.loads(line)
        i, j, add = int(row["round"]), int(row["cell"]), dict(row["add"])
      except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        continue  # the line a kill cut short
      if 0 <= j < num_cells:
        rows.setdefault(i, {})[j] = add
    return rows

  def record(self, round_index: int, cell_index: int, add: dict) -> None:
    """Appends one (round, cell)'s `Tally.add` arguments (JSON-able) and flushes them."""
    self._file.write(json.dumps({"round": round_index, "cell": cell_index, "add": add}) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()

  def __enter__(self) -> "Journal":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def add_arguments(lengths: np.ndarray, correct: Sequence[bool], real_rows: int, wall_s: float,
                  nfe: int, steps: int, tasks: Sequence[str], wall_median_s: float) -> dict:
  """`Tally.add`'s keyword arguments as JSON-able values (what a journal line holds)."""
  return {"lengths": [int(x) for x in np.asarray(lengths).reshape(-1)],
          "correct": [bool(c) for c in correct], "real_rows": int(real_rows),
          "wall_s": float(wall_s), "nfe": int(nfe), "steps": int(steps),
          "tasks": [str(t) for t in tasks], "wall_median_s": float(wall_median_s)}
