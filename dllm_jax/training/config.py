"""The experiment config schema: one `ml_collections.ConfigDict` with a fixed set of keys.

`base_config()` returns every key the trainer reads, with defaults; an experiment file under
`configs/` edits it and returns `finalize(config)`, which checks it and locks it, so a typo
(`config.train.stpes = 5` or `--config.train.stpes=5`) is an error instead of a silent no-op.

  model      preset + an optional override for every `ModelConfig` field (None = preset's)
  data       task mixture (`TaskSuite.parse` syntax), tokenizer, record counts, layout
  objective  name ("ar", "mdm", "block_diffusion", "d2f", "selfspec") + its options
  opt        schedule, AdamW, clipping, gradient accumulation, trainable subset
  train      steps, global batch, seeds, eval / checkpoint / log cadence, init checkpoint
  mesh       mesh shape {data, fsdp, tensor} and logical-axis rules
  decode     decoder settings used by evaluation and benchmarks
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing

from ml_collections import config_dict

from dllm_jax.models.config import ModelConfig, get_preset
from dllm_jax.parallel import axes as axes_lib

OBJECTIVES = ("ar", "mdm", "block_diffusion", "d2f", "selfspec")
TOKENIZERS = ("char", "byte")  # or a path to a tokenizer.json
# Keys that may change between a run and its resumption (everything else must match). A new
# train.steps also stretches the schedule unless opt.decay_steps is set.
RESUMABLE_CHANGES = ("train.steps", "train.eval_every", "train.eval_batches", "train.ckpt_every",
                     "train.keep", "train.log_every", "train.allow_config_change",
                     "train.async_checkpoints", "train.unroll_layers", "mesh", "decode")


def _placeholder_type(annotation) -> type:
  """`int | None` -> int, `str` -> str (the field type a CLI override is parsed as)."""
  if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0]
  return annotation


def _model_section() -> config_dict.ConfigDict:
  hints = typing.get_type_hints(ModelConfig)
  section = config_dict.ConfigDict()
  section.preset = "tiny"
  for field in dataclasses.fields(ModelConfig):
    if field.name != "name":
      section[field.name] = config_dict.placeholder(_placeholder_type(hints[field.name]))
  return section


def base_config() -> config_dict.ConfigDict:
  """Every key the trainer reads, with defaults (unlocked: experiment files edit it)."""
  c = config_dict.ConfigDict()
  c.model = _model_section()

  c.data = config_dict.ConfigDict()
  c.data.tasks = "arithmetic:1"        # TaskSuite.parse syntax: name:difficulty[:weight],...
  c.data.tokenizer = "char"            # "char" (TASK_ALPHABET), "byte", or a tokenizer.json path
  c.data.source = "synthetic"          # "synthetic" (in memory) or "tfds" (array_record)
  c.data.data_dir = config_dict.placeholder(str)  # TFDS data_dir for source="tfds"
  c.data.train_size = 200_000          # records in the train split
  c.data.eval_size = 512               # records in the held-out split
  c.data.test_fraction = 0.1           # share of all prompts reserved for the test split
  c.data.seed = 0                      # record generation and shuffling
  c.data.fixed_prompt = True           # left-pad prompts to P so answers start at P
  c.data.pad = "eos"                   # answer padding: "eos" (trained on, LLaDA) or "pad"
  c.data.block_size = config_dict.placeholder(int)  # round the answer region up to blocks
  c.data.gen_length = config_dict.placeholder(int)  # the answer region G (None: as above)

  c.objective = config_dict.ConfigDict()
  c.objective.name = "mdm"
  c.objective.options = config_dict.ConfigDict()

  c.opt = config_dict.ConfigDict()
  c.opt.lr = 1e-3
  c.opt.schedule = "cosine"            # "cosine" | "constant" | "linear" (after warmup)
  c.opt.warmup_steps = 100
  c.opt.decay_steps = config_dict.placeholder(int)  # default: train.steps
  c.opt.end_lr_frac = 0.1
  c.opt.b1 = 0.9
  c.opt.b2 = 0.95
  c.opt.eps = 1e-8
  c.opt.weight_decay = 0.1
  c.opt.decay_embeddings = False
  c.opt.clip_norm = 1.0                # 0 disables clipping
  c.opt.grad_accum = 1                 # micro-batches per update (scanned inside the step)
  c.opt.trainable = "all"              # "all", "lora" or a regex over 'a/b/c' param paths

  c.train = config_dict.ConfigDict()
  c.train.steps = 1000
  c.train.batch_size = 64              # global batch (all processes, all micro-batches)
  c.train.seed = 0                     # params init and per-step noise
  c.train.log_every = 50
  c.train.eval_every = 500             # 0 disables periodic eval (a final eval still runs)
  c.train.eval_batches = 4             # 0 = the whole eval split
  c.train.ckpt_every = 500             # 0 saves only at the end
  c.train.keep = 3                     # checkpoints kept (oldest deleted first)
  c.train.async_checkpoints = True
  c.train.init_from = config_dict.placeholder(str)  # workdir or checkpoint dir to load params
  c.train.allow_config_change = False  # resume a workdir whose saved config differs
  # The train and eval steps run the layers unrolled (the same scanned params and products):
  # for a few small layers on a CPU the scan's backward pass stacks and zero-fills residuals
  # each step (a fifth of a small model's step). Decoders keep model.scan_layers.
  c.train.unroll_layers = False

  c.mesh = config_dict.ConfigDict()
  c.mesh.shape = config_dict.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  c.mesh.rules = tuple(axes_lib.DEFAULT_RULES)

  c.decode = config_dict.ConfigDict()
  c.decode.method = "ar"               # a dllm_jax.decoding.registry name
  c.decode.options = config_dict.ConfigDict()  # the method's options; gen_length defaults
                                               # to the answer region of data rows
  c.decode.eval_examples = 0           # test prompts decoded and scored per eval (0 = off)
  c.decode.batch_size = 64             # prompts per decode call
  return c


def tiny_arithmetic_config() -> config_dict.ConfigDict:
  """`base_config()` with the network and data that every `*_tiny` config shares.

  The AR, MDM, block-diffusion and D2F tiny runs must agree on model shape and answer canvas
  (a D2F student is distilled on its teacher's canvas, and a masked-diffusion model fails on a
  canvas length it was not trained on), so they are set here once: a 0.46M-parameter network
  (~0.1 s/step on 2 CPU cores), two-digit addition, char tokenizer, 8 answer slots.
  """
  c = base_config()
  c.model.preset = "small"
  c.model.vocab_size = 64        # the char tokenizer uses 47 ids
  c.model.d_model, c.model.n_layers, c.model.mlp_dim = 96, 3, 384
  c.model.max_seq_len = 64
  c.data.tasks = "arithmetic:1"  # two-digit addition: 37+48=85
  c.data.tokenizer = "char"
  c.data.block_size = 4          # rounds the answer canvas up to 8 slots
  c.train.unroll_layers = True   # 3 small layers: the unrolled train step is ~15% cheaper
  return c


def mixture_100m_config() -> config_dict.ConfigDict:
  """`base_config()` with the ~100M-parameter network and mixture the `*_100m` configs share."""
  c = base_config()
  c.model.preset = "base_100m"
  c.model.dtype = "bfloat16"
  c.model.max_seq_len = 256
  c.data.tasks = "arithmetic:3,arithmetic:4,sorting:3,running_sum:3"
  c.data.tokenizer = "byte"
  c.data.train_size = 2_000_000
  c.data.eval_size = 2000
  return c


def model_config(config) -> ModelConfig:
  """The `ModelConfig` of `config.model`: the preset with every non-None override applied."""
  section = config.model
  overrides = {k: v for k, v in section.items() if k != "preset" and v is not None}
  return get_preset(section.preset, **overrides)


def validate(config) -> None:
  """Checks that need no devices; raises ValueError naming the key and the fix."""
  model_config(config)
  if config.objective.name not in OBJECTIVES:
    raise ValueError(f"objective.name={config.objective.name!r} is unknown; use one of "
                     f"{OBJECTIVES}.")
  t, o = config.train, config.opt
  for key in ("steps", "batch_size"):
    if int(t[key]) <= 0:
      raise ValueError(f"train.{key} must be positive, got {t[key]}.")
  for key in ("log_every", "eval_every", "eval_batches", "ckpt_every"):
    if int(t[key]) < 0:
      raise ValueError(f"train.{key} must be >= 0, got {t[key]}.")
  if int(t.keep) < 1:
    raise ValueError(f"train.keep must be >= 1 (checkpoints kept), got {t.keep}.")
  if int(o.grad_accum) < 1 or int(t.batch_size) % int(o.grad_accum):
    raise ValueError(f"opt.grad_accum={o.grad_accum} must be >= 1 and divide "
                     f"train.batch_size={t.batch_size}.")
  if float(o.lr) <= 0:
    raise ValueError(f"opt.lr must be positive, got {o.lr}.")
  if config.data.pad not in ("eos", "pad"):
    raise ValueError(f"data.pad must be 'eos' or 'pad', got {config.data.pad!r}.")
  if config.data.source not in ("synthetic", "tfds"):
    raise ValueError(f"data.source must be 'synthetic' or 'tfds', got {config.data.source!r}.")
  if config.objective.name == "d2f" and not config.train.init_from:
    raise ValueError("objective 'd2f' distills from a trained diffusion model: set "
                     "train.init_from to its workdir or checkpoint directory.")
  if int(config.decode.eval_examples) < 0 or int(config.decode.batch_size) < 1:
    raise ValueError("decode.eval_examples must be >= 0 and decode.batch_size >= 1.")
  unknown = sorted(set(config.mesh.shape) - set(axes_lib.MESH_AXES))
  if unknown:
    raise ValueError(f"mesh.shape has unknown axes {unknown}; use {axes_lib.MESH_AXES}.")
  axes_lib.rules_from_config(config.mesh.rules)


def finalize(config) -> config_dict.ConfigDict:
  """Validates and locks an experiment config (call at the end of every `get_config`)."""
  validate(config)
  config.lock()
  return config


def to_json(config) -> str:
  return config.to_json(sort_keys=True, indent=1)


def _drop(tree: dict, dotted: str) -> None:
  *parents, last = dotted.split(".")
  for key in parents:
    tree = tree.get(key, {})
  tree.pop(last, None)


def config_differences(saved_json: str, config) -> list[str]:
  """Dotted keys whose values differ between a saved run config and `config`, ignoring the
  keys a resumed run may change (`RESUMABLE_CHANGES`)."""
  old, new = json.loads(saved_json), json.loads(to_json(config))
  for key in RESUMABLE_CHANGES:
    _drop(old, key)
    _drop(new, key)

  def diff(a, b, prefix=""):
    if isinstance(a, dict) and isinstance(b, dict):
      out = []
      for k in sorted(set(a) | set(b)):
        out += diff(a.get(k), b.get(k), f"{prefix}{k}.")
      return out
    return [] if a == b else [f"{prefix[:-1]}: {a!r} -> {b!r}"]

  return diff(old, new)
