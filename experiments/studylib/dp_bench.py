"""Data-parallel decode benchmark: one while_loop per data shard (shard_map) against one SPMD
loop over the whole batch, on a batch whose rows stop at very different lengths.

Shape legend: B batch rows (one per data shard here), P padded prompt length, G gen_length.

The model is a random-weight tiny model whose EOS id is chosen from its own greedy AR
output (`uneven_batch`): one row never emits it (it runs all G tokens), the others emit it
within their first tokens. Under SPMD every device steps until that long row is done;
under shard_map only its shard does. Each method's two cells are timed interleaved, repeat
by repeat (the fastest and the median count, as in `runner.py`), through the public
`generate`, and must give identical tokens or the run fails.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import api, data_parallel
from dllm_jax.models import get_preset
from dllm_jax.models.transformer import abstract_params
from dllm_jax.parallel import mesh as mesh_lib

SCHEMA_VERSION = 1


def random_params(cfg, seed: int = 0, std: float = 0.3, head_std: float = 0.7):
  """Random weights peaked enough that greedy choices rarely tie (norm scales are 1)."""
  rs = np.random.default_rng(seed)
  import flax.linen as nn

  def leaf(path, shape):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return jnp.ones(shape.shape, jnp.float32)
    sd = head_std if ("lm_head" in name or "embed" in name) else std
    return jnp.asarray(rs.normal(0.0, sd, shape.shape), jnp.float32)
  return jax.tree_util.tree_map_with_path(leaf, nn.unbox(abstract_params(cfg)))


def uneven_batch(params, cfg, *, gen_length: int, rows: int = 8, candidates: int = 64,
                 seed: int = 0, method: str = "ar", **options):
  """(cfg with an EOS id, `rows` prompts): row 0's greedy `method` answer (without a stop
  id) never holds the EOS, every other row's holds it in its first two tokens, so with that
  EOS row 0 is the one long row (the answers before a stop do not change)."""
  rs = np.random.default_rng(seed)
  first = 4 + (cfg.mask_token_id is not None)
  high = cfg.vocab_size
  special = {cfg.mask_token_id, cfg.pad_token_id, cfg.bos_token_id}
  prompts = [[int(t) for t in rs.integers(first, high, rs.integers(2, 6))]
             for _ in range(candidates)]
  plain = cfg.replace(eos_token_id=None, eot_token_id=None)
  tokens = np.asarray(api.generate(params, plain, prompts, method=method,
                                   gen_length=gen_length, **options).tokens)
  best = None
  for t in range(cfg.vocab_size):
    if t in special:
      continue
    early = [i for i in range(candidates) if t in tokens[i, :2]]
    never = [i for i in range(candidates) if t not in tokens[i]]
    if len(early) >= rows - 1 and never:
      best = (t, never[0], early[:rows - 1])
      break
  if best is None:
    raise RuntimeError("no token splits the candidate prompts into one long and "
                       f"{rows - 1} short rows; raise `candidates`.")
  eos, long_row, short = best
  return cfg.replace(eos_token_id=eos, eot_token_id=None), \
      [prompts[long_row]] + [prompts[i] for i in short]


def _time(fn):
  start = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  return time.perf_counter() - start, out


def run(config, workdir: str | None = None) -> dict:
  """Times shard_map vs SPMD per method; prints a table and writes dp_bench.json."""
  n = len(jax.devices())
  cfg = get_preset(config.preset)
  params = random_params(cfg, config.seed)
  cfg, prompts = uneven_batch(params, cfg, gen_length=config.gen_length, rows=n,
                              seed=config.seed, method=config.uneven_method,
                              **dict(config.options.get(config.uneven_method, {})))
  mesh = mesh_lib.make_mesh({"data": n})
  rng = jax.random.key(config.seed)
  results = []
  for method in config.methods:
    kw = dict(gen_length=config.gen_length, **dict(config.options.get(method, {})),
              temperature=config.temperature)
    tokens, valid = api.as_prompt_batch(cfg, prompts)
    _, stats = data_parallel.decode(params, cfg, tokens, valid, rng, mesh=mesh, method=method,
                                    **kw)
    cells = {mode: (lambda mode=mode: api.generate(params, cfg, prompts, method=method,
                                                   rng=rng, mesh=mesh, data_parallel=mode,
                                                   **kw))
             for mode in ("shard_map", "spmd")}
    walls = {m: [] for m in cells}
    outs = {m: _time(f)[1] for m, f in cells.items()}   # compile
    for _ in range(config.repeats):
      for m, f in cells.items():
        walls[m].append(_time(f)[0])
    same = np.array_equal(np.asarray(outs["shard_map"].tokens), np.asarray(outs["spmd"].tokens))
    if not same:
      raise AssertionError(f"{method}: shard_map and SPMD tokens differ")
    row = {"method": method, "options": kw, "tokens_equal": same,
           "lengths": np.asarray(outs["spmd"].lengths).tolist(),
           "spmd_steps": int(outs["spmd"].steps), "shard_steps": stats.steps.tolist()}
    for m in cells:
      row[f"{m}_wall_min_s"] = min(walls[m])
      row[f"{m}_wall_median_s"] = statistics.median(walls[m])
    row["speedup_min"] = row["spmd_wall_min_s"] / row["shard_map_wall_min_s"]
    results.append(row)
  report = {"schema": SCHEMA_VERSION, "devices": n, "preset": config.preset,
            "gen_length": config.gen_length, "temperature": config.temperature,
            "repeats": config.repeats, "eos_token_id": cfg.eos_token_id,
            "prompts": prompts, "results": results}
  print(table(report))
  if workdir:
    Path(workdir).mkdir(parents=True, exist_ok=True)
    (Path(workdir) / "dp_bench.json").write_text(json.dumps(report, indent=1))
  return report


def table(report: dict) -> str:
  """A Markdown table of the report."""
  lines = [f"{report['devices']} devices, G={report['gen_length']}, temperature "
           f"{report['temperature']}, fastest / median of {report['repeats']} repeats",
           "", "| method | SPMD wall ms | shard_map wall ms | speedup | SPMD steps | "
           "shard_map steps per device |", "|---|---|---|---|---|---|"]
  for r in report["results"]:
    lines.append(
        f"| {r['method']} | {1e3 * r['spmd_wall_min_s']:.1f} / {1e3 * r['spmd_wall_median_s']:.1f}"
        f" | {1e3 * r['shard_map_wall_min_s']:.1f} / {1e3 * r['shard_map_wall_median_s']:.1f}"
        f" | {r['speedup_min']:.2f}x | {r['spmd_steps']} | {r['shard_steps']} |")
  return "\n".join(lines)
