"""Decode prompts with any decoder: a thin shell around `python -m dllm_jax.generate`.

  # a trained run (model shape, tokenizer and prompt layout come from its config.json)
  python experiments/generate.py --workdir /tmp/mdm_tiny --method fast_dllm \
      --prompt "12+34=" --opt threshold=0.9

  # smoke test: random weights of a preset
  python experiments/generate.py --preset small --method llada --prompt "hello" \
      --gen_length 32 --opt steps=16

Every flag is `dllm_jax.generate`'s (`--help` lists them); `--workdir RUN` is `--model RUN`
that must be a training workdir.
"""

import sys

from dllm_jax import generate

if __name__ == "__main__":
  sys.exit(generate.main())
