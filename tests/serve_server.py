"""Helpers of the HTTP server tests: a server subprocess on a free loopback port, an in-process
server thread, and the one-prompt references a completion must equal.

The model is the tiny LLaDA-Instruct stand-in (`tiny_llada`: random weights, a byte-level BPE
tokenizer with a chat template), written into the test's temporary directory. Every server
here decodes with ar and d2f lanes (`LANES`; test_serve_http's also with a lane of every
other method, `EXTRA_LANES`) of 16 slots, one prompt bucket (32) and one admit size (16), so
each lane compiles two programs and the subprocesses of a run share them through the
persistent compilation cache (conftest). The methods that draft with a second model draft
with the same tiny LLaDA (`--drafter-model`, loaded as D2F).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

from conftest import REPO

KEY = "test-key"
G = 16
SLOTS = 16
LANES = {"ar": dict(gen_length=G, temperature=1.0),
         "d2f": dict(gen_length=G, block_length=4, temperature=1.0)}
# Every other registered method, one lane each.
EXTRA_LANES = {"llada": dict(gen_length=G, block_length=4, temperature=1.0),
               "dream": dict(gen_length=G, block_length=4, temperature=1.0),
               "fast_dllm": dict(gen_length=G, block_length=4, temperature=1.0),
               "block_diffusion": dict(gen_length=G, block_length=4, temperature=1.0),
               "speculative": dict(gen_length=G, draft_length=3, temperature=1.0),
               "selfspec": dict(gen_length=G, draft_length=3, temperature=1.0),
               "adaptive": dict(gen_length=G, draft_length=3, temperature=1.0)}
ALL_LANES = {**LANES, **EXTRA_LANES}
PROMPT_BUCKET = 32
ENGINE_ARGS = ["--slots", str(SLOTS), "--prompt-buckets", str(PROMPT_BUCKET), "--admit-sizes", str(SLOTS),
               "--max-prompt-tokens", "32", "--max-steps-per-run", "4"]


def lane_args(lanes=LANES) -> list[str]:
  args = []
  for method, options in lanes.items():
    args += ["--method", method] + [f"--opt={method}.{k}={v}" for k, v in options.items()]
  return args


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ServerProcess:
  """`python -m dllm_jax.serve` in a subprocess on 127.0.0.1; `url` is its /v1 base.
  `wait=False` returns at once (call `wait()` before the first request), so the caller can
  work while the server warms up."""

  def __init__(self, model_dir, *extra: str, lanes=LANES, timeout: float = 240.0,
               wait: bool = True):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}/v1"
    self.root = f"http://127.0.0.1:{self.port}"
    from dllm_jax.decoding import registry
    drafter = (["--drafter-model", str(model_dir)]
               if set(lanes) & set(registry.drafter_methods()) else [])
    cmd = [sys.executable, "-m", "dllm_jax.serve", "--model", str(model_dir),
           *lane_args(lanes), *drafter, *ENGINE_ARGS, "--port", str(self.port), *extra]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    self.timeout = timeout
    if wait:
      self.wait()

  def wait(self) -> None:
    """Returns once /health answers 200 (AssertionError with the server's output if it
    exits or takes longer than `timeout`)."""
    deadline = time.monotonic() + self.timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise AssertionError(f"the server exited ({self.proc.returncode}):\n"
                             f"{self.proc.stdout.read()[-4000:]}")
      with contextlib.suppress(httpx.HTTPError):
        if httpx.get(f"{self.root}/health", timeout=2).status_code == 200:
          return
      time.sleep(0.3)
    self.close()
    raise AssertionError("the server did not become healthy in time")

  def metrics(self) -> dict:
    text = httpx.get(f"{self.root}/metrics", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).text
    return parse_metrics(text)

  def rss_kb(self) -> int:
    with open(f"/proc/{self.proc.pid}/status") as f:
      return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))

  def close(self) -> None:
    stop(self.proc, timeout=20)


def stop(proc: subprocess.Popen, timeout: float) -> None:
  """Terminates `proc` if it still runs; kills it if it has not exited within `timeout` s."""
  if proc.poll() is None:
    proc.terminate()
    try:
      proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def parse_metrics(text: str) -> dict:
  """{'name{labels}': value} of a Prometheus text page (samples only)."""
  out = {}
  for line in text.splitlines():
    if line and not line.startswith("#"):
      name, value = line.rsplit(" ", 1)
      out[name] = float(value)
  return out


class ThreadServer:
  """The app served by uvicorn in a thread of this process (its own event loop), on
  127.0.0.1. The backend is started (or not) by the test: `start_backend()`."""

  def __init__(self, app, backend):
    import uvicorn
    self.backend = backend
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}/v1"
    self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                log_level="warning", lifespan="off"))
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=self.loop.run_until_complete,
                                   args=(self.server.serve(),), daemon=True)
    self.thread.start()
    deadline = time.monotonic() + 30
    while not self.server.started:
      assert time.monotonic() < deadline, "uvicorn did not start"
      time.sleep(0.05)

  def start_backend(self) -> None:
    self.backend.start(self.loop)

  def close(self) -> None:
    self.server.should_exit = True
    self.thread.join(timeout=20)
    if self.backend._thread is not None:
      self.backend.stop()


class References:
  """Each prompt decoded alone with `decoding.generate` (the lane's method and options, the
  request's own options and seed, batch_invariant=True for a ranking method), cut at
  max_tokens, detokenized and cut at stop strings exactly as `Sampler` does."""

  def __init__(self, model_dir):
    from dllm_jax import loading
    self.model_dir = model_dir
    self.model = loading.load_model(model_dir, "ar")
    self._drafters: dict = {}

  def lane_options(self, method: str) -> dict:
    """The lane's options as the server builds them: the drafter the CLI loads from
    --drafter-model (the same tiny LLaDA) for the methods that draft."""
    from dllm_jax.sampler import load_drafter, takes_drafter
    opts = dict(ALL_LANES[method])
    if takes_drafter(method):
      if method not in self._drafters:
        self._drafters[method] = load_drafter(self.model_dir, method, opts)
      opts.update(self._drafters[method])
    return opts

  def compile_all(self) -> None:
    """Compiles the reference programs of every lane's method, greedy and sampled (a
    temperature > 0 is traced: one program serves them all): run while a server warms up,
    the two compile side by side."""
    ids = self.ids("warm up")
    for method in ALL_LANES:
      for t in (0.0, 1.0):
        self.tokens(method, ids, 0, temperature=t)

  def ids(self, prompt: str) -> list[int]:
    from dllm_jax.sampler import encode_text
    return encode_text(self.model.tokenizer, prompt)

  def chat_ids(self, messages) -> list[int]:
    from dllm_jax.sampler import encode_chat
    return list(encode_chat(self.model.tokenizer, messages))

  def tokens(self, method: str, ids, seed: int, max_tokens: int = G, **options):
    from dllm_jax.decoding import base, generate, registry
    from dllm_jax.serving import request_keys
    opts = {**self.lane_options(method), **options}
    if method in registry.ranking_methods():
      opts["batch_invariant"] = True
    # Left padded to the server's prompt bucket: every reference of a method and sampling
    # mode is one program (padding changes no output).
    prompt = base.pad_prompts([list(ids)], base.output_pad_id(self.model.cfg), PROMPT_BUCKET)
    out = generate(self.model.params, self.model.cfg, prompt, method=method,
                   rng=request_keys([seed]), **opts)
    return np.asarray(out.tokens[0])[:int(out.lengths[0])].tolist()[:max_tokens]

  def text(self, method: str, ids, seed: int, max_tokens: int = G, stop=(), **options) -> str:
    from dllm_jax.sampler import cut_at_stop, decode_text
    tokens = self.tokens(method, ids, seed, max_tokens, **options)
    return cut_at_stop(decode_text(self.model.tokenizer, tokens), tuple(stop))[0]
