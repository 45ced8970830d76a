"""D2F on LLaDA-8B-Instruct (the paper's recipe), for an accelerator slice.

  python experiments/train.py --config configs/llada_8b_d2f.py --workdir gs://.../llada_d2f \
      --config.train.init_from=/models/LLaDA-8B-Instruct \
      --config.data.tokenizer=/models/LLaDA-8B-Instruct/tokenizer.json

LoRA r=32, alpha=32, dropout 0.1 on q/k/v/o; answer blocks of 16; AdamW (0.9, 0.95), weight
decay 0.05, lr 1e-5, gradient clipping 1.0. `init_from` takes the HF directory (or a
`checkpoints.save_converted` copy of it, which reloads faster). The paper distils on ~17k
reasoning prompts answered by an AR model; here the synthetic task mixture stands in (point
data.source / data.data_dir at a prepared TFDS dataset to change it). Parameters are sharded
FSDP over every chip; activations are rematerialised per block.
"""

from dllm_jax.training import config as config_lib

BLOCK = 16


def get_config():
  c = config_lib.base_config()
  c.model.preset = "llada_8b"
  c.model.lora_rank = 32
  c.model.lora_alpha = 32.0
  c.model.lora_dropout = 0.1
  c.model.remat_policy = "full"

  c.data.tasks = "arithmetic:3,arithmetic:5,running_sum:3,sorting:4"
  c.data.tokenizer = "/models/LLaDA-8B-Instruct/tokenizer.json"
  c.data.block_size = BLOCK
  c.data.train_size = 100_000
  c.data.eval_size = 1000

  c.objective.name = "d2f"
  c.objective.options = {"block_size": BLOCK}

  c.opt.trainable = "lora"
  c.opt.lr = 1e-5
  c.opt.schedule = "constant"
  c.opt.warmup_steps = 20
  c.opt.b1, c.opt.b2 = 0.9, 0.95
  c.opt.weight_decay = 0.05
  c.opt.clip_norm = 1.0
  c.opt.grad_accum = 4

  c.train.steps = 2000
  c.train.batch_size = 32
  c.train.log_every = 10
  c.train.eval_every = 250
  c.train.ckpt_every = 250
  c.train.init_from = "/models/LLaDA-8B-Instruct"

  c.mesh.shape = {"data": 1, "fsdp": -1, "tensor": 1}

  c.decode.method = "d2f"
  c.decode.options = {"block_length": BLOCK, "tau_add": 0.1, "tau_act": 0.95, "tau_conf": 0.9}
  c.decode.eval_examples = 256
  c.decode.batch_size = 32
  return config_lib.finalize(c)
