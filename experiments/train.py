"""Train (or resume) one experiment: a thin shell around `dllm_jax.training.trainer.train`.

  python experiments/train.py --config configs/mdm_tiny.py --workdir /tmp/mdm_tiny \
      [--config.train.steps=2000] [--config.opt.lr=1e-3]

Rerunning the same command resumes from the workdir's latest checkpoint. Any key of the
config can be overridden with --config.<path>=<value>; an unknown key is an error. Metrics
print above the progress bar and go to <workdir>/metrics.jsonl; pass --verbosity=0 for the
full absl (orbax, JAX) INFO log.
"""

import json

from absl import app, flags

import _config_args  # experiments/_config_args.py: --config found from any directory

_CONFIG = _config_args.define(None, "Experiment config file (configs/*.py).",
                               lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, config and metrics.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # pylint: disable=import-outside-toplevel  (JAX loads after the flags: _config_args)
  from dllm_jax.training import trainer
  final = trainer.train(_CONFIG.value, _WORKDIR.value)
  print(json.dumps(final, indent=1, sort_keys=True))


if __name__ == "__main__":
  _config_args.run(main)
