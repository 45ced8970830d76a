"""Generate text from any checkpoint with any decoder: `python -m dllm_jax.generate`.

  # the built-in demo (trained on first use, minutes on a CPU, then cached; no download)
  python -m dllm_jax.generate --model demo --method d2f --prompt "37+48="
  python -m dllm_jax.generate --model demo --method speculative --prompt "37+48="  # every method

  # a HF checkpoint (+ PEFT adapter), a converted one, or a training workdir
  python -m dllm_jax.generate --model /ckpt/LLaDA-8B-Instruct --adapter /ckpt/D2F_LLaDA_LoRA \
      --method d2f --prompt "What is 12 * 34?" --gen_length 256 --opt block_length=32
  python -m dllm_jax.generate --model /tmp/dllm_jax_runs/mdm_tiny --method llada --prompt "12+34="

  # speculative decoding: an AR target verifies a drafter's tokens (same tokenizer)
  python -m dllm_jax.generate --model /ckpt/target --method speculative \
      --drafter_model /ckpt/drafter --opt drafter=ar --opt draft_length=4 --prompt "12+34="

  # random weights of a preset (a smoke test of a decoder; the text is noise)
  python -m dllm_jax.generate --preset tiny --method llada --prompt hello --gen_length 16

  # dry run: bytes per device of a plan, from config.json alone (no weights read), and a
  # one-line refusal naming the change when it does not fit the device memory
  python -m dllm_jax.generate --model /ckpt/LLaDA-8B-Instruct --adapter /ckpt/D2F_LLaDA_LoRA \
      --method d2f --opt block_length=32 --dry_run --mesh '{"fsdp": 8}' --data_parallel spmd \
      --batch 8 --prompt_len 512 --gen_length 256 --device_memory 16GiB

The model directory kind is detected (see dllm_jax.loading); its tokenizer, chat template and
special ids come with it. Everything runs through `dllm_jax.sampler.Sampler`. Decoder options
are repeated `--opt key=value` flags (numbers, nan/inf, true/false, none, strings), checked by
the decoder; `--batch_invariant` is `--opt batch_invariant=true` (rank on a grid, so an answer
is the same alone and in a batch). Prints each answer on stdout and tokens/s, NFE and wall
time on stderr (`--json`: one JSON object). Mistakes (a missing directory, an unknown option,
a prompt too long for the model window, a damaged checkpoint, a checkpoint holding tensors the
model does not use: `--allow_unused_weights` loads it with a warning...) print one `error: ...`
line and exit with status 2; `--debug` shows the traceback instead. A dry run that does not
fit prints its table, then the refusal as that line.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time

from dllm_jax.decoding import registry
from dllm_jax.parallel.axes import MESH_AXES

# JAX, flax and the decoders load after the flags are parsed and checked (in `run`), so
# `--help` and a mistyped flag, method or mesh print in well under a second.

DEFAULT_GEN_LENGTH = 256       # HF / converted checkpoints (a run or the demo bring their own)
DEFAULT_PRESET_GEN_LENGTH = 32


class UsageError(ValueError):
  """A command-line mistake (reported as one line, exit status 2)."""


def parse_value(text: str):
  """An --opt value: int, float (incl. nan / inf), bool, None, a Python literal, or the string."""
  lowered = text.strip().lower()
  for convert in (int, float):
    try:
      return convert(text)
    except ValueError:
      pass
  if lowered in ("true", "false"):
    return lowered == "true"
  if lowered in ("none", "null"):
    return None
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _parse_opt(text: str) -> tuple[str, object]:
  key, sep, value = text.partition("=")
  if not sep or not key:
    raise argparse.ArgumentTypeError(f"--opt expects key=value, got {text!r}")
  return key.strip(), parse_value(value)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m dllm_jax.generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--model", help="'demo', a HF model directory, a converted directory "
                      "(save_converted) or a training workdir")
  source.add_argument("--workdir", help="a training workdir (like --model, but it must be one)")
  source.add_argument("--preset", help="random weights of a model preset (smoke tests)")
  p.add_argument("--tokenizer", default="auto",
                 help="with --preset: 'byte', 'char' (the synthetic tasks' alphabet), a "
                 "tokenizer.json path, or 'auto' (byte if the preset's vocab holds it, else char)")
  p.add_argument("--adapter", help="PEFT LoRA adapter directory (adapter_config.json)")
  p.add_argument("--merge_lora", action="store_true", help="merge the adapter into the weights")
  p.add_argument("--step", type=int, help="checkpoint step of a training workdir (default: "
                 "the latest)")
  p.add_argument("--method", default=registry.DEFAULT_METHOD,
                 help=f"one of {sorted(registry.names())}")
  p.add_argument("--drafter_model",
                 help="the drafter checkpoint (any --model kind) of a method that drafts with "
                      "a second model (speculative, adaptive; --model demo brings its own); "
                      "speculative's drafter kind is --opt drafter=ar|d2f|block_diffusion|"
                      "selfspec")
  p.add_argument("--prompt", action="append", default=[],
                 help="prompt text; repeat for a batch (required unless --dry_run)")
  p.add_argument("--no_chat_template", action="store_true",
                 help="feed the raw prompt instead of the model's chat template")
  p.add_argument("--gen_length", "--max_new_tokens", dest="gen_length", type=int,
                 help="response slots (default: a run's answer canvas, else 256)")
  p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
  p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                 help="HF checkpoints: convert to this dtype (default: the checkpoint's own; "
                      "on CPU a bfloat16 one computes in float32, which is faster there)")
  p.add_argument("--mesh", default=None,
                 help='mesh shape as JSON, e.g. \'{"tensor": 8}\'; default: one device')
  p.add_argument("--data_parallel", choices=("shard_map", "spmd"), default=None,
                 help="with a mesh that splits the batch: shard_map (one loop per data "
                      "shard; params replicated over the data axes; the default without an "
                      "fsdp axis) or spmd (params stay fsdp-sharded; the default with one)")
  p.add_argument("--allow_unused_weights", action="store_true",
                 help="load a HF checkpoint whose files hold tensors the model does not use "
                      "(a warning names them) instead of refusing it")
  p.add_argument("--dry_run", "--dry-run", dest="dry_run", action="store_true",
                 help="print the bytes per device the decode needs (from config.json alone; "
                      "no weights are read) and refuse a plan that does not fit")
  p.add_argument("--batch", type=int, help="--dry_run: prompts per call (default: the "
                 "number of --prompt, else 1)")
  p.add_argument("--prompt_len", type=int, help="--dry_run: prompt tokens (default: the "
                 "longest --prompt, encoded by the checkpoint's tokenizer)")
  p.add_argument("--device_memory", help="--dry_run: memory per device, e.g. 16GiB "
                 "(default: what the first device reports; none on a CPU)")
  p.add_argument("--opt", action="append", type=_parse_opt, default=[],
                 help="decoder option key=value (e.g. block_length=32, tau_conf=0.9)")
  p.add_argument("--batch_invariant", action="store_true",
                 help="rank confidences on a 2^-12 grid, so an answer does not depend on the "
                      "batch it is decoded in (default: exact order, as the reference "
                      f"decoders rank); methods {', '.join(registry.ranking_methods())}")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--stream", action="store_true", help="print the answer as it is decoded")
  p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
  p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
  return p


def _mesh_shape(text: str | None) -> dict[str, int] | None:
  """The --mesh JSON as {axis: size}, checked without JAX (`make_mesh` checks the sizes)."""
  if text is None:
    return None
  try:
    shape = json.loads(text)
  except json.JSONDecodeError as e:
    raise UsageError(f"--mesh {text!r} is not JSON ({e.msg}); write it like "
                     "'{\"tensor\": 8}' (double quotes, in single quotes for the shell).") from None
  if not isinstance(shape, dict) or not all(isinstance(v, int) for v in shape.values()):
    raise UsageError(f"--mesh must be a JSON object of axis sizes, e.g. '{{\"tensor\": 8}}'; "
                     f"got {text!r}.")
  unknown = sorted(set(shape) - set(MESH_AXES))
  if unknown:
    raise UsageError(f"--mesh names unknown axes {unknown}; the axes are {list(MESH_AXES)}.")
  return shape


def check_args(args) -> dict[str, int] | None:
  """The mistakes the flags alone show, found before JAX loads (each a UsageError); returns
  the --mesh shape."""
  drafter_methods = registry.drafter_methods()
  if args.method not in registry.names():
    raise UsageError(f"--method {args.method!r} is unknown; use one of "
                     f"{sorted(registry.names())}.")
  if args.method in drafter_methods and args.drafter_model is None and args.model != "demo":
    raise UsageError(f"--method {args.method} drafts with a second model: pass "
                     "--drafter_model DIR (a checkpoint sharing the target's tokenizer; "
                     "--model demo brings its own).")
  if args.batch_invariant and args.method not in registry.ranking_methods():
    raise UsageError(f"--batch_invariant applies to the methods that rank confidences "
                     f"({', '.join(registry.ranking_methods())}); --method {args.method} never "
                     "ranks.")
  if args.drafter_model is not None and args.method not in drafter_methods:
    raise UsageError(f"--drafter_model applies to --method {' or '.join(drafter_methods)}, "
                     f"not {args.method}.")
  if not args.prompt and not args.dry_run:
    raise UsageError("pass --prompt TEXT (repeat it for a batch), or --dry_run to plan.")
  if args.dry_run and (args.model == "demo" or args.workdir):
    raise UsageError("--dry_run reads a HF or converted checkpoint's config (--model DIR) or "
                     "a --preset; the demo and training workdirs are small: just run them.")
  if not args.dry_run:
    unused = [f for f in ("batch", "prompt_len", "device_memory") if getattr(args, f) is not None]
    if unused:
      raise UsageError(f"--{unused[0]} applies to --dry_run; pass --prompt for each prompt.")
  return _mesh_shape(args.mesh)


def _preset_sampler(args, mesh, options):
  import jax
  from dllm_jax.data import tasks, tokenizers
  from dllm_jax.models import get_preset, init_params
  from dllm_jax.sampler import Sampler, load_drafter
  cfg = get_preset(args.preset)
  name = args.tokenizer
  if name == "auto":
    name = "byte" if cfg.vocab_size >= tokenizers.ByteTokenizer().vocab_size else "char"
  if name == "byte":
    tok = tokenizers.ByteTokenizer()
  elif name == "char":
    tok = tokenizers.CharTokenizer(tasks.TASK_ALPHABET)
  else:
    tok = tokenizers.HFTokenizer.from_file(name)
  if tok.vocab_size > cfg.vocab_size:
    raise UsageError(f"the tokenizer has {tok.vocab_size} ids but preset {cfg.name!r} only "
                     f"{cfg.vocab_size}; pick a larger preset (e.g. small).")
  params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(args.seed))
  if tok.vocab_size < cfg.vocab_size:  # never propose an id the tokenizer cannot decode
    cfg = cfg.replace(active_vocab_size=tok.vocab_size)
  options.setdefault("gen_length", DEFAULT_PRESET_GEN_LENGTH)
  if args.drafter_model is not None:
    options.update(load_drafter(args.drafter_model, args.method, options, mesh=mesh))
  return Sampler(params, cfg, tok, args.method, mesh=mesh, **options)


def make_sampler(args):
  """The `Sampler` the flags describe."""
  shape = check_args(args)
  from dllm_jax.sampler import Sampler
  if shape is None:
    mesh = None
  else:
    from dllm_jax.parallel import mesh as mesh_lib
    mesh = mesh_lib.make_mesh(shape)
  options = _decoder_options(args)
  if args.data_parallel is not None:
    options["data_parallel"] = args.data_parallel
  if args.preset:
    return _preset_sampler(args, mesh, options)
  path, kind = (args.workdir, "workdir") if args.workdir else (args.model, "auto")
  sampler = Sampler.load(path, args.method, kind=kind, dtype=args.dtype, adapter=args.adapter,
                         merge_lora=args.merge_lora, step=args.step, mesh=mesh,
                         drafter_model=args.drafter_model,
                         strict=not args.allow_unused_weights, **options)
  if "gen_length" not in sampler.options:
    sampler = sampler.replace(gen_length=DEFAULT_GEN_LENGTH)
  return sampler


def _decoder_options(args) -> dict:
  options = dict(args.opt)
  if args.batch_invariant:
    options["batch_invariant"] = True
  if args.gen_length is not None:
    options["gen_length"] = args.gen_length
  return options


def dry_run(args) -> int:
  """--dry_run: the plan's bytes per device (table, or --json), then DoesNotFit (one
  `error:` line) when it exceeds the device memory."""
  shape = check_args(args)
  from dllm_jax import dry_run as dry_run_lib
  options = _decoder_options(args)
  if args.preset:
    from dllm_jax.models import get_preset
    cfg = get_preset(args.preset)
    if args.dtype:
      cfg = cfg.replace(param_dtype=args.dtype, dtype=args.dtype)
    default_gen = DEFAULT_PRESET_GEN_LENGTH
  else:
    cfg = dry_run_lib.checkpoint_config(args.model, dtype=args.dtype, adapter=args.adapter,
                                        merge_lora=args.merge_lora)
    default_gen = DEFAULT_GEN_LENGTH
  options.setdefault("gen_length", default_gen)
  if args.drafter_model is not None:
    options["drafter_cfg"] = dry_run_lib.checkpoint_config(args.drafter_model,
                                                           dtype=args.dtype)
  budget = args.device_memory if args.device_memory is not None else \
      dry_run_lib.device_memory()
  report = dry_run_lib.plan(
      cfg, method=args.method, mesh=shape, batch=args.batch or max(len(args.prompt), 1),
      prompt_len=_dry_run_prompt_len(args), data_parallel=args.data_parallel,
      device_memory=budget, **options)
  print(json.dumps(report.to_dict()) if args.json else report.table())
  report.check()
  return 0


def _dry_run_prompt_len(args) -> int:
  if args.prompt_len is not None:
    return args.prompt_len
  if not args.prompt or args.preset:
    raise UsageError("--dry_run needs the prompt length: pass --prompt_len N (or --prompt "
                     "TEXT with a --model that has tokenizer.json).")
  from dllm_jax import checkpoints
  from dllm_jax.sampler import encode_chat, encode_text
  tokenizer = checkpoints.load_tokenizer(args.model)
  chat = not args.no_chat_template and getattr(tokenizer, "chat_template", None)
  return max(len(encode_chat(tokenizer, [{"role": "user", "content": p}]) if chat
                 else encode_text(tokenizer, p)) for p in args.prompt)


def _prompts(args, sampler) -> list:
  """Chat messages when the tokenizer has a template (unless --no_chat_template), else text."""
  if args.no_chat_template or not getattr(sampler.tokenizer, "chat_template", None):
    return list(args.prompt)
  return [[{"role": "user", "content": p}] for p in args.prompt]


def run(args) -> int:
  if args.dry_run:
    return dry_run(args)
  sampler = make_sampler(args)  # checks the flags first, then loads JAX and the model
  import jax
  import numpy as np
  prompts = _prompts(args, sampler)
  key = jax.random.key(args.seed)
  if args.stream:
    return _run_stream(args, sampler, prompts, key)

  start = time.perf_counter()
  sampler.sample(prompts, stop=args.stop, rng=key)
  first = time.perf_counter() - start  # includes compilation
  start = time.perf_counter()
  result = sampler.sample(prompts, stop=args.stop, rng=key, return_output=True)
  wall = time.perf_counter() - start

  tokens = int(np.sum(result.lengths))
  stats = {"method": sampler.method, "response_tokens": tokens, "nfe": result.nfe,
           "wall_s": wall, "first_call_s": first, "tokens_per_s": tokens / wall,
           "tokens_per_forward": tokens / max(result.nfe * len(prompts), 1)}
  if args.json:
    print(json.dumps({"answers": result.text, **stats}))
    return 0
  for i, answer in enumerate(result.text):
    print(answer if len(prompts) == 1 else f"[{i}] {answer}")
  print(f"{sampler.method}: {tokens} response tokens in {wall:.3f}s = "
        f"{stats['tokens_per_s']:.1f} tok/s, NFE {stats['nfe']}, "
        f"{stats['tokens_per_forward']:.2f} tokens/forward "
        f"(first call with compile {first:.1f}s)", file=sys.stderr)
  return 0


def _run_stream(args, sampler, prompts, key) -> int:
  if len(prompts) != 1:
    raise UsageError("--stream prints one answer as it is decoded; pass a single --prompt.")
  start = time.perf_counter()
  pieces = []
  for delta in sampler.sample(prompts[0], stop=args.stop, rng=key, stream=True):
    pieces.append(delta)
    if not args.json:
      print(delta, end="", flush=True)
  wall = time.perf_counter() - start
  if args.json:
    print(json.dumps({"answers": ["".join(pieces)], "method": sampler.method,
                      "wall_s": wall, "deltas": pieces}))
  else:
    print()
    print(f"{sampler.method}: streamed in {wall:.2f}s (incl. compile)", file=sys.stderr)
  return 0


def _is_user_error(error: BaseException) -> bool:
  """Whether `error` means "the input is wrong" (its message names the fix).

  ArithmeticError: a decoder that finds non-finite logits (a damaged model) says so. A
  CheckpointError can only come from the checkpoint module, so it is not imported to ask.
  """
  if isinstance(error, (ValueError, OSError, KeyError, ArithmeticError)):
    return True
  checkpoint = sys.modules.get("dllm_jax.training.checkpoint")
  return checkpoint is not None and isinstance(error, checkpoint.CheckpointError)


def run_reporting_user_errors(run_fn, args) -> int:
  """`run_fn(args)`; a user's mistake (`_is_user_error`) prints one `error:` line and returns
  2, anything else raises (`args.debug`: the user's mistake raises too, with its traceback).
  The CLIs' shared exit path (this one's and `dllm_jax.serve`'s)."""
  if args.debug:
    return run_fn(args)
  try:
    return run_fn(args)
  except Exception as e:  # noqa: BLE001 (re-raised unless it is the user's mistake)
    if not _is_user_error(e):
      raise
    message = e.args[0] if isinstance(e, KeyError) and e.args else e
    print("error: " + " ".join(str(message).split()), file=sys.stderr)  # one line
    return 2


def main(argv=None) -> int:
  return run_reporting_user_errors(run, build_parser().parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
