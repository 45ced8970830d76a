"""AR baseline on two-digit addition, small enough to train on 2 CPU cores in minutes.

  python experiments/train.py --config configs/ar_tiny.py --workdir /tmp/dllm_jax_runs/ar_tiny

Causal next-token loss on the answer (prompts left-padded to a fixed length); evaluated by
greedy decoding of held-out prompts (exact match of the final answer). Same network and data
as mdm_tiny.py, so the two compare like for like.
"""

from dllm_jax.training import config as config_lib


def get_config():
  c = config_lib.base_config()
  c.model.preset = "small"       # resized below: 0.46M params, ~0.1 s/step on 2 CPU cores
  c.model.vocab_size = 64        # the char tokenizer uses 47 ids
  c.model.d_model, c.model.n_layers, c.model.mlp_dim = 96, 3, 384
  c.model.max_seq_len = 64

  c.data.tasks = "arithmetic:1"  # two-digit addition: 37+48=85
  c.data.tokenizer = "char"
  c.data.block_size = 4          # answer canvas of 8 slots, as in every *_tiny config: the
                                 # D2F student (d2f_tiny.py) must see its teacher's canvas

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
