"""Decode benchmark: D2F's fitted forward window against the full one, beside AR, LLaDA and
Fast-dLLM, on the same prompts and the same random-weight model.

Shape legend: B batch rows, P padded prompt length, G generated tokens per row, k block
length, N = G // k blocks.

Every cell decodes the same left-padded random prompts (lengths drawn per row) with a
random-weight LLaDA-shaped model whose stop ids are removed, so every row writes exactly G
tokens and a cell's time depends only on its decoder's schedule. Cells of one (G, k, B)
group are timed interleaved, repeat by repeat, so machine noise hits them alike; each cell
reports the fastest and the median of its repeats. The D2F pair (window "fitted" vs "full")
must produce identical tokens, or the run fails: the window policy may change the cost of a
step, never its result.

Per cell: NFE, steps, wall time, tokens/s of response tokens, seconds per forward (the
per-forward cost that makes decoders comparable), and for D2F the forward slots per step
(`D2FState.forward_slots / steps`; the first forward carries the prompt too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from dllm_jax.decoding import api, d2f
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import init_params
from studylib import accounting

SCHEMA_VERSION = 1
MASK_ID, PAD_ID, BOS_ID, FIRST_PROMPT_ID = 3, 0, 1, 4


def bench_model(config) -> ModelConfig:
  """The benchmark's LLaDA-shaped model (bidirectional-capable, mask id, no stop ids)."""
  m = config.model
  longest = max(g for g, _ in config.shapes) + config.max_prompt_len
  return ModelConfig(
      name="bench_tiny_llada", vocab_size=m.vocab_size, d_model=m.d_model,
      n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_heads, mlp_dim=m.mlp_dim,
      max_seq_len=longest, mask_token_id=MASK_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
      eos_token_id=None, eot_token_id=None)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One decoder setting at one (G, k, B)."""
  name: str
  method: str
  options: dict

  def key(self) -> str:
    return self.name


def cells_for(config, g: int, k: int) -> list[Cell]:
  """The decoders of one (G, k) group, in table order."""
  taus = dict(config.d2f_taus)
  cells = [
      Cell("d2f fitted", "d2f", {"block_length": k, "window": "fitted", **taus}),
      Cell("d2f full", "d2f", {"block_length": k, "window": "full", **taus}),
      Cell("ar", "ar", {}),
      Cell("llada", "llada", {"block_length": k, "steps": g}),
      Cell("fast_dllm dual", "fast_dllm", {"block_length": k, "cache": "dual",
                                          "threshold": config.fast_dllm_threshold}),
  ]
  return [c for c in cells if c.method in config.methods]


def prompts(config, batch: int, vocab_size: int):
  """(tokens [B, P], valid [B, P]) left-padded random prompts of lengths in
  [min_prompt_len, max_prompt_len], the same for every cell (seeded by batch size)."""
  rng = np.random.default_rng(config.seed + batch)
  lengths = rng.integers(config.min_prompt_len, config.max_prompt_len + 1, batch)
  tokens = np.full((batch, config.max_prompt_len), PAD_ID, np.int32)
  valid = np.zeros_like(tokens, bool)
  for i, n in enumerate(lengths):
    tokens[i, -n:] = rng.integers(FIRST_PROMPT_ID, vocab_size, n)
    valid[i, -n:] = True
  return tokens, valid


def _call(params, cfg, cell: Cell, batch, g: int):
  out = api.generate(params, cfg, batch, method=cell.method, gen_length=g, **cell.options)
  return jax.block_until_ready(out)


def _forward_slots(params, cfg, cell: Cell, batch, g: int) -> float:
  """D2F forward slots per step (one extra untimed decode that returns the state)."""
  tokens, valid = batch
  opts = {k: v for k, v in cell.options.items()}
  _, state = d2f.d2f_generate(params, cfg, tokens, valid, gen_length=g, return_state=True,
                              **opts)
  return float(state.forward_slots) / float(state.steps)


def measure_group(config, cfg, params, g: int, k: int, b: int) -> list[dict]:
  """Times every cell of one (G, k, B) group, interleaved; returns one record per cell."""
  batch = prompts(config, b, cfg.vocab_size)
  cells = cells_for(config, g, k)
  outs, compile_s = {}, {}
  for cell in cells:
    start = time.perf_counter()
    outs[cell.name] = jax.device_get(_call(params, cfg, cell, batch, g))
    compile_s[cell.name] = time.perf_counter() - start
  if "d2f fitted" in outs and "d2f full" in outs:
    a, f = outs["d2f fitted"], outs["d2f full"]
    if not (np.array_equal(a.tokens, f.tokens) and int(a.nfe) == int(f.nfe)):
      raise RuntimeError(f"G={g} k={k} B={b}: the fitted window changed D2F's tokens or NFE; "
                         "the window policy must only change the cost.")
  times = {c.name: [] for c in cells}
  for _ in range(config.repeats):
    for cell in cells:
      start = time.perf_counter()
      _call(params, cfg, cell, batch, g)
      times[cell.name].append(time.perf_counter() - start)
  records = []
  for cell in cells:
    out, ts = outs[cell.name], times[cell.name]
    tokens = int(np.sum(out.lengths))
    if tokens != b * g:
      raise RuntimeError(f"{cell.name} at G={g} wrote {tokens} tokens, not {b * g}: the model "
                         "must have no stop ids for this benchmark.")
    best, median, nfe = min(ts), statistics.median(ts), int(out.nfe)
    rec = {"decoder": cell.name, "method": cell.method, "options": cell.options,
           "gen_length": g, "block_length": k, "batch": b, "nfe": nfe,
           "steps": int(out.steps), "response_tokens": tokens, "wall_best_s": best,
           "wall_median_s": median, "wall_all_s": ts,
           "compile_s": max(compile_s[cell.name] - best, 0.0),
           "tokens_per_s": tokens / best, "tokens_per_s_median": tokens / median,
           "s_per_forward": best / nfe, "tokens_per_forward": tokens / b / nfe,
           "forward_slots_per_step": None}
    if cell.method == "d2f":
      rec["forward_slots_per_step"] = _forward_slots(params, cfg, cell, batch, g)
    records.append(rec)
  full = next((r for r in records if r["decoder"] == "d2f full"), None)
  for r in records:
    r["vs_d2f_full"] = None if full is None else full["wall_best_s"] / r["wall_best_s"]
    r["vs_d2f_full_median"] = (None if full is None
                               else full["wall_median_s"] / r["wall_median_s"])
  return records


def check_config(config) -> None:
  """Raises ValueError naming the bad setting before anything is compiled."""
  for g, k in config.shapes:
    if g <= 0 or k <= 0 or g % k:
      raise ValueError(f"shape (G={g}, k={k}): G must be a positive multiple of k.")
  if not 1 <= config.min_prompt_len <= config.max_prompt_len:
    raise ValueError("need 1 <= min_prompt_len <= max_prompt_len.")
  unknown = sorted(set(config.methods) - {"d2f", "ar", "llada", "fast_dllm"})
  if unknown:
    raise ValueError(f"Unknown method(s) {unknown}; use d2f, ar, llada, fast_dllm.")
  if config.repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {config.repeats}.")


def run(config, workdir) -> dict:
  """Runs every (G, k) x B group of `config` (configs/bench_decode.py), writes
  bench_decode.{json,md} to `workdir`, prints the table and returns the JSON document."""
  check_config(config)
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  cfg = bench_model(config)
  params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(config.seed))
  load_before, start = os.getloadavg(), time.perf_counter()
  records = []
  for g, k in config.shapes:
    for b in config.batches:
      records += measure_group(config, cfg, params, int(g), int(k), int(b))
      print(f"done G={g} k={k} B={b}", flush=True)
  doc = {"schema_version": SCHEMA_VERSION, "kind": "bench_decode",
         "machine": {**accounting.machine_info(), "loadavg_before": list(load_before),
                     "loadavg_after": list(os.getloadavg())},
         "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers,
                   "vocab_size": cfg.vocab_size, "params": cfg.num_params()},
         "config": config.to_dict(), "elapsed_s": time.perf_counter() - start,
         "cells": records}
  (workdir / "bench_decode.json").write_text(json.dumps(doc, indent=1, default=str))
  table = markdown(doc)
  (workdir / "bench_decode.md").write_text(table + "\n")
  print(table)
  return doc


def markdown(doc: dict) -> str:
  """The benchmark table: one row per cell, grouped by (G, k, B)."""
  m = doc["model"]
  lines = [f"Decode benchmark: random-weight model d={m['d_model']}, {m['n_layers']} layers, "
           f"vocab {m['vocab_size']} ({m['params']:,} params), no stop ids; fastest of "
           f"{doc['config']['repeats']} interleaved repeats (median in brackets).", "",
           "| G | k | B | decoder | NFE | slots/step | tok/s | s/forward | vs d2f full |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in doc["cells"]:
    slots = "" if r["forward_slots_per_step"] is None else f"{r['forward_slots_per_step']:.1f}"
    vs = ("" if r["vs_d2f_full"] is None
          else f"{r['vs_d2f_full']:.2f}x ({r['vs_d2f_full_median']:.2f}x)")
    lines.append(f"| {r['gen_length']} | {r['block_length']} | {r['batch']} | {r['decoder']} | "
                 f"{r['nfe']} | {slots} | {r['tokens_per_s']:.0f} | "
                 f"{r['s_per_forward'] * 1e3:.3f} ms | {vs} |")
  return "\n".join(lines)
