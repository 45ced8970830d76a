"""AR baseline on two-digit addition, small enough to train on 2 CPU cores in minutes.

  python experiments/train.py --config configs/ar_tiny.py --workdir /tmp/dllm_jax_runs/ar_tiny

Causal next-token loss on the answer (prompts left-padded to a fixed length); evaluated by
greedy decoding of held-out prompts (exact match of the final answer). Same network and data
as mdm_tiny.py, so the two compare like for like.
"""

from dllm_jax.training import config as config_lib


def get_config():
  c = config_lib.tiny_arithmetic_config()  # network + data shared by every *_tiny run

  c.objective.name = "ar"

  c.opt.lr = 3e-3
  c.opt.warmup_steps = 100
  c.opt.weight_decay = 0.1

  c.train.steps = 2000
  c.train.batch_size = 64
  c.train.log_every = 100
  c.train.eval_every = 500
  c.train.ckpt_every = 500

  c.decode.method = "ar"         # greedy
  c.decode.eval_examples = 256
  return config_lib.finalize(c)
