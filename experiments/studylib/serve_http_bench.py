"""HTTP serving benchmark: the OpenAI-compatible server against the in-process engine.

For each (method, concurrency c) cell, the same requests (the serving benchmark's mixed
workload: `serve_bench.workload`, token-id prompts, per-request answer budget and seed) are
served twice by an engine of c slots, after warm-up:
  engine  in process: every request submitted at t = 0, served until idle
          (`serve_bench.run_engine`);
  http    `python -m dllm_jax.serve`'s app (`serve.create_app`) in a child process, driven
          by the official async openai client: every request sent at t = 0 (the server's
          queue takes them all), streamed, so TTFT is the first text chunk's arrival.
Both decode with the same options and seeds, so their texts are the same (checked:
`outputs_equal`). Throughput is response tokens / (last answer - first send); TTFT and
latency are per request from t = 0 (p50 / p95 / p99). `ratio` is the server's throughput over
the engine's (1.0: HTTP costs nothing; the issue's bar is >= 0.9 at concurrency 16).

The model samples only the character alphabet's ids (`active_vocab_size`), so every answer
detokenizes. The child process builds the same model from the config (deterministic: the seed) and
shares this process's persistent compilation cache, so its warm-up loads the programs the
in-process engine compiled.

Output: serve_http_bench.json (config, per-cell metrics) and serve_http_bench.md (the table).
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
          "latency p95 (s) | latency p99 (s) | server/engine tok/s | same outputs |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|\n")


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


async def _drive(url: str, method: str, requests, timeout: float):
  """Sends every request at once; returns (texts, ttfts, latencies, tokens, wall)."""
  import openai
  async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0,
                                timeout=timeout) as client:
    start = time.perf_counter()

    async def one(prompt, max_new, seed):
      stream = await client.completions.create(
          model=method, prompt=list(prompt), max_tokens=max_new, seed=seed, stream=True,
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
  return ([o[0] for o in out], [o[1] for o in out if o[1] is not None], [o[2] for o in out],
          sum(o[3] for o in out), wall)


def _summary(tokens: int, wall: float, ttft, latency) -> dict:
  pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else 0.0
  return dict(tokens=int(tokens), wall=wall, throughput=tokens / max(wall, 1e-9),
              ttft_p50=pct(ttft, 50), ttft_p95=pct(ttft, 95), latency_p50=pct(latency, 50),
              latency_p95=pct(latency, 95), latency_p99=pct(latency, 99))


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


def run(config, workdir: str) -> dict:
  """Runs every (method, concurrency) cell; writes the JSON and the table to workdir."""
  os.makedirs(workdir, exist_ok=True)
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        tempfile.mkdtemp(prefix="serve_http_bench_xla_"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  import jax
  from dllm_jax.sampler import decode_text
  tokenizer = _tokenizer()
  cfg, params = _model(config, tokenizer)
  requests = serve_bench.workload(config, cfg)
  context = multiprocessing.get_context("spawn")
  cells = []
  for method in config.methods:
    for c in config.concurrency:
      engine = _engine(config, method, c, params, cfg, tokenizer)
      engine.warmup()
      results, _ = serve_bench.run_engine(engine, requests, method)  # all at t = 0
      engine_m = _summary(sum(len(r.tokens) for r in results),
                          max(r.latency for r in results),
                          [r.ttft for r in results if r.ttft is not None],
                          [r.latency for r in results])
      port = _free_port()
      proc = context.Process(target=_serve, args=(json.dumps(config.to_dict()), method, c,
                                                  port), daemon=True)
      proc.start()
      try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc, config.timeout)
        url = f"http://127.0.0.1:{port}/v1"
        asyncio.run(_drive(url, method, requests[:max(c, 4)], config.timeout))  # warm HTTP
        texts, ttft, latency, tokens, wall = asyncio.run(
            _drive(url, method, requests, config.timeout))
      finally:
        proc.terminate()
        proc.join(30)
      http_m = _summary(tokens, wall, ttft, latency)
      equal = texts == [decode_text(tokenizer, r.tokens) for r in results]
      cells.append(dict(method=method, concurrency=c, engine=engine_m, http=http_m,
                        outputs_equal=equal,
                        ratio=http_m["throughput"] / max(engine_m["throughput"], 1e-9)))
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
    ratio = f"{cell['ratio']:.2f}x" if path == "http" else ""
    lines.append(f"| {cell['method']} | {cell['concurrency']} | {path} | "
                 f"{m['throughput']:.0f} | {m['ttft_p50']:.3f} | {m['ttft_p95']:.3f} | "
                 f"{m['latency_p50']:.3f} | {m['latency_p95']:.3f} | {m['latency_p99']:.3f} | "
                 f"{ratio} | {'yes' if cell['outputs_equal'] else 'NO'} |")
  return "\n".join(lines)


def markdown(report) -> str:
  c = report["config"]
  head = (f"HTTP serving benchmark ({report['device']}): {c['num_requests']} requests of "
          f"`{c['tasks']}`, gen_length {c['gen_length']}, temperature {c['temperature']}, "
          f"model `{c['preset']}` (random weights); official async openai client, streamed, "
          "all requests sent at once; engine = the same requests in process.\n\n")
  return head + HEADER + "\n".join(_row(cell) for cell in report["cells"]) + "\n"
