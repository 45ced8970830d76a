"""The speed-versus-quality study: train (or load) AR, MDM and D2F models, decode the same
held-out prompts with every decoder, and write a table, a JSON file and a Pareto plot.

  python experiments/study.py                 # default: mixed suite, long worked answers
  python experiments/study.py --short         # short answers only (configs/study.py:short)
  python experiments/study.py --long          # answers of >= 128 tokens (configs/study.py:long)
  python experiments/study.py --full          # the larger accelerator mode
  python experiments/study.py --tradeoff      # trade-off curves from the default mode's models
  python experiments/study.py --long --config.eval.num_prompts=64
  python experiments/study.py --seeds 3       # every claim at training seeds 0, 1, 2 and pooled
  python experiments/study.py --config.mdm_from_ar=False --workdir=runs/scratch  # MDM from scratch

  python experiments/study.py --checkpoints --config.checkpoints.ar=... \
      --config.checkpoints.diffusion=... --config.eval_set.source=gsm8k_test.jsonl
                                              # published checkpoints on GSM8K (no training)
  python experiments/study.py --checkpoints --dry-run ...  # per-device bytes, no weights read

`--short`, `--long`, `--full`, `--tradeoff` and `--checkpoints` stand for
`--config configs/study.py:short`, `:long`, `:full`, `:tradeoff` and `:checkpoints`
(configs/study.py describes the checkpoint mode's fields; docs/checkpoint_study.md). The
workdir defaults to runs/study (the default mode) or runs/study_<mode> (the trade-off mode
shares runs/study: it loads the default mode's
models); rerunning reuses the trained models cached there (as orbax checkpoints) and the TFDS
data files under <workdir>/data. The printed and stored verdict (experiments/studylib/verdict.py)
names every claim. Compiled programs are cached under <workdir>/xla_cache
(experiments/studylib/compile_cache.py), so a rerun loads them instead of compiling again.
"""

import sys

from absl import app, flags

from studylib import modes

import _config_args  # experiments/_config_args.py: --config found from any directory

# Before the flags are defined: the config flag reads sys.argv when it is defined (to register
# the `--config.*` overrides), so it must already see the mode flags expanded.
try:
  sys.argv = modes.expand_mode_flags(sys.argv)
except ValueError as e:
  sys.exit(f"experiments/study.py: {e}")
_CONFIG = _config_args.define("configs/study.py", "Study config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where models and reports go (default: "
                               "runs/study, or runs/study_<mode> for the other modes).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Checkpoint mode: print the per-device bytes "
                             "of every cell from config.json alone (no weights read) and "
                             "refuse a plan that does not fit; `--dry-run` is the same flag.")
_SEEDS = flags.DEFINE_integer("seeds", 1, "Training seeds: N > 1 trains and evaluates every "
                              "model at seeds 0..N-1 and reports each claim per seed and "
                              "pooled (studylib/seeds.py).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _SEEDS.value < 1:
    raise app.UsageError(f"--seeds must be >= 1 (training seeds 0..N-1), got {_SEEDS.value}.")
  # pylint: disable=import-outside-toplevel  (JAX loads after the flags: _config_args)
  from studylib import compile_cache, seeds, study
  from dllm_jax.training.checkpoint import CheckpointError
  workdir = _WORKDIR.value or modes.default_workdir(_CONFIG.value)
  if _DRY_RUN.value:
    sys.exit(_dry_run(_CONFIG.value))
  compile_cache.enable(workdir)  # before the first compile: JAX fixes the directory then
  try:
    if _SEEDS.value != 1:
      seeds.run(_CONFIG.value, workdir, _SEEDS.value, study.run)
    else:
      study.run(_CONFIG.value, workdir)
  except (CheckpointError, study.StudyConfigError) as e:  # what is wrong, and the fix
    sys.exit(f"experiments/study.py: {e}")


def _dry_run(config) -> int | str:
  """The checkpoint mode's dry run (checkpoint_study.dry_run): 0, or the one-line refusal."""
  # pylint: disable=import-outside-toplevel
  if config.get("mode", "") != "checkpoints":
    return "experiments/study.py: --dry-run plans the checkpoint mode (--checkpoints); the " \
           "synthetic modes train tiny models that fit anywhere."
  from studylib import checkpoint_study
  try:
    checkpoint_study.dry_run(config)
  except ValueError as e:  # DoesNotFit, a bad config: one line naming the change
    return f"experiments/study.py: {e}"
  return 0


if __name__ == "__main__":
  _config_args.run(main)
