"""`python -m dllm_jax.serve`: an OpenAI-compatible server over the continuous-batching engine.

  python -m dllm_jax.serve --model demo --method d2f --port 8000
  python -m dllm_jax.serve --model demo --method d2f --method ar --opt d2f.block_length=4
  python -m dllm_jax.serve --model /ckpt/LLaDA-8B-Instruct --adapter /ckpt/D2F_LoRA \
      --method d2f --opt d2f.block_length=32 --opt gen_length=256 --api-key secret

`--model` is any checkpoint `Sampler.load` reads ("demo", a HF dir, a converted dir, a
training workdir). Each `--method` is one lane (its own slots); `--opt METHOD.key=value` sets
a lane option (`--opt key=value`: every lane). Methods that draft with a second model take
`--drafter-model` (the demo brings its own). Methods served by different networks (the demo's
AR and diffusion models) get one engine each; the engines share the engine thread.

The server binds 127.0.0.1 unless `--host` says otherwise; `--api-key` (or $DLLM_JAX_API_KEY)
makes every route but /health require `Authorization: Bearer <key>`. Caps: --max-body-bytes,
--max-prompt-tokens, --max-tokens, --max-n, --max-streams-per-client, --max-queue,
--request-timeout (see docs/serving.md). A mistake prints one `error: ...` line and exits
with status 2 (`--debug` shows the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys

from dllm_jax.decoding import registry
from dllm_jax.generate import (DEFAULT_GEN_LENGTH, UsageError, _mesh_shape, parse_value,
                               run_reporting_user_errors)

API_KEY_ENV = "DLLM_JAX_API_KEY"
DEFAULT_MAX_PROMPT = 512


def _parse_opt(text: str) -> tuple[str | None, str, object]:
  key, sep, value = text.partition("=")
  if not sep or not key.strip():
    raise argparse.ArgumentTypeError(f"--opt expects [method.]key=value, got {text!r}")
  method, dot, name = key.strip().rpartition(".")
  return (method if dot else None), name, parse_value(value)


def _sizes(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(s) for s in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m dllm_jax.serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True, help="'demo', a HF model directory, a converted "
                 "directory or a training workdir")
  p.add_argument("--method", action="append", default=None,
                 help=f"a lane's decoding method (repeat for several); one of "
                      f"{sorted(registry.names())}; default {registry.DEFAULT_METHOD}")
  p.add_argument("--opt", action="append", type=_parse_opt, default=[],
                 help="lane option [method.]key=value (e.g. d2f.block_length=16, gen_length=64)")
  p.add_argument("--drafter-model", help="the drafter checkpoint of speculative / adaptive")
  p.add_argument("--adapter", help="PEFT LoRA adapter directory of a HF checkpoint")
  p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                 help="HF checkpoints: convert to this dtype")
  p.add_argument("--mesh", default=None, help='mesh shape as JSON, e.g. \'{"data": 8}\'')
  p.add_argument("--served-model-name", default=None,
                 help="the model name clients may also send (default: the --model name)")
  p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--api-key", default=None,
                 help=f"require 'Authorization: Bearer KEY' (default ${API_KEY_ENV})")
  engine = p.add_argument_group("engine")
  engine.add_argument("--slots", type=int, default=8, help="rows decoded together per lane")
  engine.add_argument("--prompt-buckets", type=_sizes, default=None,
                      help="padded prompt lengths to compile (default 16, 32, ... the cap)")
  engine.add_argument("--admit-sizes", type=_sizes, default=None,
                      help="admission batch sizes to compile (default 1, 4, 16, ... slots)")
  engine.add_argument("--max-steps-per-run", type=int, default=16,
                      help="decoder steps between host returns (streaming granularity)")
  caps = p.add_argument_group("caps")
  caps.add_argument("--max-body-bytes", type=int, default=1 << 20)
  caps.add_argument("--max-prompt-tokens", type=int, default=None,
                    help=f"longest prompt (default: what fits the window, at most "
                         f"{DEFAULT_MAX_PROMPT})")
  caps.add_argument("--max-tokens", type=int, default=4096,
                    help="largest max_tokens (also at most a lane's gen_length)")
  caps.add_argument("--max-n", type=int, default=8, help="choices per request")
  caps.add_argument("--max-streams-per-client", type=int, default=64,
                    help="streamed choices in flight per client (API key, else address)")
  caps.add_argument("--max-queue", type=int, default=256,
                    help="choices waiting for a slot, per lane (429 beyond)")
  caps.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds a request may take, queueing included (408 beyond)")
  p.add_argument("--log-level", default="warning",
                 choices=("critical", "error", "warning", "info", "debug"))
  p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
  return p


def check_args(args) -> tuple[list[str], dict[str, dict], dict | None]:
  """(methods, {method: options}, mesh shape): the mistakes the flags alone show."""
  methods = args.method or [registry.DEFAULT_METHOD]
  for m in methods:
    if m not in registry.names():
      raise UsageError(f"--method {m!r} is unknown; use one of {sorted(registry.names())}.")
  if len(set(methods)) != len(methods):
    raise UsageError(f"--method lists a method twice ({methods}); each method is one lane.")
  options = {m: {} for m in methods}
  for method, key, value in args.opt:
    if method is not None and method not in options:
      raise UsageError(f"--opt {method}.{key}: {method!r} is not a served --method "
                       f"({methods}).")
    for m in ([method] if method else methods):
      options[m][key] = value
  drafting = [m for m in methods if m in registry.drafter_methods()]
  if drafting and args.drafter_model is None and args.model != "demo":
    raise UsageError(f"--method {drafting[0]} drafts with a second model: pass "
                     "--drafter-model DIR (--model demo brings its own).")
  for name in ("slots", "max_body_bytes", "max_tokens", "max_n", "max_streams_per_client",
               "max_steps_per_run"):
    if getattr(args, name) <= 0:
      raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
  if args.max_queue < 0 or args.request_timeout <= 0:
    raise UsageError("--max-queue must be >= 0 and --request-timeout > 0.")
  return methods, options, _mesh_shape(args.mesh)


def _model_key(path: str, method: str):
  """Methods with the same key share one network (one engine)."""
  if path == "demo":
    from dllm_jax import demo
    return ("demo", demo.model_for(method))
  return ("path", path)


def load_engines(args, methods, options, mesh) -> list:
  """One `Engine` per network the methods decode with, each with its lanes' options."""
  from dllm_jax import loading
  from dllm_jax.sampler import load_drafter, takes_drafter
  from dllm_jax.serving import Engine, serves_sampling
  groups: dict = {}
  for method in methods:
    key = _model_key(args.model, method)
    if key not in groups:
      model = loading.load_model(args.model, method, dtype=args.dtype, adapter=args.adapter,
                                 mesh=mesh)
      groups[key] = (model, {})
    model, lanes = groups[key]
    opts = {**model.options(method), **options[method]}
    opts.setdefault("gen_length", DEFAULT_GEN_LENGTH)
    if serves_sampling(method):  # greedy and sampled requests share the lane's one program
      opts.setdefault("sampling", True)
    if takes_drafter(method) and "drafter_params" not in opts:
      source = args.drafter_model or "demo"
      opts.update(load_drafter(source, method, opts, dtype=args.dtype, mesh=mesh))
    lanes[method] = opts
  engines = []
  for model, lanes in groups.values():
    max_prompt = args.max_prompt_tokens or _fitting_prompt(model.cfg, lanes.values())
    engines.append(Engine(model.params, model.cfg, methods=lanes, slots=args.slots,
                          max_prompt_len=max_prompt, prompt_buckets=args.prompt_buckets,
                          admit_sizes=args.admit_sizes,
                          max_steps_per_run=args.max_steps_per_run,
                          tokenizer=model.tokenizer, mesh=mesh))
  return engines


def _fitting_prompt(cfg, lanes) -> int:
  """The longest prompt (at most DEFAULT_MAX_PROMPT) that fits the window with every lane's
  response (gen_length rounded up to its block)."""
  room = cfg.max_seq_len
  for opts in lanes:
    g, block = int(opts["gen_length"]), int(opts.get("block_length") or 1)
    room = min(room, cfg.max_seq_len - -(-g // block) * block)
  if room <= 0:
    raise UsageError(f"gen_length leaves no room for a prompt in the model's window "
                     f"({cfg.max_seq_len} tokens); lower --opt gen_length.")
  return min(room, DEFAULT_MAX_PROMPT)


def build(args):
  """(app, backend, limits): the server the flags describe, warmed up."""
  methods, options, shape = check_args(args)
  mesh = None
  if shape is not None:
    from dllm_jax.parallel import mesh as mesh_lib
    mesh = mesh_lib.make_mesh(shape)
  from dllm_jax.serve import app as app_lib
  from dllm_jax.serve import backend as backend_lib
  from dllm_jax.serve import protocol
  engines = load_engines(args, methods, options, mesh)
  backend = backend_lib.Backend(engines, max_queue=args.max_queue)
  limits = protocol.Limits(
      max_body_bytes=args.max_body_bytes,
      max_prompt_tokens=min(e.prompt_buckets[-1] for e in engines),
      max_tokens=args.max_tokens, max_n=args.max_n,
      max_streams_per_client=args.max_streams_per_client, max_queue=args.max_queue,
      request_timeout=args.request_timeout)
  backend.warmup()
  key = args.api_key or os.environ.get(API_KEY_ENV) or None
  name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
  return app_lib.create_app(backend, limits, api_key=key, served_name=name), backend, limits


def run(args) -> int:
  app, backend, _ = build(args)
  import uvicorn
  if args.host not in ("127.0.0.1", "localhost", "::1") and not (
      args.api_key or os.environ.get(API_KEY_ENV)):
    print(f"warning: serving on {args.host} with no --api-key: anyone who reaches this port "
          "can use it.", file=sys.stderr)
  print(f"serving {sorted(backend.lanes)} on http://{args.host}:{args.port}/v1", file=sys.stderr,
        flush=True)
  uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
  return 0


def main(argv=None) -> int:
  return run_reporting_user_errors(run, build_parser().parse_args(argv))
