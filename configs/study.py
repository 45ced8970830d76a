"""The speed-versus-quality study (the README's main job).

  python experiments/study.py                                  # default CPU run, ~15 min
  python experiments/study.py --config configs/study.py:full   # larger, for an accelerator

Three models of the same size on the same synthetic data: an AR model, a masked-diffusion
model (MDM), and a D2F student distilled from the MDM (LoRA, block-causal). Every decoder then
runs on the same held-out prompts at batch 1 and at a larger batch. Model training configs come
from configs/{ar,mdm,d2f}_tiny.py; this file only sets what the study must hold fixed (data,
canvas, steps) and the decoding grid. Every setting listed here is reported; none is dropped.
"""

import importlib.util
import os

from ml_collections import config_dict

_HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 16  # the answer canvas is rounded up to this: G = 16 for every decoder


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return config_dict.ConfigDict(module.get_config().to_dict())  # an unlocked copy


def _methods(full: bool):
  d2f = []
  for block in ((4, 8) if not full else (8, 16)):
    for tau in (0.9, 0.7, 0.5):
      d2f.append({"method": "d2f", "label": f"d2f k={block} tau={tau}", "model": "d2f",
                  "options": {"block_size": block, "tau_conf": tau, "tau_add": 0.1,
                              "tau_act": 0.95}})
  return [
      {"method": "ar", "label": "ar", "model": "ar", "options": {}},
      # Vanilla LLaDA: one token per step over the whole canvas, and cheaper step counts.
      {"method": "llada", "label": "llada steps=G", "model": "mdm",
       "options": {"block_length": BLOCK, "early_stop": False}},
      {"method": "llada", "label": "llada steps=G early-stop", "model": "mdm",
       "options": {"block_length": BLOCK}},
      {"method": "llada", "label": "llada steps=G/2", "model": "mdm",
       "options": {"block_length": BLOCK, "steps_fraction": 0.5}},
      {"method": "fast_dllm", "label": "fast-dllm tau=0.9", "model": "mdm",
       "options": {"block_length": BLOCK // 2, "threshold": 0.9, "cache": "none"}},
      {"method": "fast_dllm", "label": "fast-dllm tau=0.9 prefix", "model": "mdm",
       "options": {"block_length": BLOCK // 2, "threshold": 0.9, "cache": "prefix"}},
      {"method": "fast_dllm", "label": "fast-dllm tau=0.9 dual", "model": "mdm",
       "options": {"block_length": BLOCK // 2, "threshold": 0.9, "cache": "dual"}},
      # D2F decoding on the undistilled MDM: what the distillation buys.
      {"method": "d2f", "label": "d2f on mdm (no distill) k=8", "model": "mdm",
       "options": {"block_size": 8, "tau_conf": 0.9}},
      {"method": "block_diffusion", "label": "block diffusion k=4", "model": "d2f",
       "options": {"block_size": 4, "steps_per_block": 4}},
  ] + d2f


def get_config(mode: str = ""):
  full = mode == "full"
  if mode not in ("", "full"):
    raise ValueError(f"unknown study mode {mode!r}; use configs/study.py or configs/study.py:full")
  c = config_dict.ConfigDict()
  c.models = config_dict.ConfigDict()
  c.models.ar = _load("ar_tiny")
  c.models.mdm = _load("mdm_tiny")
  c.models.d2f = _load("d2f_tiny")

  # One data section for all three models: same tasks, tokenizer, canvas and held-out split.
  c.data = config_dict.ConfigDict(c.models.mdm.data.to_dict())
  c.data.tasks = "arithmetic:1"
  c.data.block_size = BLOCK
  if full:
    c.data.tasks = "arithmetic:2,arithmetic:4,running_sum:2"

  steps = {"ar": 1500, "mdm": 3000, "d2f": 1000} if not full else \
      {"ar": 20000, "mdm": 40000, "d2f": 10000}
  for name, n in steps.items():
    m = c.models[name]
    m.train.steps = n
    m.train.eval_every = 0
    m.train.ckpt_every = 0 if not full else 5000
    m.decode.eval_examples = 0
    m.opt.decay_steps = None
    if full:
      m.model.d_model, m.model.n_layers, m.model.mlp_dim = 512, 8, 2048
      m.model.n_heads = m.model.n_kv_heads = 8
      m.model.max_seq_len = 128

  c.eval = config_dict.ConfigDict()
  c.eval.num_prompts = 128 if not full else 512
  c.eval.batch_sizes = (1, 16) if not full else (1, 64)
  c.eval.seed = 0
  c.eval.headline_task = "arithmetic"
  c.eval.llada_vanilla_label = "llada steps=G"
  c.methods = _methods(full)
  c.lock()
  return c
