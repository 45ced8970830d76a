"""Decode benchmark: a thin shell around `dllm_jax.study.decode_bench.run`.

  python experiments/bench_decode.py   # = --config configs/bench_decode.py --workdir runs/bench_decode

Writes bench_decode.json and bench_decode.md (also printed) to --workdir. Any config key can
be overridden, e.g. --config.repeats=3.
"""

from absl import app, flags
from ml_collections import config_flags

from dllm_jax.study import decode_bench

_CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_decode.py",
                                          "configs/bench_decode.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_decode", "Output directory.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  decode_bench.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
