"""D2F on two-digit addition: distil a trained mdm_tiny run into a block-causal LoRA student.

  python experiments/train.py --config configs/mdm_tiny.py --workdir /tmp/dllm_jax_runs/mdm_tiny
  python experiments/train.py --config configs/d2f_tiny.py --workdir /tmp/dllm_jax_runs/d2f_tiny \
      [--config.train.init_from=<the mdm_tiny workdir>]

The student is the MDM plus LoRA adapters (only they train); the teacher is the same network
with the adapters off and bidirectional attention, on the same noisy canvas with per-block
mask ratios rising along the answer. Evaluated with D2F's pipelined parallel decoding.
"""

from dllm_jax.training import config as config_lib

BLOCK = 4


def get_config():
  c = config_lib.tiny_arithmetic_config()  # network + data shared by every *_tiny run
  c.model.lora_rank = 16
  c.model.lora_alpha = 16.0
  c.model.lora_dropout = 0.1
  c.data.block_size = BLOCK

  c.objective.name = "d2f"
  c.objective.options = {"block_size": BLOCK}

  c.opt.trainable = "lora"
  c.opt.lr = 1e-3
  c.opt.warmup_steps = 50
  c.opt.weight_decay = 0.05

  c.train.steps = 1500
  c.train.batch_size = 64
  c.train.log_every = 100
  c.train.eval_every = 500
  c.train.ckpt_every = 500
  c.train.init_from = "/tmp/dllm_jax_runs/mdm_tiny"

  c.decode.method = "d2f"
  c.decode.options = {"block_length": BLOCK}
  c.decode.eval_examples = 256
  return config_lib.finalize(c)
