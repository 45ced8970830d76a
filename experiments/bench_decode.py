"""Decode benchmark: a thin shell around `studylib.decode_bench.run`.

  python experiments/bench_decode.py   # = --config configs/bench_decode.py --workdir runs/bench_decode

Writes bench_decode.json and bench_decode.md (also printed) to --workdir. Any config key can
be overridden, e.g. --config.repeats=3.
"""

from absl import app, flags

import _config_args  # experiments/_config_args.py: --config found from any directory

_CONFIG = _config_args.define("configs/bench_decode.py", "configs/bench_decode.py",
                               lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_decode", "Output directory.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # pylint: disable=import-outside-toplevel  (JAX loads after the flags: _config_args)
  from studylib import decode_bench
  decode_bench.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  _config_args.run(main)
