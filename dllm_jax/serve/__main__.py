"""`python -m dllm_jax.serve`: see `dllm_jax.serve.cli`."""

import sys

from dllm_jax.serve.cli import main

if __name__ == "__main__":
  sys.exit(main())
