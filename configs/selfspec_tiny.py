"""Self-speculative (TiDAR-style) model on two-digit addition: one network trained to verify
causally and to draft a block of masks, CPU-sized like ar_tiny.py (same network and data).

  python experiments/train.py --config configs/selfspec_tiny.py --workdir /tmp/selfspec_tiny

Loss: causal AR cross-entropy plus CE of a fully masked 4-slot block that sees a clean causal
prefix (diffusion.objectives.selfspec_loss). Evaluated by greedy AR decoding, which
`decoding.selfspec.selfspec_generate(params, cfg, ..., draft_length=3)` reproduces token for
token with fewer forwards.
"""

from dllm_jax.training import config as config_lib

BLOCK = 4


def get_config():
  c = config_lib.tiny_arithmetic_config()  # network + data shared by every *_tiny run

  c.objective.name = "selfspec"
  c.objective.options = {"block_size": BLOCK, "draft_weight": 1.0}

  c.opt.lr = 3e-3
  c.opt.warmup_steps = 100
  c.opt.weight_decay = 0.1

  c.train.steps = 2000
  c.train.batch_size = 64
  c.train.log_every = 100
  c.train.eval_every = 500
  c.train.ckpt_every = 500

  c.decode.method = "ar"         # greedy AR; method "selfspec" gives the same tokens
  c.decode.eval_examples = 256
  return config_lib.finalize(c)
