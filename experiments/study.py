"""The speed-versus-quality study: train (or load) AR, MDM and D2F models, decode the same
held-out prompts with every decoder, and write a table, a JSON file and a Pareto plot.

  python experiments/study.py                 # default mode, ~11 min on 2 CPU cores
  python experiments/study.py --long          # long answers (configs/study.py:long)
  python experiments/study.py --full          # the larger accelerator mode
  python experiments/study.py --config configs/study.py:long --config.eval.num_prompts=64

`--long` and `--full` stand for `--config configs/study.py:long` and `:full`. The workdir
defaults to runs/study, runs/study_long or runs/study_full by mode; rerunning reuses the
trained models cached there (as orbax checkpoints).
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from dllm_jax.study import study

_CONFIG = config_flags.DEFINE_config_file("config", "configs/study.py", "Study config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where models and reports go (default: "
                               "runs/study, or runs/study_<mode> for the other modes).")
SHORTHANDS = {"--long": "configs/study.py:long", "--full": "configs/study.py:full"}


def expand_shorthands(argv: list[str]) -> list[str]:
  """Rewrites `--long` / `--full` into the `--config` they stand for (one of them at most,
  and not together with an explicit --config)."""
  picked = [a for a in argv[1:] if a in SHORTHANDS]
  if not picked:
    return argv
  explicit = [a for a in argv[1:] if a == "--config" or a.startswith("--config=")]
  if len(picked) > 1 or explicit:
    raise app.UsageError(f"pass one study mode: {' '.join(picked + explicit)} conflict "
                         "(--long and --full each stand for a --config).")
  return [argv[0]] + [f"--config={SHORTHANDS[a]}" if a in SHORTHANDS else a
                      for a in argv[1:]]


def default_workdir(config) -> str:
  mode = config.get("mode", "")
  return f"runs/study_{mode}" if mode else "runs/study"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  study.run(_CONFIG.value, _WORKDIR.value or default_workdir(_CONFIG.value))


if __name__ == "__main__":
  try:
    sys.argv = expand_shorthands(sys.argv)
  except app.UsageError as e:
    sys.exit(f"experiments/study.py: {e}")
  app.run(main)
