"""HTTP serving benchmark: a thin shell around `studylib.serve_http_bench.run`.

  python experiments/serve_http_bench.py   # --config configs/serve_http_bench.py
                                           # --workdir runs/serve_http_bench

Writes serve_http_bench.json and serve_http_bench.md (also printed) to --workdir.
Any config key can be overridden, e.g. --config.concurrency='(16,)'.
"""

from absl import app, flags

import _config_args  # experiments/_config_args.py: --config found from any directory

_CONFIG = _config_args.define("configs/serve_http_bench.py", "configs/serve_http_bench.py",
                               lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/serve_http_bench", "Output directory.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # pylint: disable=import-outside-toplevel  (JAX loads after the flags: _config_args)
  from studylib import serve_http_bench
  serve_http_bench.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  _config_args.run(main)
