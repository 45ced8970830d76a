"""Block diffusion on two-digit addition: one noise level per 4-token answer block,
block-causal attention (exact K/V cache at decode time). CPU-sized, like mdm_tiny.py.

  python experiments/train.py --config configs/block_diffusion_tiny.py --workdir /tmp/bd_tiny
"""

from dllm_jax.training import config as config_lib

BLOCK = 4


def get_config():
  c = config_lib.tiny_arithmetic_config()  # network + data shared by every *_tiny run
  c.data.block_size = BLOCK      # the answer region is a whole number of blocks

  c.objective.name = "block_diffusion"
  c.objective.options = {"block_size": BLOCK, "sft": True}

  c.opt.lr = 3e-3
  c.opt.warmup_steps = 100

  c.train.steps = 3000
  c.train.batch_size = 64
  c.train.log_every = 100
  c.train.eval_every = 1000
  c.train.ckpt_every = 1000

  c.decode.method = "block_diffusion"
  c.decode.options = {"block_length": BLOCK, "steps_per_block": BLOCK}
  c.decode.eval_examples = 256
  return config_lib.finalize(c)
