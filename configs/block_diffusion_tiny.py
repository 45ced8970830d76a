"""Block diffusion on two-digit addition: one noise level per 4-token answer block,
block-causal attention (exact K/V cache at decode time). CPU-sized, like mdm_tiny.py.

  python experiments/train.py --config configs/block_diffusion_tiny.py --workdir /tmp/bd_tiny
"""

from dllm_jax.training import config as config_lib

BLOCK = 4


def get_config():
  c = config_lib.base_config()
  c.model.preset = "small"       # resized below, as in mdm_tiny.py
  c.model.vocab_size = 64
  c.model.d_model, c.model.n_layers, c.model.mlp_dim = 96, 3, 384
  c.model.max_seq_len = 64

  c.data.tasks = "arithmetic:1"
  c.data.tokenizer = "char"
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
  c.decode.options = {"block_size": BLOCK, "steps_per_block": BLOCK}
  c.decode.eval_examples = 256
  return config_lib.finalize(c)
