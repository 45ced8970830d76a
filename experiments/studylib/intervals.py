"""Paired bootstrap 95% intervals over prompts for the study's figures (pure NumPy).

Every cell stores what each of its decode batches gave (accounting.MethodResult.per_batch:
prompts, correct answers, response tokens, wall time, forwards); at batch 1, where the
verdict judges, a batch is one prompt. An interval resamples those batches with replacement,
the SAME draw for a cell and its baseline (the two decoded the same prompts, batch for batch),
and recomputes the figure on each resample:

    accuracy difference (points) = 100 * (correct_c / prompts - correct_b / prompts)
    tokens/s ratio               = (tokens_c / wall_c) / (tokens_b / wall_b)

each a sum over the resampled batches. The interval is the 2.5th and 97.5th percentiles of
RESAMPLES resamples drawn from SEED (fixed: a stored interval recomputes exactly); the point
figure is the full sample's. Pooled over training seeds, each seed's batches are resampled
within that seed (`strata`), so every resample keeps every seed's share.

Shape legend: R resamples, C batches (clusters), S strata.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95


def weights(sizes: Sequence[int], *, resamples: int = RESAMPLES, seed: int = SEED
            ) -> np.ndarray:
  """[R, C] counts: how often each batch is drawn in each resample, drawing sizes[s] batches
  with replacement within stratum s (its batches are the next sizes[s] columns)."""
  return _weights(tuple(int(n) for n in sizes), int(resamples), int(seed))


@functools.lru_cache(maxsize=64)
def _weights(sizes: tuple[int, ...], resamples: int, seed: int) -> np.ndarray:
  if not sizes or min(sizes) < 1:
    raise ValueError(f"every stratum needs at least one batch to resample, got sizes {sizes}.")
  rng = np.random.default_rng(seed)
  blocks = []
  for n in sizes:
    draws = rng.integers(0, n, size=(resamples, n))
    blocks.append(np.stack([np.bincount(row, minlength=n) for row in draws]))
  out = np.concatenate(blocks, axis=1)
  out.flags.writeable = False  # shared by every caller (cached)
  return out


def percentile_interval(samples: np.ndarray, level: float = LEVEL) -> list[float] | None:
  """[lo, hi]: the central `level` of the finite resampled figures (a resample whose ratio has
  no denominator is dropped); None when none is finite (a figure with no denominator)."""
  samples = np.asarray(samples, float)
  samples = samples[np.isfinite(samples)]
  if not samples.size:
    return None
  tail = 100 * (1 - level) / 2
  lo, hi = np.percentile(samples, [tail, 100 - tail])
  return [float(lo), float(hi)]


def _check(*arrays) -> list[np.ndarray]:
  out = [np.asarray(a, float) for a in arrays]
  if len({a.shape for a in out}) != 1 or out[0].ndim != 1:
    raise ValueError(f"paired figures need one value per batch for both cells, got shapes "
                     f"{[a.shape for a in out]}.")
  return out


def accuracy_delta(correct: Sequence, base_correct: Sequence, prompts: Sequence, *,
                   strata: Sequence[int] | None = None, resamples: int = RESAMPLES,
                   seed: int = SEED) -> list[float] | None:
  """[lo, hi] of 100 * (accuracy - base accuracy) in points, paired over batches."""
  c, cb, n = _check(correct, base_correct, prompts)
  w = weights(strata or [len(n)], resamples=resamples, seed=seed)
  total = w @ n
  with np.errstate(divide="ignore", invalid="ignore"):
    return percentile_interval(100 * ((w @ c) - (w @ cb)) / total)


def rate_ratio(tokens: Sequence, wall: Sequence, base_tokens: Sequence, base_wall: Sequence,
               *, strata: Sequence[int] | None = None, resamples: int = RESAMPLES,
               seed: int = SEED) -> list[float] | None:
  """[lo, hi] of (tokens / wall) / (base tokens / base wall), paired over batches: a tokens/s
  ratio (any ratio of two such rates: tokens per forward, with forwards for wall)."""
  t, s, tb, sb = _check(tokens, wall, base_tokens, base_wall)
  w = weights(strata or [len(t)], resamples=resamples, seed=seed)
  with np.errstate(divide="ignore", invalid="ignore"):
    ratio = ((w @ t) / (w @ s)) / ((w @ tb) / (w @ sb))
  return percentile_interval(ratio)


def _ratio_of_sums(num: Sequence, den: Sequence, strata, resamples: int,
                   seed: int) -> list[float] | None:
  """[lo, hi] of sum(num) / sum(den), resampling batches (within each stratum)."""
  a, b = _check(num, den)
  w = weights(strata or [len(a)], resamples=resamples, seed=seed)
  with np.errstate(divide="ignore", invalid="ignore"):
    return percentile_interval((w @ a) / (w @ b))


def proportion(correct: Sequence, prompts: Sequence, *, strata: Sequence[int] | None = None,
               resamples: int = RESAMPLES, seed: int = SEED) -> list[float] | None:
  """[lo, hi] of one cell's accuracy (a fraction), over its batches."""
  return _ratio_of_sums(correct, prompts, strata, resamples, seed)


def rate(tokens: Sequence, wall: Sequence, *, strata: Sequence[int] | None = None,
         resamples: int = RESAMPLES, seed: int = SEED) -> list[float] | None:
  """[lo, hi] of one cell's tokens / wall (tokens/s), over its batches."""
  return _ratio_of_sums(tokens, wall, strata, resamples, seed)


def batch_figures(per_prompt: dict, per_batch: dict, task: str | None = None) -> dict | None:
  """{prompts, correct, tokens, wall_s, wall_median_s, forwards}: arrays [C] over a cell's
  batches (accounting.MethodResult's `per_prompt` and `per_batch`), or over the batches whose
  prompts are all of `task`, plus `tasks` (each kept batch's task names, to check a pairing)
  and `strata` (batches per training seed, in order, for a cell pooled over seeds: its
  per_batch `seed`; one stratum otherwise). None when the cell stored none (a document
  written before them) or has no such batch."""
  if not per_batch or not per_batch.get("rows"):
    return None
  rows = np.asarray(per_batch["rows"], int)
  starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
  tasks = list(per_prompt.get("task", []))
  correct = np.asarray(per_prompt["correct"], float)
  tokens = np.asarray(per_prompt["tokens"], float)
  keep = [i for i, (a, n) in enumerate(zip(starts, rows))
          if task is None or set(tasks[a:a + n]) == {task}]
  if not keep:
    return None
  take = lambda name: np.asarray(per_batch[name], float)[keep]  # noqa: E731
  seeds = [per_batch["seed"][i] for i in keep] if "seed" in per_batch else [0] * len(keep)
  strata = [sum(1 for _ in group) for _, group in itertools.groupby(seeds)]
  return {"prompts": rows[keep].astype(float), "strata": strata,
          "tasks": [tuple(tasks[starts[i]:starts[i] + rows[i]]) for i in keep],
          "correct": np.array([correct[starts[i]:starts[i] + rows[i]].sum() for i in keep]),
          "tokens": np.array([tokens[starts[i]:starts[i] + rows[i]].sum() for i in keep]),
          "wall_s": take("wall_s"), "wall_median_s": take("wall_median_s"),
          "forwards": take("forwards")}


def paired(cell, base, task: str | None) -> tuple[dict, dict] | None:
  """(cell's, base's) `batch_figures` on `task` (None: every batch) where the two decoded
  the same prompts batch for batch (same rows, same task names, same seeds), else None.
  `cell` and `base` have `per_prompt` and `per_batch` (accounting.MethodResult)."""
  a = batch_figures(cell.per_prompt, cell.per_batch, task)
  b = batch_figures(base.per_prompt, base.per_batch, task)
  if a is None or b is None or a["tasks"] != b["tasks"] or a["strata"] != b["strata"]:
    return None
  return a, b


def versus(cell, base, accuracy_task: str | None, speed_task: str | None) -> dict:
  """{"accuracy_delta_ci95": [lo, hi] points, "speedup_ci95": [lo, hi]}: the paired intervals
  of `cell`'s accuracy difference (on `accuracy_task`'s batches) and tokens/s ratio (on
  `speed_task`'s) against `base`; None where the two cannot be paired."""
  out = {"accuracy_delta_ci95": None, "speedup_ci95": None}
  pair = paired(cell, base, accuracy_task)
  if pair is not None:
    a, b = pair
    out["accuracy_delta_ci95"] = accuracy_delta(a["correct"], b["correct"], a["prompts"],
                                                strata=a["strata"])
  pair = paired(cell, base, speed_task)
  if pair is not None:
    a, b = pair
    if a["wall_s"].sum() > 0 and b["wall_s"].sum() > 0:
      out["speedup_ci95"] = rate_ratio(a["tokens"], a["wall_s"], b["tokens"], b["wall_s"],
                                       strata=a["strata"])
  return out


def own(cell, task: str | None = None) -> dict:
  """{"accuracy_ci95": [lo, hi] (a fraction), "tokens_per_s_ci95": [lo, hi]}: one cell's
  intervals over its batches (the Pareto plot's error bars); None without stored batches."""
  f = batch_figures(cell.per_prompt, cell.per_batch, task)
  if f is None:
    return {"accuracy_ci95": None, "tokens_per_s_ci95": None}
  speed = rate(f["tokens"], f["wall_s"], strata=f["strata"]) if f["wall_s"].sum() > 0 else None
  return {"accuracy_ci95": proportion(f["correct"], f["prompts"], strata=f["strata"]),
          "tokens_per_s_ci95": speed}


def table(results, baseline: str) -> list[dict]:
  """Every cell's intervals (study.json "intervals"): its own accuracy and tokens/s, and its
  accuracy difference (points) and tokens/s ratio against the `baseline` cell of its batch
  size, each [lo, hi] beside its point figure (null where not computable)."""
  base = {r.batch_size: r for r in results if r.label == baseline}
  out = []
  for r in results:
    row = {"label": r.label, "batch_size": r.batch_size, "baseline": baseline, **own(r)}
    b = base.get(r.batch_size)
    row["accuracy_delta_points"] = (None if b is None or not b.num_prompts or not r.num_prompts
                                    else 100 * (r.num_correct / r.num_prompts
                                                - b.num_correct / b.num_prompts))
    row["speedup"] = (r.tokens_per_s / b.tokens_per_s if b is not None and b.tokens_per_s
                      else None)
    row.update(versus(r, b, None, None) if b is not None
               else {"accuracy_delta_ci95": None, "speedup_ci95": None})
    out.append(row)
  return out
