"""Data-parallel decode benchmark: a thin shell around `studylib.dp_bench.run`.

  python experiments/bench_data_parallel.py   # 8 fake CPU devices, writes runs/bench_data_parallel

Any config key can be overridden, e.g. --config.repeats=3.
"""

import os

# 8 fake CPU devices: XLA reads this once, when jax is first imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

from absl import app, flags  # noqa: E402

import _config_args  # noqa: E402  (experiments/_config_args.py)

_CONFIG = _config_args.define("configs/bench_data_parallel.py", "configs/bench_data_parallel.py",
                               lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_data_parallel", "Output directory.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # pylint: disable=import-outside-toplevel  (JAX loads after the flags: _config_args)
  from studylib import dp_bench
  dp_bench.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  _config_args.run(main)
