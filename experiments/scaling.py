"""Scaling mode of the speed study: a thin shell around `studylib.scaling.run`.

  python experiments/scaling.py      # = --config configs/scaling.py --workdir runs/scaling
  python experiments/scaling.py --config configs/scaling.py:full --workdir runs/scaling_full
  python experiments/scaling.py --config configs/scaling.py:1b --workdir runs/scaling_1b

Writes scaling.json, scaling.md (also printed), breakeven_vs_width.png and, when the config
sweeps G, cost_vs_length.png to --workdir. Any config key can be overridden, e.g.
--config.max_cell_tflop=2.
"""

from absl import app, flags

import _config_args  # experiments/_config_args.py: --config found from any directory

_CONFIG = _config_args.define("configs/scaling.py", "configs/scaling.py[:full]",
                               lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/scaling", "Output directory.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # pylint: disable=import-outside-toplevel  (JAX loads after the flags: _config_args)
  from studylib import scaling
  scaling.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  _config_args.run(main)
