"""The decode step's own cost: each decoder's jitted step against a bare jitted forward over
the same slots and cache.

Shape legend: B batch rows, P padded prompt length, G generated tokens per row, k block
length, S cache slots, T forward slots.

A decoder's step (`protocol.Decoder.step`) is a model forward plus the decoder's own work
(confidences, ranking, commit rules, gathers, cache writes, the loop condition). To split the
two, the step is first run once eagerly (`jax.disable_jit`) on a mid-decode state with
`Transformer.apply` and `transformer.project` spied on: every forward and LM-head call it
makes is recorded with its concrete inputs (tokens, ids, positions, cache, ...; a hybrid's
drafter forwards included, once per loop iteration they run). The *bare forward* is one
jitted program that makes exactly those calls on those inputs and nothing else. Both
programs are then timed interleaved, repeat by repeat, on the same state (the step is not
donated here), and XLA's cost analysis of both compiled programs gives flops and bytes
accessed. own work = step - bare forward.

Each is timed two ways: per call (a jitted call per step, its dispatch included: what a
Python-loop decode pays) and in a loop (`looped`: `config.loop_steps` calls inside one
compiled loop, each fed its inputs plus the loop index times a run-time zero, so nothing is
hoisted or dropped and no call is dispatched: what a step costs inside the decode's
`while_loop`). At
the tiny shape a call's dispatch is most of its time, and it grows with the number of arrays
passed (a decoder state has many, a bare forward few), so the per-call ratio there measures
dispatch more than the decoder's own work.

States are taken at `config.points` fractions of the decode (by the greedy decode's step
count), so a decoder whose steps differ along the decode (D2F's window, Fast-dLLM's block
refreshes) is measured at several; the table sums them.

A third table: AR's decode-step forward in float32 against bfloat16 (`dtype_scales`), the
fast compute dtype of the platform (`loading.platform_dtype` picks float32 on CPU).

A second table: a batch of rows with different prompt lengths and different finishing steps
decoded by `generate` against the same rows decoded one at a time at batch 1 (the sum of
their times), per decoder. Its model is the benchmark's with every logit times
`config.head_scale` (`peaked`): random weights at scale 1 propose near-uniform tokens, so
every threshold decoder commits one token per step and all rows finish together; peaked,
rows commit at different rates (the table lists each row's NFE alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from dllm_jax.decoding import api, protocol
from dllm_jax.models import transformer
from dllm_jax.models.config import ModelConfig, get_preset
from dllm_jax.models.transformer import Transformer, init_params
from studylib import decode_bench

SCHEMA_VERSION = 2  # 2: the in-loop timings (loop_steps, *_loop_*)
# The decode benchmark's special ids and random left-padded prompts (seeded by batch size).
MASK_ID, PAD_ID, BOS_ID = decode_bench.MASK_ID, decode_bench.PAD_ID, decode_bench.BOS_ID
prompts = decode_bench.prompts


# ----------------------------------------------------------------------------- models

def bench_model(config, scale: str, longest: int) -> ModelConfig:
  """The benchmark's LLaDA-shaped model at `scale` ("tiny": config.tiny's shape, or a
  preset name such as "base_100m"), with a mask id and no stop ids (every row writes G)."""
  if scale == "tiny":
    m = config.tiny
    return ModelConfig(
        name="step_bench_tiny", vocab_size=m.vocab_size, d_model=m.d_model,
        n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_heads, mlp_dim=m.mlp_dim,
        max_seq_len=longest, mask_token_id=MASK_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
        eos_token_id=None, eot_token_id=None)
  return get_preset(scale, max_seq_len=max(longest, 128), mask_token_id=MASK_ID,
                    pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=None,
                    eot_token_id=None)


def peaked(params, head_scale: float):
  """`params` with the final norm's scale times `head_scale` (every logit times it): a
  random model whose proposals are confident enough to pass a threshold on some slots, so
  threshold decoders commit at different rates on different prompts and rows finish at
  different steps (at scale 1 every row commits one token per step, in lockstep)."""
  if head_scale == 1.0:
    return params
  norm = dict(params["final_norm"], scale=params["final_norm"]["scale"] * head_scale)
  return dict(params, final_norm=norm)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One decoder setting."""
  name: str
  method: str
  options: dict
  shifted: bool = False  # Dream: the model predicts token i at output i - 1


def cells(config) -> list[Cell]:
  k = config.block_length
  taus = dict(config.d2f_taus)
  every = [
      Cell("ar", "ar", {}),
      Cell("llada", "llada", {"block_length": k, "steps": config.gen_length}),
      Cell("dream", "dream", {"steps": config.gen_length}, shifted=True),
      Cell("fast_dllm none", "fast_dllm", {"block_length": k, "cache": "none",
                                          "threshold": config.threshold}),
      Cell("fast_dllm prefix", "fast_dllm", {"block_length": k, "cache": "prefix",
                                            "threshold": config.threshold}),
      Cell("fast_dllm dual", "fast_dllm", {"block_length": k, "cache": "dual",
                                          "threshold": config.threshold}),
      Cell("d2f", "d2f", {"block_length": k, **taus}),
      Cell("block_diffusion", "block_diffusion", {"block_length": k}),
      Cell("speculative", "speculative", {"drafter": "ar", "draft_length": config.draft_length}),
      Cell("selfspec", "selfspec", {"draft_length": config.draft_length}),
  ]
  return [c for c in every if c.name in config.decoders or c.method in config.decoders]


# ----------------------------------------------------------------------------- the spy

@dataclasses.dataclass
class Call:
  """One recorded model call: a forward (`Transformer(cfg).apply`) or an LM head
  (`transformer.project`), with its concrete inputs (host arrays) and static arguments."""
  kind: str
  cfg: ModelConfig
  params_index: int  # 0: the decoded model's params, 1: the drafter's
  arrays: dict
  static: dict


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _split(kwargs: dict) -> tuple[dict, dict]:
  arrays, static = {}, {}
  for name, value in kwargs.items():
    leaves = jax.tree.leaves(value)
    if leaves and all(_is_array(leaf) for leaf in leaves):
      arrays[name] = jax.device_get(value)
    else:
      static[name] = value
  return arrays, static


@contextlib.contextmanager
def spy(calls: list[Call], param_trees: list):
  """Records every forward and LM-head call while active (run the step eagerly)."""
  firsts = [id(jax.tree.leaves(p)[0]) for p in param_trees]

  def which(params) -> int:
    leaf = id(jax.tree.leaves(params)[0])
    return firsts.index(leaf) if leaf in firsts else 0

  original_apply, original_project = Transformer.apply, transformer.project

  def apply(self, variables, tokens, **kwargs):
    arrays, static = _split(dict(kwargs, tokens=tokens))
    calls.append(Call("forward", self.cfg, which(variables["params"]), arrays, static))
    return original_apply(self, variables, tokens, **kwargs)

  def project(params, cfg, hidden, at=None):
    arrays, static = _split({"hidden": hidden, "at": at} if at is not None
                            else {"hidden": hidden})
    calls.append(Call("project", cfg, which(params), arrays, static))
    return original_project(params, cfg, hidden, at)

  patched = [(m, "project") for m in list(sys.modules.values())
             if getattr(m, "__name__", "").startswith("dllm_jax.")
             and getattr(m, "project", None) is original_project]
  Transformer.apply = apply
  for module, name in patched:
    setattr(module, name, project)
  try:
    yield
  finally:
    Transformer.apply = original_apply
    for module, name in patched:
      setattr(module, name, original_project)


def bare_program(calls: list[Call]):
  """(jitted fn(param_trees, inputs), inputs): the recorded calls and nothing else."""
  specs = [(c.kind, c.cfg, c.params_index, tuple(sorted(c.static.items()))) for c in calls]
  inputs = [c.arrays for c in calls]

  def bare(param_trees, inputs):
    outs = []
    for (kind, cfg, index, static), arrays in zip(specs, inputs):
      params = param_trees[index]
      if kind == "forward":
        kwargs = dict(arrays, **dict(static))
        tokens = kwargs.pop("tokens")
        outs.append(Transformer(cfg).apply({"params": params}, tokens, **kwargs))
      else:
        outs.append(transformer.project(params, cfg, arrays["hidden"], arrays.get("at")))
    return outs

  return jax.jit(bare), inputs


# ----------------------------------------------------------------------------- timing

def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  cost = cost or {}
  return {"flops": float(cost.get("flops", 0.0)),
          "bytes": float(cost.get("bytes accessed", 0.0))}


def _time(fn, args, inner: int) -> float:
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(inner):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / inner


def _shifted(x, shift):
  """`x` + `shift` (an int32 [] that is zero at run time, unknown to the compiler) in x's own
  dtype; booleans xor'ed with shift != 0; PRNG keys as they are."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return x
  if x.dtype == bool:
    return x ^ (shift != 0)
  return x + shift.astype(x.dtype)


def looped(fn, n: int):
  """program(zero, params, *rest): `n` calls of fn(params, *rest) inside one compiled loop,
  the last one's output returned. Call i gets every array of `rest` plus i * zero, where
  `zero` is a run-time 0 (an int32 [] argument): the values are unchanged, but to the
  compiler each call's inputs differ, so it can neither hoist a call out of the loop nor
  drop one (`params` are left alone: what depends on them only is loop-invariant in a
  decode too). Its time / n is fn's cost per iteration of a compiled loop, with no dispatch."""
  if n < 1:
    raise ValueError(f"loop_steps must be >= 1, got {n}.")

  def call(i, zero, params, rest):
    shift = i * zero
    return fn(params, *jax.tree.map(lambda x: _shifted(x, shift), rest))

  def program(zero, params, *rest):
    return jax.lax.fori_loop(1, n, lambda i, _: call(i, zero, params, rest),
                             call(0, zero, params, rest))

  return jax.jit(program)


def states_along_decode(plan, params, tokens, valid, points) -> list:
  """Decoder states at `points` (fractions of the greedy decode's steps)."""
  decoder = plan.decoder
  args = (plan.params(params), tokens, valid, jax.random.key(0), plan.traced, plan.row_inputs)
  state = protocol.jit_init(*args, decoder=decoder)
  trail = [jax.device_get(state)]
  step = jax.jit(decoder.step)
  while bool(jax.device_get(decoder.running(state))) and len(trail) < 10_000:
    state = step(plan.params(params), state)
    trail.append(jax.device_get(state))
  last = max(len(trail) - 2, 0)  # the final state is done: no step left to take there
  return [trail[min(int(round(p * last)), last)] for p in points]


def measure_cell(config, cfg: ModelConfig, params, drafter, cell: Cell, batch) -> dict:
  options = dict(cell.options, gen_length=config.gen_length)
  if cell.method == "speculative":
    options.update(drafter_params=drafter, drafter_cfg=cfg)
  plan = protocol.plan(cell.method, cfg, options)
  decoder = plan.decoder
  tokens, valid = batch
  tokens, valid = jax.numpy.asarray(tokens), jax.numpy.asarray(valid)
  param_trees = [params, drafter]
  step = jax.jit(decoder.step)
  n = int(config.loop_steps)
  step_loop = looped(decoder.step, n)  # one program for every state (same shapes)
  zero = jax.numpy.zeros((), jax.numpy.int32)  # `looped`'s run-time zero
  rows = []
  for state in states_along_decode(plan, params, tokens, valid, config.points):
    state = jax.device_put(state)
    calls: list[Call] = []
    with spy(calls, param_trees), jax.disable_jit():
      decoder.step(plan.params(params), state)
    bare, inputs = bare_program(calls)
    step_args, bare_args = (plan.params(params), state), (param_trees, inputs)
    costs = {"step": _cost(step.lower(*step_args).compile()),
             "bare": _cost(bare.lower(*bare_args).compile())}
    bare_loop = looped(bare, n)
    times = {"step": [], "bare": [], "step_loop": [], "bare_loop": []}
    for _ in range(config.repeats):  # interleaved: noise hits both alike
      times["step"].append(_time(step, step_args, config.inner))
      times["bare"].append(_time(bare, bare_args, config.inner))
      times["step_loop"].append(_time(step_loop, (zero, *step_args), 1) / n)
      times["bare_loop"].append(_time(bare_loop, (zero, *bare_args), 1) / n)
    rows.append({"calls": [c.kind for c in calls], "times": times, "costs": costs})
  best = lambda key: sum(min(r["times"][key]) for r in rows)  # noqa: E731
  median = lambda key: sum(statistics.median(r["times"][key]) for r in rows)  # noqa: E731
  step_best, bare_best = best("step"), best("bare")
  step_median, bare_median = median("step"), median("bare")
  return {
      "decoder": cell.name, "method": cell.method, "options": cell.options,
      "batch": int(tokens.shape[0]), "points": list(config.points),
      "forward_calls": [r["calls"] for r in rows],
      "step_best_s": step_best, "bare_best_s": bare_best,
      "step_median_s": step_median, "bare_median_s": bare_median,
      "ratio_best": step_best / bare_best, "ratio_median": step_median / bare_median,
      "own_share": max(step_best - bare_best, 0.0) / step_best,
      "loop_steps": int(config.loop_steps),
      "step_loop_best_s": best("step_loop"), "bare_loop_best_s": best("bare_loop"),
      "ratio_loop_best": best("step_loop") / best("bare_loop"),
      "ratio_loop_median": median("step_loop") / median("bare_loop"),
      "step_flops": sum(r["costs"]["step"]["flops"] for r in rows),
      "bare_flops": sum(r["costs"]["bare"]["flops"] for r in rows),
      "step_bytes": sum(r["costs"]["step"]["bytes"] for r in rows),
      "bare_bytes": sum(r["costs"]["bare"]["bytes"] for r in rows),
  }


def measure_batch_cost(config, cfg, params, drafter, cell: Cell, batch) -> dict:
  """A batch decoded by `generate` against its rows decoded alone (sum of their times)."""
  tokens, valid = batch
  options = dict(cell.options, gen_length=config.gen_length)
  if cell.method == "speculative":
    options.update(drafter_params=drafter, drafter_cfg=cfg)

  def decode(t, v):
    return jax.block_until_ready(api.generate(params, cfg, (t, v), method=cell.method,
                                              **options))

  rows = [(tokens[i:i + 1], valid[i:i + 1]) for i in range(tokens.shape[0])]
  outs = [decode(*r) for r in rows] + [decode(tokens, valid)]  # compiles
  times = {"batch": [], "rows": []}
  for _ in range(config.repeats):
    start = time.perf_counter()
    decode(tokens, valid)
    times["batch"].append(time.perf_counter() - start)
    start = time.perf_counter()
    for r in rows:
      decode(*r)
    times["rows"].append(time.perf_counter() - start)
  same = all(np.array_equal(np.asarray(o.tokens)[0], np.asarray(outs[-1].tokens)[i])
             for i, o in enumerate(outs[:-1]))
  return {"decoder": cell.name, "batch": int(tokens.shape[0]),
          "batch_best_s": min(times["batch"]), "rows_best_s": min(times["rows"]),
          "ratio_best": min(times["batch"]) / min(times["rows"]),
          "ratio_median": statistics.median(times["batch"]) / statistics.median(times["rows"]),
          "batch_nfe": int(outs[-1].nfe), "rows_nfe": [int(o.nfe) for o in outs[:-1]],
          "rows_equal_batch": bool(same)}


def measure_dtypes(config, cfg: ModelConfig) -> list[dict]:
  """AR's decode-step forward (one token per row against a cache of P + G slots) in float32
  and in bfloat16 weights and compute, interleaved: which dtype is the fast path here."""
  records = []
  for b in config.batches:
    programs = {}
    for dtype in ("float32", "bfloat16"):
      c = cfg.replace(dtype=dtype, param_dtype=dtype)
      params = init_params(c, jax.random.key(config.seed))
      plan = protocol.plan("ar", c, {"gen_length": config.gen_length})
      tokens, valid = prompts(config, b, c.vocab_size)
      state = protocol.jit_init(params, jax.numpy.asarray(tokens), jax.numpy.asarray(valid),
                                jax.random.key(0), plan.traced, decoder=plan.decoder)
      calls: list[Call] = []
      with spy(calls, [params]), jax.disable_jit():
        plan.decoder.step(params, state)
      bare, inputs = bare_program(calls)
      programs[dtype] = (bare, ([params], inputs))
    times = {d: [] for d in programs}
    for _ in range(config.repeats):
      for d, (fn, args) in programs.items():
        times[d].append(_time(fn, args, config.inner))
    records.append({"batch": b, **{f"{d}_best_s": min(t) for d, t in times.items()},
                    "bf16_over_f32": min(times["bfloat16"]) / min(times["float32"])})
  return records


# ----------------------------------------------------------------------------- report

def table(records: list[dict], batch_records: list[dict], dtype_records=()) -> str:
  lines = ["| scale | decoder | B | step ms | bare forward ms | step / bare (best) | "
           "(median) | in a loop: step ms | bare ms | step / bare (best) | (median) | "
           "flops step / bare | bytes step / bare |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    lines.append(
        f"| {r['scale']} | {r['decoder']} | {r['batch']} | {1e3 * r['step_best_s']:.3f} | "
        f"{1e3 * r['bare_best_s']:.3f} | {r['ratio_best']:.2f}x | {r['ratio_median']:.2f}x | "
        f"{1e3 * r['step_loop_best_s']:.3f} | {1e3 * r['bare_loop_best_s']:.3f} | "
        f"{r['ratio_loop_best']:.2f}x | {r['ratio_loop_median']:.2f}x | "
        f"{r['step_flops'] / max(r['bare_flops'], 1):.2f} | "
        f"{r['step_bytes'] / max(r['bare_bytes'], 1):.2f} |")
  if batch_records:
    lines += ["", "| scale | decoder | rows | batch ms | rows alone ms (sum) | batch / rows "
              "(best) | (median) | batch NFE | rows' NFE |", "|---|---|---|---|---|---|---|---|---|"]
    for r in batch_records:
      lines.append(
          f"| {r['scale']} | {r['decoder']} | {r['batch']} | {1e3 * r['batch_best_s']:.2f} | "
          f"{1e3 * r['rows_best_s']:.2f} | {r['ratio_best']:.2f}x | {r['ratio_median']:.2f}x | "
          f"{r['batch_nfe']} | {r['rows_nfe']} |")
  if dtype_records:
    lines += ["", "| scale | B | AR forward f32 ms | bf16 ms | bf16 / f32 |", "|---|---|---|---|---|"]
    for r in dtype_records:
      lines.append(f"| {r['scale']} | {r['batch']} | {1e3 * r['float32_best_s']:.3f} | "
                   f"{1e3 * r['bfloat16_best_s']:.3f} | {r['bf16_over_f32']:.2f}x |")
  return "\n".join(lines)


def run(config, workdir: str) -> dict:
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  longest = config.gen_length + config.max_prompt_len
  records, batch_records, dtype_records = [], [], []
  for scale in config.scales:
    cfg = bench_model(config, scale, longest)
    params = init_params(cfg, jax.random.key(config.seed))
    drafter = init_params(cfg, jax.random.key(config.seed + 1))
    for cell in cells(config):
      model_cfg = cfg.replace(shift_logits=True) if cell.shifted else cfg
      for b in config.batches:
        batch = prompts(config, b, cfg.vocab_size)
        rec = measure_cell(config, model_cfg, params, drafter, cell, batch)
        rec["scale"] = scale
        records.append(rec)
        print(f"{scale:>9} {cell.name:>17} B={b}: step {1e3 * rec['step_best_s']:.3f} ms, "
              f"bare {1e3 * rec['bare_best_s']:.3f} ms, {rec['ratio_best']:.2f}x; in a loop "
              f"{1e3 * rec['step_loop_best_s']:.3f} / {1e3 * rec['bare_loop_best_s']:.3f} ms, "
              f"{rec['ratio_loop_best']:.2f}x", flush=True)
      if config.batch_cost_rows:
        batch = prompts(config, config.batch_cost_rows, cfg.vocab_size)
        rec = measure_batch_cost(config, model_cfg, peaked(params, config.head_scale),
                                 drafter, cell, batch)
        rec["scale"] = scale
        batch_records.append(rec)
    if scale in config.dtype_scales:
      dtype_records += [dict(r, scale=scale) for r in measure_dtypes(config, cfg)]
  report = table(records, batch_records, dtype_records)
  print(report)
  result = {"schema_version": SCHEMA_VERSION, "config": config.to_dict(),
            "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
            "records": records, "batch_cost": batch_records, "dtypes": dtype_records}
  (workdir / "bench_step.json").write_text(json.dumps(result, indent=1, default=str))
  (workdir / "bench_step.md").write_text(report + "\n")
  return result
