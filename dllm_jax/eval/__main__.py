"""`python -m dllm_jax.eval`: lm-eval's own command line with the `dllm_jax` model.

  python -m dllm_jax.eval --model_args checkpoint=demo,method=d2f --tasks demo_sums
  python -m dllm_jax.eval --model_args checkpoint=/ckpt/LLaDA-8B-Instruct,adapter=/ckpt/D2F,\
      method=d2f,block_length=32,batch_size=8 --tasks gsm8k --num_fewshot 4 --output_path out/

Every lm-eval flag works (`--tasks`, `--include_path`, `--num_fewshot`, `--limit`,
`--apply_chat_template`, `--output_path`, `--log_samples`, ...); `--model dllm_jax` is filled
in, and dllm_jax's own offline tasks (`dllm_jax.eval.tasks`: `demo_sums`) are found by name. The model args (dllm_jax.eval.args) are checked before anything loads: a mistake there,
or a missing checkpoint, prints one `error: ...` line and exits with status 2 (`--debug`
shows the traceback instead).

`--dry-run` (with `--prompt_len N`, default 1024, and `--device_memory 16GiB`, default the
device's own) reads the checkpoint's config files only and prints the per-device bytes of
decoding `batch_size` prompts on the model args' mesh (`dllm_jax.dry_run`); a plan that does
not fit is refused in one line naming the change, and nothing is evaluated.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from dllm_jax.generate import UsageError

SUBCOMMANDS = ("run", "ls", "validate")


DRY_RUN_FLAGS = ("--dry-run", "--dry_run")


def split_dry_run(argv: list[str]) -> tuple[list[str], dict | None]:
  """(argv without the dry-run flags, {prompt_len, device_memory} or None without
  --dry-run). Raises UsageError for a malformed value."""
  dry = None
  rest, i = [], 0
  while i < len(argv):
    arg = argv[i]
    name, eq, value = arg.partition("=")
    if arg in DRY_RUN_FLAGS:
      dry = {} if dry is None else dry
    elif name in ("--prompt_len", "--device_memory"):
      if not eq:
        if i + 1 >= len(argv):
          raise UsageError(f"{name} needs a value.")
        value, i = argv[i + 1], i + 1
      dry = {} if dry is None else dry
      dry[name[2:]] = value
    else:
      rest.append(arg)
    i += 1
  if dry is not None and "prompt_len" in dry:
    try:
      dry["prompt_len"] = int(dry["prompt_len"])
    except ValueError:
      raise UsageError(f"--prompt_len must be an integer, got {dry['prompt_len']!r}.") from None
  if dry is not None and set(dry) and not any(a in DRY_RUN_FLAGS for a in argv):
    raise UsageError("--prompt_len and --device_memory are the dry run's; add --dry-run.")
  return rest, dry


def dry_run(args, prompt_len: int = 1024, device_memory=None) -> int:
  """Prints the plan of decoding with the parsed model args; DoesNotFit if it does not fit."""
  from dllm_jax import dry_run as dry_run_lib
  load = args.load
  options = dict(args.options)
  options.setdefault("gen_length", args.max_gen_toks)
  budget = dry_run_lib.device_memory() if device_memory is None else device_memory
  report = dry_run_lib.plan_checkpoint(
      args.checkpoint, dtype=load.get("dtype"), adapter=load.get("adapter"),
      merge_lora=bool(load.get("merge_lora", False)), drafter=load.get("drafter_model"),
      method=args.method, mesh=args.mesh, batch=args.batch_size, prompt_len=prompt_len,
      device_memory=budget, **options)
  print(report.table())
  report.check()
  return 0


def include_path_has_every_task(argv: list[str]) -> bool:
  """Whether every name `--tasks` asks for (lm-eval's argv) is a task (not a group or tag) in
  its `--include_path`: then lm-eval's own task files are not needed to run them (a task's
  YAML names no other task; an `include:` of another YAML is read by its path)."""
  peek = argparse.ArgumentParser(add_help=False)
  peek.add_argument("--tasks", "-t", default="")
  peek.add_argument("--include_path", default=None)
  known, _ = peek.parse_known_args(argv)
  asked = {t.strip() for t in str(known.tasks).split(",") if t.strip()}
  if not asked or known.include_path is None:
    return False
  from lm_eval.tasks import TaskManager
  local = TaskManager(include_path=known.include_path, include_defaults=False)
  return asked <= set(local.all_subtasks)


@contextlib.contextmanager
def without_lm_eval_task_index():
  """lm-eval's TaskManager without its built-in tasks while the block runs: indexing its
  ~14,000 task files costs ~10 s of CPU at every start, and a run whose tasks are all in
  --include_path (dllm_jax's own, or the caller's) needs none of them."""
  import lm_eval.tasks

  full = lm_eval.tasks.TaskManager

  class IncludePathOnly(full):
    def __init__(self, *args, include_defaults: bool = False, **kwargs):
      super().__init__(*args, include_defaults=include_defaults, **kwargs)

  lm_eval.tasks.TaskManager = IncludePathOnly
  try:
    yield
  finally:
    lm_eval.tasks.TaskManager = full


def _with_builtin_tasks(rest: list[str]) -> list[str]:
  """`rest` with `--include_path` of dllm_jax's own tasks (`eval.tasks`) when one is asked
  for; UsageError if an --include_path of the caller's is given too (lm-eval takes one)."""
  from dllm_jax.eval import tasks as builtin
  peek = argparse.ArgumentParser(add_help=False)
  peek.add_argument("--tasks", "-t", default="")
  peek.add_argument("--include_path", default=None)
  known, _ = peek.parse_known_args(rest)
  asked = {t.strip() for t in str(known.tasks).split(",")} & set(builtin.TASKS)
  if not asked:
    return rest
  if known.include_path is not None:
    raise UsageError(f"{sorted(asked)} are dllm_jax's own tasks (in {builtin.cache_dir()}); "
                     "lm-eval takes one --include_path: run them without yours, or copy "
                     f"their YAML and JSONL from there into {known.include_path}.")
  return [*rest, "--include_path", str(builtin.task_dir())]


def parse_cli(argv: list[str]) -> tuple[list[str], object, bool]:
  """(lm-eval's argv with `--model dllm_jax` filled in, the parsed model args or None,
  --debug). The one place this command reads its flags."""
  from dllm_jax.eval.args import parse_model_args, split_model_args
  debug = "--debug" in argv
  argv = [a for a in argv if a != "--debug"]
  if argv and argv[0] in SUBCOMMANDS[1:]:      # `ls tasks`, `validate ...`: lm-eval's own
    return argv, None, debug
  rest = argv[1:] if argv and argv[0] == "run" else argv
  if not rest or rest[0] in ("-h", "--help"):
    return ["run", *rest], None, debug
  peek = argparse.ArgumentParser(add_help=False)
  peek.add_argument("--model", "-M")
  peek.add_argument("--model_args", "-a", nargs="+", action="append", default=[])
  known, _ = peek.parse_known_args(rest)
  if known.model not in (None, "dllm_jax"):
    raise ValueError(f"python -m dllm_jax.eval runs the dllm_jax model, not --model "
                     f"{known.model}; use lm-eval itself for other models.")
  model_args = {}
  for pieces in known.model_args:
    for piece in pieces:
      model_args.update(split_model_args(piece))
  if known.model is None:
    rest = ["--model", "dllm_jax", *rest]
  rest = _with_builtin_tasks(rest)
  args = parse_model_args(model_args)
  for name, path in (("checkpoint", args.checkpoint), *args.load.items()):
    if name in ("checkpoint", "adapter", "drafter_model") and path not in (None, "demo") \
        and not Path(path).exists():
      raise UsageError(f"{name}={path} does not exist; pass a local checkpoint directory, a "
                       "training workdir or 'demo' (nothing is downloaded).")
  return ["run", *rest], args, debug


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  debug = "--debug" in argv
  try:
    argv, dry = split_dry_run(argv)
    lm_eval_argv, args, debug = parse_cli(argv)
    if dry is not None:
      if args is None:
        raise UsageError("--dry-run needs --model_args checkpoint=... (a checkpoint directory).")
      if args.checkpoint == "demo":
        raise UsageError("--dry-run reads a checkpoint's config.json; the demo needs none "
                         "(it is tiny): drop --dry-run or pass a checkpoint directory.")
      return dry_run(args, **dry)
    import dllm_jax.eval  # noqa: F401  (registers the model)
    from lm_eval.__main__ import cli_evaluate
    saved = sys.argv
    sys.argv = ["lm-eval", *lm_eval_argv]
    local = include_path_has_every_task(lm_eval_argv)
    try:
      with without_lm_eval_task_index() if local else contextlib.nullcontext():
        cli_evaluate()
    finally:
      sys.argv = saved
  except Exception as e:  # noqa: BLE001 (re-raised unless it is the user's mistake)
    from dllm_jax.generate import _is_user_error
    if debug or not _is_user_error(e):
      raise
    message = e.args[0] if isinstance(e, KeyError) and e.args else e
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
