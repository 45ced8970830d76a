"""Scaling mode of the speed study: how each decoder's cost grows with what it writes.

Shape legend: B batch rows, P prompt length, G generated tokens per row, T = P + G canvas,
D model width, k block length, A D2F blocks in flight, N = G // k blocks.

Every cell (decoder, G, B, D) decodes random prompts with a random-weight model whose stop
ids are removed, so every row writes exactly G tokens and the forward count depends only on
the decoder's schedule. Each decoder runs at a setting that commits one token per forward
(LLaDA steps = G, threshold > 1, block diffusion steps = k), through the real jitted decoder
(`decoding.generate`): a warm-up call compiles, then the median of up to `repeats` calls is
the wall time (dispatch to result on the host).

Per cell: `nfe` batched forwards (read from the DecodeOutput, never assumed); `t_fwd =
wall / nfe` seconds per forward; `s_per_token = wall / (B * G)`; `tokens_per_s`; an
estimated FLOP count (dense 2 * params per slot plus 4 * L * D per query-key pair, from the
schedule in `Decoder.plan`) and the GFLOP/s it implies; and
`breakeven = t_fwd / t_fwd(AR at the same G, B, D)`: a parallel decoder beats AR on this
machine only if it commits more than that many tokens per forward. That ratio is exact for
single-kind schedules (LLaDA, no-cache Fast-dLLM); for cached schedules it is a lower bound,
since committing more per forward leaves the same refresh forwards and fewer cheap ones.
`fwd_per_weight_read = t_fwd / (param bytes / memory bandwidth)` places each forward
against the weight-streaming bound (`roofline.py`): near 1, a forward over a window costs one
AR step and parallel decoding pays by its whole tokens-per-forward.

The grid is three lines through (G, B, D): lengths at a fixed batch and width, batches at a
fixed length and width, widths at a fixed length and batch. A cell whose estimated compute
exceeds `max_cell_tflop` is skipped and listed, with the reason, in every output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from dllm_jax.decoding import api
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import init_params
from studylib import accounting, roofline

SCHEMA_VERSION = 2  # 2: param_bytes, weight_read_s and fwd_per_weight_read per cell
MASK_ID, PAD_ID, BOS_ID = 3, 0, 1
FIRST_PROMPT_ID = 4  # prompt tokens are drawn from [4, vocab): never a special id


@dataclasses.dataclass(frozen=True)
class Decoder:
  """A decoder at its one-token-per-forward setting.

  `options(G, c)` gives the `generate` options (c: the scaling config); `plan(P, G, k, A)`
  lists its forwards per row as (count, query slots, mean key slots), the schedule the
  FLOP estimate uses (exact counts except for D2F, whose bound is G forwards). The first
  forward of D2F and block diffusion carries the prompt plus block 0.
  """
  name: str
  method: str
  options: Callable[[int, object], dict]
  plan: Callable[[int, int, int, int], list[tuple[int, int, float]]]
  blocked: bool = True  # G must be a multiple of the block length


def _prefix_plan(p, g, k, a):
  t = p + g
  return [(g // k, t, t)] + [(k - 1, g - n * k, t) for n in range(g // k)]


DECODERS: dict[str, Decoder] = {d.name: d for d in (
    Decoder("ar", "ar", lambda g, c: {},
            lambda p, g, k, a: [(1, p, p), (g - 1, 1, p + g / 2)], blocked=False),
    Decoder("llada", "llada", lambda g, c: {"steps": g},
            lambda p, g, k, a: [(g, p + g, p + g)], blocked=False),
    Decoder("fast_dllm_none", "fast_dllm",
            lambda g, c: {"block_length": c.block_length, "threshold": 2.0, "cache": "none"},
            lambda p, g, k, a: [(g, p + g, p + g)]),
    Decoder("fast_dllm_prefix", "fast_dllm",
            lambda g, c: {"block_length": c.block_length, "threshold": 2.0, "cache": "prefix"},
            _prefix_plan),
    Decoder("fast_dllm_dual", "fast_dllm",
            lambda g, c: {"block_length": c.block_length, "threshold": 2.0, "cache": "dual"},
            lambda p, g, k, a: [(g // k, p + g, p + g), (g - g // k, k, p + g)]),
    Decoder("d2f", "d2f",
            lambda g, c: {"block_length": c.block_length, "tau_conf": 2.0, "tau_add": c.d2f_tau_add,
                          "tau_act": c.d2f_tau_act, "max_active_blocks": c.d2f_max_active_blocks},
            lambda p, g, k, a: [(1, p + k, p + k), (g - 1, a * k, p + g / 2)]),
    Decoder("block_diffusion", "block_diffusion",
            lambda g, c: {"block_length": c.block_length, "steps_per_block": c.block_length},
            lambda p, g, k, a: [(1, p + k, p + k), (g // k - 1, 2 * k, p + g / 2),
                                (g - g // k, k, p + g / 2)]),
)}


def width_config(d_model: int, *, vocab_size: int, max_seq_len: int,
                 dtype: str = "float32") -> ModelConfig:
  """The model of width D: max(2, D/64) layers and heads (head dim 32 at D=64, else 64),
  MLP 3D, no stop ids (every row writes all G tokens). D=64: 0.14M params, 256: 3.5M,
  768: 92M, 1792: 1.2B (vocab 260). `dtype` is both the parameter and the compute dtype."""
  if d_model < 64 or d_model % 64:
    raise ValueError(f"width {d_model} must be a positive multiple of 64 (heads of 64).")
  heads = max(2, d_model // 64)
  return ModelConfig(vocab_size=vocab_size, d_model=d_model, n_layers=heads, n_heads=heads,
                     n_kv_heads=heads, mlp_dim=3 * d_model, max_seq_len=max_seq_len,
                     mask_token_id=MASK_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
                     eos_token_id=None, eot_token_id=None, param_dtype=dtype, dtype=dtype,
                     name=f"scaling_d{d_model}")


def estimate_flops(cfg: ModelConfig, plan, batch: int) -> float:
  """FLOPs of a decode: 2 * dense params per query slot + 4 * L * H * Dh per query-key pair."""
  dense = cfg.num_params(include_embeddings=False) + cfg.d_model * cfg.vocab_size
  attn = 4 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim
  return float(batch * sum(n * (2 * dense * q + attn * q * keys) for n, q, keys in plan))


def grid(config) -> list[tuple[int, int, int]]:
  """The (G, B, D) cells: the three sweep lines of the config, deduplicated, in order."""
  lines = ([(g, config.lengths.batch, config.lengths.width) for g in config.lengths.sweep]
           + [(config.batches.gen_length, b, config.batches.width)
              for b in config.batches.sweep]
           + [(config.widths.gen_length, config.widths.batch, d) for d in config.widths.sweep])
  return list(dict.fromkeys((int(g), int(b), int(d)) for g, b, d in lines))


def check_config(config) -> None:
  """Raises ValueError naming the bad setting, before anything is built or compiled."""
  unknown = sorted(set(config.decoders) - set(DECODERS))
  if unknown:
    raise ValueError(f"Unknown decoder(s) {unknown}; use some of {sorted(DECODERS)}.")
  if "ar" not in config.decoders:
    raise ValueError("decoders must include 'ar': every breakeven is relative to it.")
  for g, b, d in grid(config):
    if g <= 0 or b <= 0:
      raise ValueError(f"gen_length {g} and batch {b} must be positive.")
    width_config(d, vocab_size=config.vocab_size, max_seq_len=config.prompt_len + g,
                 dtype=config.get("dtype", "float32"))
  if config.vocab_size <= FIRST_PROMPT_ID or config.prompt_len <= 0:
    raise ValueError(f"need vocab_size > {FIRST_PROMPT_ID} and prompt_len > 0.")
  if config.block_length < 1 or config.d2f_max_active_blocks < 1:
    raise ValueError(f"block_length ({config.block_length}) and d2f_max_active_blocks "
                     f"({config.d2f_max_active_blocks}) must be >= 1.")
  if config.repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {config.repeats}.")


def _skip_reason(dec: Decoder, config, cfg: ModelConfig, g: int, b: int) -> str | None:
  k, a = config.block_length, config.d2f_max_active_blocks
  if dec.blocked and g % k:
    return f"G={g} is not a multiple of block_length={k}"
  if dec.name == "d2f" and g // k < a:
    return f"G/k={g // k} blocks < d2f_max_active_blocks={a}"
  flops = estimate_flops(cfg, dec.plan(config.prompt_len, g, k, a), b)
  cap = config.max_cell_tflop
  if cap and flops > cap * 1e12:
    return f"estimated {flops / 1e12:.2f} TFLOP per decode > max_cell_tflop={cap}"
  return None


def _time(call, repeats: int, budget_s: float):
  """Warm-up (compile) call, then up to `repeats` timed calls, stopping early once the timed
  calls have taken `budget_s`. Returns (first call s, [timed s], last output)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(call())
  first = time.perf_counter() - t0
  times = []
  while len(times) < repeats and (not times or sum(times) < budget_s):
    t0 = time.perf_counter()
    out = jax.block_until_ready(call())
    times.append(time.perf_counter() - t0)
  return first, times, out


def measure(dec: Decoder, config, cfg: ModelConfig, params, g: int, b: int) -> dict:
  """Runs one cell and returns its figures (breakeven filled in later by `add_breakevens`)."""
  rng = np.random.default_rng(config.seed)
  tokens = rng.integers(FIRST_PROMPT_ID, cfg.vocab_size, (b, config.prompt_len), np.int32)
  valid = np.ones_like(tokens, bool)
  options = dict(dec.options(g, config), gen_length=g)
  call = lambda: api.generate(params, cfg, (tokens, valid), method=dec.method,
                              rng=jax.random.key(config.seed), **options)
  first, times, out = _time(call, config.repeats, config.timing_budget_s)
  lengths, committed = np.asarray(out.lengths), np.asarray(out.committed)
  if not (np.all(lengths == g) and np.all(committed == g)):
    raise RuntimeError(f"{dec.name} at G={g} wrote lengths {lengths.tolist()} / committed "
                       f"{committed.tolist()}, not {g} per row: the NFE figures would be wrong.")
  wall, nfe = statistics.median(times), int(out.nfe)
  plan = dec.plan(config.prompt_len, g, config.block_length, config.d2f_max_active_blocks)
  flops = estimate_flops(cfg, plan, b)
  return {
      "decoder": dec.name, "method": dec.method, "options": options, "gen_length": g,
      "batch": b, "width": cfg.d_model, "params": cfg.num_params(), "nfe": nfe,
      "nfe_plan": int(sum(n for n, _, _ in plan)), "steps": int(out.steps),
      "wall_s": wall, "wall_all_s": times, "compile_s": max(first - wall, 0.0),
      "t_fwd_s": wall / nfe, "s_per_token": wall / (b * g), "tokens_per_s": b * g / wall,
      "tokens_per_forward": g / nfe, "est_gflop": flops / 1e9,
      "est_gflop_per_s": flops / 1e9 / wall, "breakeven": None, "vs_ar": None,
      "param_bytes": roofline.param_bytes(params),
  }


def add_roofline(cells: list[dict], bandwidth_gbps: float) -> None:
  """Fills `weight_read_s` (param bytes / bandwidth: the least time any forward can take
  at batch 1) and `fwd_per_weight_read` (t_fwd over it: 1.0 is at the weight-streaming bound;
  an AR cell's bound in tokens/s is batch / weight_read_s)."""
  for c in cells:
    c["weight_read_s"] = c["param_bytes"] / (bandwidth_gbps * 1e9)
    c["fwd_per_weight_read"] = c["t_fwd_s"] / c["weight_read_s"]


def add_breakevens(cells: list[dict]) -> None:
  """Fills `breakeven` (t_fwd / t_fwd of AR) and `vs_ar` (AR's s/token over this one's)."""
  ar = {(c["gen_length"], c["batch"], c["width"]): c for c in cells if c["decoder"] == "ar"}
  for c in cells:
    ref = ar.get((c["gen_length"], c["batch"], c["width"]))
    if ref is not None:
      c["breakeven"] = c["t_fwd_s"] / ref["t_fwd_s"]
      c["vs_ar"] = ref["s_per_token"] / c["s_per_token"]


def run(config, workdir) -> dict:
  """Runs the sweep of `config` (configs/scaling.py) and writes scaling.{json,md} and plots
  to `workdir`. Returns the JSON document."""
  from tqdm import tqdm
  check_config(config)
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  cells = grid(config)
  longest = {}
  for g, _, d in cells:
    longest[d] = max(longest.get(d, 0), g)
  models = {d: width_config(d, vocab_size=config.vocab_size,
                            max_seq_len=config.prompt_len + longest[d],
                            dtype=config.get("dtype", "float32")) for d in longest}
  jobs, skipped = [], []
  for g, b, d in cells:
    for name in config.decoders:
      reason = _skip_reason(DECODERS[name], config, models[d], g, b)
      if reason is None:
        jobs.append((DECODERS[name], g, b, d))
      else:
        skipped.append({"decoder": name, "gen_length": g, "batch": b, "width": d,
                        "params": models[d].num_params(), "reason": reason})
  jobs.sort(key=lambda job: job[3])  # one width's params in memory at a time
  load_before, t_start = os.getloadavg(), time.perf_counter()
  results, params = [], {}
  bar = tqdm(jobs, desc="scaling", unit="cell")
  for dec, g, b, d in bar:
    bar.set_postfix_str(f"{dec.name} G={g} B={b} D={d}")
    if d not in params:
      params = {d: jax.jit(init_params, static_argnums=0)(models[d], jax.random.key(config.seed))}
    results.append(measure(dec, config, models[d], params[d], g, b))
  add_breakevens(results)
  bandwidth = roofline.memory_bandwidth(float(config.get("memory_bandwidth_gbps", 0.0)))
  add_roofline(results, bandwidth["gbps"])
  doc = {"schema_version": SCHEMA_VERSION, "kind": "scaling",
         "machine": {**accounting.machine_info(),
                     "memory_bandwidth": bandwidth,
                     "loadavg_before": list(load_before),
                     "loadavg_after": list(os.getloadavg())},
         "config": config.to_dict(), "elapsed_s": time.perf_counter() - t_start,
         "cells": results, "skipped": skipped}
  write_outputs(doc, workdir)
  print(markdown(doc))
  return doc


def write_outputs(doc: dict, workdir) -> None:
  """Writes scaling.json, scaling.md and the plots (also to redraw a loaded document); the
  cost-against-length plot only when the config has a length line."""
  validate(doc)
  workdir = Path(workdir)
  (workdir / "scaling.json").write_text(json.dumps(doc, indent=1, default=str))
  (workdir / "scaling.md").write_text(markdown(doc) + "\n")
  if doc["config"]["lengths"]["sweep"]:
    plot_cost(doc, workdir / "cost_vs_length.png")
  plot_breakeven(doc, workdir / "breakeven_vs_width.png")


_CELL_FIELDS = {"decoder": str, "gen_length": int, "batch": int, "width": int, "params": int,
                "nfe": int, "wall_s": float, "t_fwd_s": float, "s_per_token": float,
                "tokens_per_s": float, "est_gflop_per_s": float, "param_bytes": int,
                "weight_read_s": float, "fwd_per_weight_read": float}


def validate(doc: dict) -> None:
  """Raises ValueError if `doc` is not a scaling document of the current schema."""
  if doc.get("schema_version") != SCHEMA_VERSION or doc.get("kind") != "scaling":
    raise ValueError(f"not a scaling document of schema {SCHEMA_VERSION}.")
  for key in ("machine", "config", "cells", "skipped", "elapsed_s"):
    if key not in doc:
      raise ValueError(f"scaling JSON lacks {key!r}.")
  for i, cell in enumerate(doc["cells"]):
    for field, kind in _CELL_FIELDS.items():
      value = cell.get(field)
      ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
      if not ok or isinstance(value, bool):
        raise ValueError(f"cell {i} field {field!r} is {value!r}, not {kind.__name__}.")
    if cell["nfe"] < 1 or not cell["wall_s"] > 0:
      raise ValueError(f"cell {i} has nfe {cell['nfe']} and wall {cell['wall_s']}.")
    if cell["breakeven"] is not None and not cell["breakeven"] > 0:
      raise ValueError(f"cell {i} breakeven {cell['breakeven']} is not positive.")


def markdown(doc: dict) -> str:
  """The cells as a Markdown table, then the skipped cells with their reasons."""
  m = doc["machine"]
  lines = [f"Scaling sweep on {m.get('cpu_model', m['processor'])} ({m['platform']}, {m['cpu_count']} CPUs), "
           f"load {m['loadavg_before'][0]:.1f} -> {m['loadavg_after'][0]:.1f}, "
           f"{doc['elapsed_s']:.0f} s.", "",
           "| decoder | G | batch | width | params | NFE | wall (s) | t_fwd (ms) | "
           "ms/token | tokens/s | est. GFLOP/s | breakeven tok/fwd | t_fwd / weight read |",
           "|" + "---|" * 13]
  for c in doc["cells"]:
    be = "n/a" if c["breakeven"] is None else f"{c['breakeven']:.2f}"
    lines.append(
        f"| {c['decoder']} | {c['gen_length']} | {c['batch']} | {c['width']} | "
        f"{c['params'] / 1e6:.2f}M | {c['nfe']} | {c['wall_s']:.3f} | {1e3 * c['t_fwd_s']:.2f} "
        f"| {1e3 * c['s_per_token']:.3f} | {c['tokens_per_s']:.0f} | "
        f"{c['est_gflop_per_s']:.1f} | {be} | {c['fwd_per_weight_read']:.1f} |")
  bw = m["memory_bandwidth"]
  lines += ["", f"Memory bandwidth {bw['gbps']:.0f} GB/s ({bw['source']}). *t_fwd / weight "
            "read*: a forward's time over the time to read every weight once (param bytes / "
            "bandwidth); 1.0 is the weight-streaming bound, where a forward over a window costs "
            "one AR step."]
  if doc["skipped"]:
    lines += ["", "Skipped cells (not measured):", ""]
    lines += [f"- {s['decoder']} G={s['gen_length']} batch={s['batch']} width={s['width']}: "
              f"{s['reason']}" for s in doc["skipped"]]
  return "\n".join(lines)


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _color(plt, name: str):
  """One colour per decoder, the same in every plot."""
  return plt.get_cmap("tab10")(list(DECODERS).index(name) % 10)


def _line(doc, fixed: dict, x: str):
  """{decoder: sorted [(x, cell)]} of the cells matching `fixed` (one sweep line)."""
  out = {}
  for c in doc["cells"]:
    if all(c[k] == v for k, v in fixed.items()):
      out.setdefault(c["decoder"], []).append((c[x], c))
  return {k: sorted(v, key=lambda p: p[0]) for k, v in out.items()}


def plot_cost(doc: dict, path) -> None:
  """Seconds per generated token and per forward against G (log-log), one line per decoder."""
  plt = _pyplot()
  sweep = doc["config"]["lengths"]
  lines = _line(doc, {"batch": sweep["batch"], "width": sweep["width"]}, "gen_length")
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
  for ax, key, label in ((axes[0], "s_per_token", "seconds per generated token"),
                         (axes[1], "t_fwd_s", "seconds per forward")):
    for name, pts in lines.items():
      ax.plot([p[0] for p in pts], [p[1][key] for p in pts], "o-", label=name,
              color=_color(plt, name))
    ax.set(xscale="log", yscale="log", xlabel="G (tokens written per row)", ylabel=label,
           title=f"{label}: batch {sweep['batch']}, width {sweep['width']}")
    ax.grid(alpha=0.3, which="both")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_breakeven(doc: dict, path) -> None:
  """Tokens per forward a parallel decoder needs to beat AR, against model size and G."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
  w, n = doc["config"]["widths"], doc["config"]["lengths"]
  panels = ((axes[0], _line(doc, {"gen_length": w["gen_length"], "batch": w["batch"]},
                            "params"), "parameters", f"G={w['gen_length']}, batch {w['batch']}"),
            (axes[1], _line(doc, {"batch": n["batch"], "width": n["width"]}, "gen_length"),
             "G (tokens written per row)", f"width {n['width']}, batch {n['batch']}"))
  for ax, lines, xlabel, title in panels:
    for name, pts in lines.items():
      pts = [p for p in pts if p[1]["breakeven"] is not None]
      if name != "ar" and pts:
        ax.plot([p[0] for p in pts], [p[1]["breakeven"] for p in pts], "o-", label=name,
                color=_color(plt, name))

    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="AR (1 token/forward)")
    ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="breakeven tokens per forward",
           title=f"beats AR above its curve: {title}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
  sizes = {p[1]["params"]: p[1]["width"] for pts in panels[0][1].values() for p in pts}
  if sizes:  # label each model size with its width
    axes[0].set_xticks(sorted(sizes), [f"D={sizes[n]}\n{n / 1e6:.2g}M" for n in sorted(sizes)])
    axes[0].xaxis.set_minor_locator(plt.NullLocator())
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
