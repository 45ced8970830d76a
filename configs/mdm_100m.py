"""Masked-diffusion 100M-parameter model on the synthetic reasoning mixture, for one accelerator.

  python experiments/train.py --config configs/mdm_100m.py --workdir /runs/mdm_100m

Byte tokenizer, d_model 768, 12 layers (preset base_100m), bfloat16 compute with float32
params; LLaDA SFT loss (prompt never masked). ar_100m.py and mdm_100m.py differ only in objective and decoder, so their
speed and accuracy compare like for like.
"""

from dllm_jax.training import config as config_lib


def get_config():
  c = config_lib.mixture_100m_config()  # network + data shared by the *_100m runs

  c.objective.name = "mdm"
  c.objective.options = {"sft": True}

  c.opt.lr = 3e-4
  c.opt.warmup_steps = 1000
  c.opt.weight_decay = 0.1

  c.train.steps = 20_000
  c.train.batch_size = 256
  c.train.log_every = 100
  c.train.eval_every = 2000
  c.train.ckpt_every = 2000

  c.mesh.shape = {"data": -1, "fsdp": 1, "tensor": 1}

  c.decode.method = "llada"
  c.decode.eval_examples = 512
  c.decode.batch_size = 128
  return config_lib.finalize(c)
