"""Runs decoders over a prompt set and tallies accuracy, tokens/s, latency and NFE.

A *cell* of the study is (method, setting, batch size). The cells of one batch size run
together, timed so that their ratios survive a shared, noisy machine:
  1. the held-out prompts are encoded once, left-padded to one fixed length P (static shapes,
     so one compile serves every batch);
     A cell with `task_tags` also gets each row's task name (`tasks=`, adaptive's tags), and
     a cell with a `tag_of` (a prompt router) each row's tag from its prompt text instead;
  2. every cell runs its first batch once untimed to compile (reported as `compile_s`);
  3. batches are timed round-robin over the cells (batch 0 of every cell, then batch 1, ...):
     a slow spell of the machine hits every cell alike instead of whichever cell ran then;
     the order rotates by one cell each round, so no cell is always timed right after the
     same one (a cell run after a heavy one can start on cold caches);
  4. each batch is decoded `repeats` times in a row and its fastest wall time counts (dispatch
     to the result on the host), which filters out brief interference; the median of the
     repeats is kept too (`wall_median_s`), for a reader who wants the typical time. The decoders are
     deterministic for a fixed key, so every repeat returns the same tokens; the last ones are
     scored, and tokens, forwards and correct answers are tallied (accounting.py).
Rows added to fill the last batch are decoded but never counted.
With a `journal` (journal.py) every finished (round, cell) is written to disk as it ends, and a
rerun of the same cells, prompts and params replays the complete rounds instead of decoding
them again: an interrupted hour of decoding resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dllm_jax.decoding.base import DecodeOutput
from studylib import accounting
from studylib import journal as journal_lib

# (params, tokens[B,P], valid[B,P], rng[, tasks=[B] task names]) -> output
DecodeFn = Callable[..., DecodeOutput]


@dataclasses.dataclass
class Cell:
  """One decoder bound to its options and params, at one batch size."""
  decode: DecodeFn
  params: object
  method: str
  label: str
  setting: dict
  batch_size: int
  task_tags: bool = False  # decode(..., tasks=[each row's task name]) (adaptive's task tags)
  # decode(..., tasks=[tag_of(each row's prompt)]): tags from the prompt text (router.py)
  tag_of: Callable[[str], str] | None = None


def _batches(n: int, batch_size: int) -> list[tuple[int, int]]:
  return [(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]


def rotated(n: int, round_index: int) -> list[int]:
  """The cell indices in the order round `round_index` times them: 0..n-1 rotated left by
  the round (round 0: 0, 1, ..., n-1; round 1: 1, ..., n-1, 0; ...)."""
  first = round_index % n
  return list(range(first, n)) + list(range(first))


def run_cells(cells: Sequence[Cell], *, layout, suite, examples: Sequence, prompt_len: int,
              seed: int = 0, repeats: int = 1, on_batch: Callable[[], None] | None = None,
              journal: journal_lib.Journal | None = None,
              on_decoded: Callable[[int, int, list[str], np.ndarray], None] | None = None
              ) -> list[accounting.MethodResult]:
  """Decodes `examples` with every cell, interleaved batch by batch; one tally per cell.

  Args:
    cells: cells of ONE batch size (they share the batching).
    layout: an SFTLayout (its tokenizer decodes responses; its prompt encoding matches training).
    suite: the TaskSuite that scores responses.
    examples: held-out Examples; prompts are left-padded to `prompt_len`.
    repeats: timed decodes per batch; the fastest counts.
    on_batch: called after each (cell, batch), restored ones included.
    on_decoded: called after each decoded (cell, batch) with (cell index, index of the
      batch's first example, the real rows' response texts, their response token counts);
      not for rounds restored from the journal.
    journal: records each finished (round, cell); its `restored` rounds (an earlier run of
      the same cells, prompts, params, seed and repeats: open it with `fingerprint(...)` of
      this call's arguments) are replayed instead of decoded.
  """
  if not cells:
    return []
  sizes = {c.batch_size for c in cells}
  if len(sizes) != 1:
    raise ValueError(f"run_cells times cells of one batch size together, got {sorted(sizes)}.")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}.")
  batch_size = sizes.pop()
  enc = layout.encode_prompts([ex.prompt for ex in examples], length=prompt_len)
  tokens, valid = enc["tokens"], enc["valid"]
  n = len(examples)
  rng = jax.random.key(seed)
  tallies = [accounting.Tally(c.method, c.label, c.setting, batch_size) for c in cells]

  def batch(start, stop):
    idx = np.arange(start, start + batch_size) % n  # pad the last batch with repeats
    return tokens[idx], valid[idx], [examples[i] for i in idx], stop - start

  def call(cell, btok, bval, key, rows):
    if cell.tag_of is not None:
      return cell.decode(cell.params, btok, bval, key, tasks=[cell.tag_of(ex.prompt)
                                                               for ex in rows])
    if cell.task_tags:
      return cell.decode(cell.params, btok, bval, key, tasks=[ex.task for ex in rows])
    return cell.decode(cell.params, btok, bval, key)

  tok0, val0, rows0, _ = batch(0, min(batch_size, n))
  for cell, tally in zip(cells, tallies):
    t0 = time.perf_counter()
    jax.block_until_ready(call(cell, tok0, val0, rng, rows0))
    tally.result.compile_s = time.perf_counter() - t0

  rounds = _batches(n, batch_size)
  restored = {} if journal is None else journal.restored
  if restored and (max(restored) >= len(rounds)
                   or any(len(adds) != len(cells) for adds in restored.values())):
    raise ValueError(f"the journal at {journal.path} holds rounds these {len(cells)} cells "
                     f"over {n} prompts do not have: open it with this call's fingerprint.")
  for i in sorted(restored):
    for tally, add in zip(tallies, restored[i]):
      tally.add(**add)
      if on_batch is not None:
        on_batch()
  for i, (start, stop) in enumerate(rounds):
    if i in restored:
      continue
    btok, bval, brows, real = batch(start, stop)
    key = jax.random.fold_in(rng, i)
    for j in rotated(len(cells), i):
      cell, tally = cells[j], tallies[j]
      walls = []
      for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.device_get(call(cell, btok, bval, key, brows))
        walls.append(time.perf_counter() - t0)
      texts = accounting.response_texts(layout.tokenizer, out.tokens, out.lengths)
      add = journal_lib.add_arguments(
          out.lengths, accounting.score(suite, examples[start:stop], texts[:real]), real,
          min(walls), int(out.nfe), int(out.steps), [ex.task for ex in examples[start:stop]],
          float(np.median(walls)))
      tally.add(**add)
      if on_decoded is not None:
        on_decoded(j, start, texts[:real], np.asarray(out.lengths)[:real])
      if journal is not None:
        journal.record(i, j, add)
      if on_batch is not None:
        on_batch()
  return [t.result for t in tallies]


def fingerprint(cells: Sequence[Cell], examples: Sequence, prompt_len: int, seed: int = 0,
                repeats: int = 1, models: dict | None = None) -> str:
  """What a journal's rounds depend on (journal.py): the cells and their params' bytes, the
  prompts and references, the seed and the repeats (run_cells' arguments of those names), and
  `models` ({name: (params, model config)}): every model a decoder closes over, such as a
  hybrid's drafter, which a cell's own params do not show."""
  models = models or {}
  description = {
      "cells": [[c.method, c.label, c.setting, c.batch_size, c.task_tags] for c in cells],
      "examples": [dataclasses.asdict(ex) for ex in examples],
      "prompt_len": int(prompt_len), "seed": int(seed), "repeats": int(repeats),
      "models": {name: repr(cfg) for name, (_, cfg) in sorted(models.items())}}
  return journal_lib.fingerprint(
      description, [c.params for c in cells] + [models[k][0] for k in sorted(models)])
