"""Masked diffusion (LLaDA-style SFT) on two-digit addition, sized for 2 CPU cores in minutes.

  python experiments/train.py --config configs/mdm_tiny.py --workdir /tmp/dllm_jax_runs/mdm_tiny

Same network and data as ar_tiny.py; bidirectional attention, the prompt is never masked, and
the answer's EOS padding is masked and trained on. Evaluated by LLaDA decoding, one token per
step (low-confidence remasking). d2f_tiny.py distils from this run.
"""

from dllm_jax.training import config as config_lib


def get_config():
  c = config_lib.tiny_arithmetic_config()  # network + data shared by every *_tiny run

  c.objective.name = "mdm"
  c.objective.options = {"sft": True}

  c.opt.lr = 3e-3
  c.opt.warmup_steps = 100
  c.opt.weight_decay = 0.1

  c.train.steps = 3000
  c.train.batch_size = 64
  c.train.log_every = 100
  c.train.eval_every = 1000
  c.train.ckpt_every = 1000

  c.decode.method = "llada"      # gen_length = answer region, one token per step
  c.decode.eval_examples = 256
  return config_lib.finalize(c)
