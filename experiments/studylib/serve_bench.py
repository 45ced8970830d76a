"""Serving benchmark: continuous batching (`dllm_jax.serving.Engine`) against static batching.

Static batching is `generate` over fixed batches of `concurrency` requests in arrival
order: a batch starts when the previous one has finished, and its requests are answered
when its longest row is done (no streaming, so a static request's TTFT is its latency). The
engine keeps `concurrency` slots busy: a slot is refilled as soon as its row finishes.

Both see the same closed workload: every request arrives at t = 0, in the same order, and
both decode with the same options and per-request seeds, so their outputs are identical
(checked: `outputs_equal`); only the schedule differs. Each (method, concurrency) cell warms
up both paths first (every shape compiled), then times static and engine back to back.
Prompts are padded to one length (max_prompt_len) on both sides, so nothing recompiles.

The hybrids (`speculative`, `selfspec`, `adaptive`) read the same random weights as their
drafter (a D2F drafter for speculative and adaptive; selfspec's mask block): they rarely
accept a draft, so their cells measure the scheduling of round-based decoders, not drafting.
Adaptive's requests carry their task name as the task tag (`adaptive_task_modes` maps tags
to modes): static batches pass `tasks=[...]`, the engine one `task` per request.

Output: serve_bench.json (config, per-cell metrics), serve_bench.md (the table), and
serve_bench.png (throughput and p95 latency against concurrency).
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from dllm_jax.data import tasks as tasks_lib
from dllm_jax.data.tokenizers import CharTokenizer
from dllm_jax.decoding import adaptive, ar, base, d2f, fast_dllm, selfspec, speculative
from dllm_jax.models import get_preset, init_params
from dllm_jax.serving import Engine, Result, metrics, request_keys

GENERATE = {"ar": ar.ar_generate, "d2f": d2f.d2f_generate,
            "block_diffusion": d2f.block_diffusion_generate,
            "fast_dllm": fast_dllm.fast_dllm_generate,
            "speculative": speculative.speculative_generate,
            "selfspec": selfspec.selfspec_generate, "adaptive": adaptive.adaptive_generate}


def build_model(config):
  """(cfg, params): the preset with random weights scaled by `peak` (lm_head x2), the EOS
  column of the head scaled by `eos_scale`."""
  cfg = get_preset(config.preset)

  @jax.jit
  def make(rng):
    def scale(path, x):
      name = jax.tree_util.keystr(path)
      if "lm_head" in name:
        x = x * 2.0 * config.peak
        return x.at[:, cfg.eos_token_id].multiply(config.eos_scale)
      return x * config.peak if ("kernel" in name or "embedding" in name) else x
    return jax.tree_util.tree_map_with_path(scale, init_params(cfg, rng))

  return cfg, make(jax.random.key(config.seed))


def workload(config, cfg):
  """[(prompt ids, max_new_tokens, seed, task name)] of the synthetic suite, in arrival
  order."""
  tok = CharTokenizer(tasks_lib.TASK_ALPHABET)
  if tok.vocab_size > cfg.vocab_size:
    raise ValueError(f"the task alphabet needs vocab {tok.vocab_size} > {cfg.vocab_size}.")
  suite = tasks_lib.TaskSuite.parse(config.tasks)
  out = []
  for i, ex in enumerate(tasks_lib.examples(suite, config.num_requests, config.seed)):
    prompt = tok.encode(ex.prompt)[-config.max_prompt_len:]
    out.append((prompt, min(len(ex.answer) + 1, config.gen_length), config.seed * 100003 + i,
                ex.task))
  return out


HYBRIDS = ("speculative", "selfspec", "adaptive")


def method_options(config, method: str, params=None, cfg=None) -> dict:
  """The options of `method`'s lane (and of its static batches); the hybrids that draft
  with a second model get the same `params` / `cfg` as their drafter."""
  opts = dict(gen_length=config.gen_length, temperature=config.temperature)
  if method in HYBRIDS:
    opts["draft_length"] = config.draft_length
  elif method != "ar":
    opts["block_length"] = config.block_length
  if method == "d2f":
    opts.update(dict(config.d2f_taus))
    opts["max_active_blocks"] = config.d2f_max_active_blocks
  if method in ("speculative", "adaptive"):
    opts.update(drafter_params=params, drafter_cfg=cfg)
  if method == "speculative":
    opts["drafter"] = "d2f"
  if method == "adaptive":
    opts["task_modes"] = dict(config.adaptive_task_modes)
  return opts


def _cut(row, length: int, max_new: int) -> tuple[int, ...]:
  return tuple(int(t) for t in np.asarray(row)[:min(length, max_new)])


def run_static(params, cfg, method, opts, requests, concurrency, prompt_len):
  """Decodes fixed batches in arrival order. Returns (results, wall seconds, start time)."""
  fn = GENERATE[method]
  results, t0 = [], time.perf_counter()
  for start in range(0, len(requests), concurrency):
    batch = requests[start:start + concurrency]
    rows = batch + [batch[-1]] * (concurrency - len(batch))  # one shape: pad with a repeat
    tokens, valid = base.pad_prompts([r[0] for r in rows], base.output_pad_id(cfg),
                                     prompt_len)
    tags = dict(tasks=[r[3] for r in rows]) if method == "adaptive" else {}
    out = fn(params, cfg, tokens, valid, request_keys([r[2] for r in rows]), **opts, **tags)
    lengths, toks = jax.device_get((out.lengths, out.tokens))
    now = time.perf_counter()
    for i, (_, max_new, _, _) in enumerate(batch):
      tokens_i = _cut(toks[i], int(lengths[i]), max_new)
      results.append(Result(start + i, tokens=tokens_i, nfe=int(out.nfe), ttft=now - t0,
                            latency=now - t0, queued=0.0))
  return results, time.perf_counter() - t0, t0


def run_engine(engine: Engine, requests, method: str):
  engine.reset_metrics()
  tag = (lambda t: dict(task=t)) if method == "adaptive" else (lambda t: {})
  ids = [engine.submit(p, max_new_tokens=m, seed=s, options=tag(t))
         for p, m, s, t in requests]
  engine.run_until_idle()
  results = [engine.pop_result(i) for i in ids]
  return results, engine.metrics(results)


def run(config, workdir: str) -> dict:
  """Runs every (method, concurrency) cell; writes the JSON, table and plot to workdir."""
  os.makedirs(workdir, exist_ok=True)
  cfg, params = build_model(config)
  requests = workload(config, cfg)
  lengths = [r[1] for r in requests]
  cells = []
  for method in config.methods:
    opts = method_options(config, method, params, cfg)
    for c in config.concurrency:
      engine = Engine(params, cfg, methods=method, options=opts, slots=c,
                      max_prompt_len=config.max_prompt_len,
                      prompt_buckets=(config.max_prompt_len,),
                      max_steps_per_run=config.max_steps_per_run)
      engine.warmup()
      run_static(params, cfg, method, opts, requests[:c], c, config.max_prompt_len)  # compile
      static, wall, t0 = run_static(params, cfg, method, opts, requests, c,
                                    config.max_prompt_len)
      static_m = metrics.summarize(static, first_arrival=t0, last_finish=t0 + wall)
      served, engine_m = run_engine(engine, requests, method)
      equal = [r.tokens for r in static] == [r.tokens for r in served]
      answers = [len(r.tokens) for r in served]
      cells.append(dict(method=method, concurrency=c, static=static_m.as_dict(),
                        answer_tokens=dict(mean=float(np.mean(answers)), min=min(answers),
                                           p50=float(np.median(answers)), max=max(answers)),
                        engine=engine_m.as_dict(), outputs_equal=equal,
                        speedup=engine_m.throughput / static_m.throughput,
                        p95_ratio=engine_m.latency_p95 / static_m.latency_p95))
      print(_row(cells[-1]), flush=True)
  report = dict(config=config.to_dict(), device=str(jax.devices()[0].platform),
                max_new_tokens=dict(mean=float(np.mean(lengths)), min=int(min(lengths)),
                                    max=int(max(lengths))),
                cells=cells)
  with open(os.path.join(workdir, "serve_bench.json"), "w") as f:
    json.dump(report, f, indent=1, default=_json_default)
  table = markdown(report)
  with open(os.path.join(workdir, "serve_bench.md"), "w") as f:
    f.write(table)
  plot(report, os.path.join(workdir, "serve_bench.png"))
  print(table)
  return report


def _json_default(x):
  if isinstance(x, (np.integer, np.floating, np.bool_)):
    return x.item()
  if isinstance(x, tuple):
    return list(x)
  raise TypeError(type(x))


HEADER = ("| method | conc. | mode | tok/s | speedup | TTFT p50 (s) | latency p50 (s) | "
          "latency p95 (s) | NFE/req | occupancy | same outputs |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|\n")


def _row(cell) -> str:
  lines = []
  for mode in ("static", "engine"):
    m = cell[mode]
    occ = "" if m["occupancy"] is None else f"{m['occupancy']:.2f}"
    speed = f"{cell['speedup']:.2f}x" if mode == "engine" else ""
    lines.append(f"| {cell['method']} | {cell['concurrency']} | {mode} | "
                 f"{m['throughput']:.0f} | {speed} | {m['ttft_p50']:.3f} | "
                 f"{m['latency_p50']:.3f} | {m['latency_p95']:.3f} | {m['nfe_mean']:.1f} | "
                 f"{occ} | {'yes' if cell['outputs_equal'] else 'NO'} |")
  return "\n".join(lines)


def markdown(report) -> str:
  c = report["config"]
  head = (f"Serving benchmark ({report['device']}): {c['num_requests']} requests of "
          f"`{c['tasks']}`, gen_length {c['gen_length']}, max_new_tokens mean "
          f"{report['max_new_tokens']['mean']:.1f} (min {report['max_new_tokens']['min']}, "
          f"max {report['max_new_tokens']['max']}), temperature {c['temperature']}, model "
          f"`{c['preset']}` (random weights).\n\n")
  return head + HEADER + "\n".join(_row(cell) for cell in report["cells"]) + "\n"


def plot(report, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  for method in dict.fromkeys(cell["method"] for cell in report["cells"]):
    cells = [cell for cell in report["cells"] if cell["method"] == method]
    conc = [cell["concurrency"] for cell in cells]
    for mode, style in (("static", "--o"), ("engine", "-s")):
      ax1.plot(conc, [cell[mode]["throughput"] for cell in cells], style,
               label=f"{method} {mode}")
      ax2.plot(conc, [cell[mode]["latency_p95"] for cell in cells], style,
               label=f"{method} {mode}")
  for ax, label in ((ax1, "throughput (response tokens/s)"), (ax2, "latency p95 (s)")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (slots / batch size)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  ax2.set_yscale("log")
  ax1.legend(fontsize=8)
  fig.suptitle("Continuous batching (engine) vs static batching (generate)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
