"""HTTP serving benchmark: the OpenAI-compatible server against the in-process engine.

For each (method, concurrency c) cell, the same requests (the serving benchmark's mixed
workload: `serve_bench.workload`, each with its answer budget and seed) are served by two
engines of c slots, each warmed up (every shape compiled, then one pass of a few requests):
  engine  in process: every request submitted at t = 0, served until idle
          (`serve_bench.run_engine`);
  http    `python -m dllm_jax.serve`'s app (`serve.create_app`) in a child process, driven
          by the official async openai client: every request sent at t = 0 (the server's
          queue takes them all), streamed, so TTFT is the first text chunk's arrival.
          Prompts are sent as text, as clients send them (the server encodes them with the
          tokenizer's BOS: `sampler.encode_text`; the engine gets those ids).
Both decode with the same options and seeds, so their texts are the same (checked on every
pass: `outputs_equal`). Throughput is response tokens / (last answer - first send); TTFT and
latency are per request from t = 0 (p50 / p95 / p99).

The two paths run `repeats` times, interleaved (engine, http, then http, engine, ...), so a
load that comes and goes on a shared host falls on both. The client is one long-lived
`AsyncOpenAI` whose connections (opened by two warm-up passes) are kept alive, as a serving
client's are. Each repeat gives one paired ratio, the server's throughput over the
engine's (1.0: HTTP costs nothing; the issue's bar is >= 0.9 at concurrency 16); a cell
reports their median and a 95% percentile-bootstrap interval of the median
(`median_interval`), and each path's metrics as medians over the repeats. Each pass also
records CPU seconds (this process: the engine or the client; the server process), so a ratio
below 1 can be split into the server's own HTTP work and the client's, which on a small host
runs on the same cores as the server.

The model samples only the character alphabet's ids (`active_vocab_size`), so every answer
detokenizes. The child process builds the same model from the config (deterministic: the
seed) and shares this process's persistent compilation cache, so its warm-up loads the
programs the in-process engine compiled.

Output: serve_http_bench.json (config, per-cell metrics and every repeat) and
serve_http_bench.md (the table).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import socket
import tempfile
import time

import numpy as np

from studylib import serve_bench

HEADER = ("| method | conc. | path | tok/s | TTFT p50 (s) | TTFT p95 (s) | latency p50 (s) | "
          "latency p95 (s) | latency p99 (s) | server/engine tok/s (95% CI) | same outputs |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|\n")
METRICS = ("throughput", "ttft_p50", "ttft_p95", "latency_p50", "latency_p95", "latency_p99",
           "wall", "cpu", "server_cpu")
CPU_HEADER = ("| method | conc. | engine pass: wall (s) | CPU (s) | http pass: wall (s) | "
              "server CPU (s) | client CPU (s) | server CPU - engine CPU per request (ms) | "
              "client CPU per request (ms) |\n|---|---|---|---|---|---|---|---|---|\n")


def _engine(config, method, slots, params, cfg, tokenizer):
  from dllm_jax.serving import Engine
  return Engine(params, cfg, methods=method,
                options=serve_bench.method_options(config, method, params, cfg), slots=slots,
                max_prompt_len=config.max_prompt_len, prompt_buckets=(config.max_prompt_len,),
                max_steps_per_run=config.max_steps_per_run, tokenizer=tokenizer)


def _tokenizer():
  from dllm_jax.data import tasks as tasks_lib
  from dllm_jax.data.tokenizers import CharTokenizer
  return CharTokenizer(tasks_lib.TASK_ALPHABET)


def _model(config, tokenizer):
  """(cfg, params) of the serving benchmark, sampling only ids the tokenizer has (the preset's
  vocabulary is padded past the character alphabet)."""
  cfg, params = serve_bench.build_model(config)
  return cfg.replace(active_vocab_size=int(tokenizer.vocab_size)), params


def _serve(config_json: str, method: str, slots: int, port: int) -> None:
  """The child process: the server for one cell on 127.0.0.1:port."""
  import uvicorn
  from ml_collections import config_dict
  from dllm_jax.serve import Backend, Limits, create_app
  config = config_dict.ConfigDict(json.loads(config_json))
  tokenizer = _tokenizer()
  cfg, params = _model(config, tokenizer)
  backend = Backend([_engine(config, method, slots, params, cfg, tokenizer)],
                    max_queue=config.num_requests)
  backend.warmup()
  limits = Limits(max_prompt_tokens=config.max_prompt_len, max_tokens=config.gen_length,
                  max_streams_per_client=config.num_requests, max_queue=config.num_requests,
                  request_timeout=config.timeout)
  uvicorn.run(create_app(backend, limits), host="127.0.0.1", port=port, log_level="warning")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


async def _drive(client, method: str, requests):
  """Sends every request (text prompt, max_tokens, seed, task) at once through `client` (an
  openai.AsyncOpenAI); returns (texts, summary)."""
  start = time.perf_counter()

  async def one(prompt, max_new, seed):
    stream = await client.completions.create(
        model=method, prompt=prompt, max_tokens=max_new, seed=seed, stream=True,
        stream_options={"include_usage": True})
    text, first, tokens = [], None, 0
    async for chunk in stream:
      if chunk.choices and chunk.choices[0].text:
        first = first or time.perf_counter() - start
        text.append(chunk.choices[0].text)
      if chunk.usage is not None:
        tokens = chunk.usage.completion_tokens
    return "".join(text), first, time.perf_counter() - start, tokens

  out = await asyncio.gather(*[one(p, m, s) for p, m, s, _ in requests])
  wall = time.perf_counter() - start
  return [o[0] for o in out], _summary(sum(o[3] for o in out), wall,
                                       [o[1] for o in out if o[1] is not None],
                                       [o[2] for o in out])


def _engine_pass(engine, method, requests, tokenizer):
  """The requests served in process; returns (texts, summary)."""
  from dllm_jax.sampler import decode_text
  results, _ = serve_bench.run_engine(engine, requests, method)  # all at t = 0
  return [decode_text(tokenizer, r.tokens) for r in results], _summary(
      sum(len(r.tokens) for r in results), max(r.latency for r in results),
      [r.ttft for r in results if r.ttft is not None], [r.latency for r in results])


def _summary(tokens: int, wall: float, ttft, latency) -> dict:
  pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else 0.0
  return dict(tokens=int(tokens), wall=wall, throughput=tokens / max(wall, 1e-9),
              ttft_p50=pct(ttft, 50), ttft_p95=pct(ttft, 95), latency_p50=pct(latency, 50),
              latency_p95=pct(latency, 95), latency_p99=pct(latency, 99))


def median_interval(values, *, level: float = 0.95, resamples: int = 10_000,
                    seed: int = 0) -> tuple[float, float, float]:
  """(median, low, high): the median of `values` and the percentile-bootstrap interval of
  the median (resampling the values with replacement)."""
  values = np.asarray(values, float)
  rng = np.random.default_rng(seed)
  medians = np.median(rng.choice(values, (resamples, len(values))), axis=1)
  tail = (1 - level) / 2 * 100
  low, high = np.percentile(medians, [tail, 100 - tail])
  return float(np.median(values)), float(low), float(high)


def _wait_healthy(url: str, proc, timeout: float) -> None:
  import httpx
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if not proc.is_alive():
      raise RuntimeError(f"the server process exited ({proc.exitcode}).")
    try:
      if httpx.get(url + "/health", timeout=2).status_code == 200:
        return
    except httpx.HTTPError:
      pass
    time.sleep(0.2)
  raise RuntimeError("the server did not become healthy in time.")


def _cpu_seconds(pid: int) -> float:
  """CPU time (user + system, every thread) process `pid` has used (Linux: /proc)."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _alternate(config, url, server_pid, method, requests, warm, engine_pass, texts,
                     passes):
  """The repeats of a cell, on one event loop with one client: like a long-running client,
  its connections (opened by the warm-up passes) are kept alive and reused. The engine runs
  in this thread, with no HTTP request in flight. Each pass also records the CPU seconds
  this process (`cpu`: the engine, or the client) and the server process used."""
  import openai
  async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0,
                                timeout=config.timeout) as client:
    await _drive(client, method, requests["http"][:warm])
    await _drive(client, method, requests["http"])  # opens every connection a pass uses
    for r in range(config.repeats):
      for path in (("engine", "http") if r % 2 == 0 else ("http", "engine")):
        cpu, server_cpu = time.process_time(), _cpu_seconds(server_pid)
        out = engine_pass() if path == "engine" else await _drive(client, method,
                                                                   requests["http"])
        out[1].update(cpu=time.process_time() - cpu,
                      server_cpu=_cpu_seconds(server_pid) - server_cpu)
        texts[path].append(out[0])
        passes[path].append(out[1])


def _cell(config, method, c, params, cfg, tokenizer, requests, context) -> dict:
  """One (method, concurrency) cell: both paths warmed up, then `repeats` interleaved pairs.
  `requests`: {"engine": [(ids, ...)], "http": [(text, ...)]}, the same requests."""
  engine = _engine(config, method, c, params, cfg, tokenizer)
  engine.warmup()
  warm = max(c, 4)
  _engine_pass(engine, method, requests["engine"][:warm], tokenizer)
  port = _free_port()
  proc = context.Process(target=_serve, args=(json.dumps(config.to_dict()), method, c, port),
                         daemon=True)
  proc.start()
  passes = {"engine": [], "http": []}  # per repeat: the summaries
  texts = {"engine": [], "http": []}
  try:
    _wait_healthy(f"http://127.0.0.1:{port}", proc, config.timeout)
    asyncio.run(_alternate(config, f"http://127.0.0.1:{port}/v1", proc.pid, method, requests,
                           warm,
                           lambda: _engine_pass(engine, method, requests["engine"], tokenizer),
                           texts, passes))
  finally:
    proc.terminate()
    proc.join(30)
  ratios = [h["throughput"] / max(e["throughput"], 1e-9)
            for e, h in zip(passes["engine"], passes["http"])]
  ratio, low, high = median_interval(ratios, seed=config.seed)
  want = texts["engine"][0]
  return dict(method=method, concurrency=c,
              outputs_equal=all(t == want for path in texts.values() for t in path),
              ratio=ratio, ratio_low=low, ratio_high=high, ratios=ratios,
              **{path: {k: float(np.median([p[k] for p in runs])) for k in METRICS}
                 for path, runs in passes.items()},
              repeats={path: runs for path, runs in passes.items()})


def run(config, workdir: str) -> dict:
  """Runs every (method, concurrency) cell; writes the JSON and the table to workdir."""
  if config.repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {config.repeats}.")
  os.makedirs(workdir, exist_ok=True)
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        tempfile.mkdtemp(prefix="serve_http_bench_xla_"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  import jax
  from dllm_jax.sampler import decode_text, encode_text
  tokenizer = _tokenizer()
  cfg, params = _model(config, tokenizer)
  work = serve_bench.workload(config, cfg)
  texts = [decode_text(tokenizer, ids) for ids, *_ in work]
  requests = {"engine": [(encode_text(tokenizer, t), *rest)
                         for t, (_, *rest) in zip(texts, work)],
              "http": [(t, *rest) for t, (_, *rest) in zip(texts, work)]}
  context = multiprocessing.get_context("spawn")
  cells = []
  for method in config.methods:
    for c in config.concurrency:
      cells.append(_cell(config, method, c, params, cfg, tokenizer, requests, context))
      print(_row(cells[-1]), flush=True)
  report = dict(config=config.to_dict(), device=str(jax.devices()[0].platform), cells=cells)
  with open(os.path.join(workdir, "serve_http_bench.json"), "w") as f:
    json.dump(report, f, indent=1, default=serve_bench._json_default)
  table = markdown(report)
  with open(os.path.join(workdir, "serve_http_bench.md"), "w") as f:
    f.write(table)
  print(table)
  return report


def _row(cell) -> str:
  lines = []
  for path in ("engine", "http"):
    m = cell[path]
    ratio = (f"{cell['ratio']:.2f}x [{cell['ratio_low']:.2f}, {cell['ratio_high']:.2f}]"
             if path == "http" else "")
    lines.append(f"| {cell['method']} | {cell['concurrency']} | {path} | "
                 f"{m['throughput']:.0f} | {m['ttft_p50']:.3f} | {m['ttft_p95']:.3f} | "
                 f"{m['latency_p50']:.3f} | {m['latency_p95']:.3f} | {m['latency_p99']:.3f} | "
                 f"{ratio} | {'yes' if cell['outputs_equal'] else 'NO'} |")
  return "\n".join(lines)


def _cpu_row(cell, requests: int) -> str:
  e, h = cell["engine"], cell["http"]
  return (f"| {cell['method']} | {cell['concurrency']} | {e['wall']:.2f} | {e['cpu']:.2f} | "
          f"{h['wall']:.2f} | {h['server_cpu']:.2f} | {h['cpu']:.2f} | "
          f"{(h['server_cpu'] - e['cpu']) / requests * 1e3:.1f} | "
          f"{h['cpu'] / requests * 1e3:.1f} |")


def markdown(report) -> str:
  c = report["config"]
  head = (f"HTTP serving benchmark ({report['device']}): {c['num_requests']} requests of "
          f"`{c['tasks']}`, gen_length {c['gen_length']}, temperature {c['temperature']}, "
          f"model `{c['preset']}` (random weights); official async openai client, streamed, "
          f"all requests sent at once; engine = the same requests in process. {c['repeats']} "
          "interleaved repeats per cell: metrics are medians over them, the ratio is the "
          "median of the paired ratios with its 95% bootstrap interval.\n\n")
  cpu = ("\nWhere the CPU goes (medians over the repeats; the client runs on the same host, "
         "so its CPU competes with the server's):\n\n" + CPU_HEADER
         + "\n".join(_cpu_row(cell, c["num_requests"]) for cell in report["cells"]) + "\n")
  return head + HEADER + "\n".join(_row(cell) for cell in report["cells"]) + "\n" + cpu
