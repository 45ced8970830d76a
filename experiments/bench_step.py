"""The decode step's own cost: a thin shell around `studylib.step_bench.run`.

  python experiments/bench_step.py   # = --config configs/bench_step.py --workdir runs/bench_step

Writes bench_step.json and bench_step.md (also printed) to --workdir. Any config key can be
overridden, e.g. --config.scales='("tiny",)'.
"""

from absl import app, flags

import _config_args  # experiments/_config_args.py: --config found from any directory

_CONFIG = _config_args.define("configs/bench_step.py", "configs/bench_step.py",
                               lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_step", "Output directory.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # pylint: disable=import-outside-toplevel  (JAX loads after the flags: _config_args)
  from studylib import step_bench
  step_bench.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  _config_args.run(main)
