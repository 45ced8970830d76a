"""`python -m dllm_jax.eval`: lm-eval's own command line with the `dllm_jax` model.

  python -m dllm_jax.eval --model_args checkpoint=demo,method=d2f --tasks gsm8k
  python -m dllm_jax.eval --model_args checkpoint=/ckpt/LLaDA-8B-Instruct,adapter=/ckpt/D2F,\
      method=d2f,block_length=32,batch_size=8 --tasks gsm8k --num_fewshot 4 --output_path out/

Every lm-eval flag works (`--tasks`, `--include_path`, `--num_fewshot`, `--limit`,
`--apply_chat_template`, `--output_path`, `--log_samples`, ...); `--model dllm_jax` is filled
in. The model args (dllm_jax.eval.args) are checked before anything loads: a mistake there,
or a missing checkpoint, prints one `error: ...` line and exits with status 2 (`--debug`
shows the traceback instead).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dllm_jax.generate import UsageError

SUBCOMMANDS = ("run", "ls", "validate")


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
    lm_eval_argv, _, debug = parse_cli(argv)
    import dllm_jax.eval  # noqa: F401  (registers the model)
    from lm_eval.__main__ import cli_evaluate
    saved = sys.argv
    sys.argv = ["lm-eval", *lm_eval_argv]
    try:
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
