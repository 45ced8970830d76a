"""Everything a run needs, built from a config before anything is compiled.

`build(config)` resolves the model config, tokenizer, row layout, decoder settings, mesh and
rules, optimizer and schedule, the train and eval objectives, and the abstract state with its
shardings (traced with `eval_shape`: nothing is allocated). Config mistakes surface here as
ValueErrors that name the key, before anything is compiled.
`initial_params(...)` overlays params from a checkpoint (`train.init_from`: a training run,
a converted checkpoint or a HF directory): a D2F student starts from a trained MDM or from
LLaDA (its LoRA adapters stay fresh), a fine-tune from its base model.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import flax.linen as nn
import ml_collections
import optax
from etils import epath
from flax import traverse_util
from jax.sharding import Mesh

from dllm_jax.checkpoints import convert, hf
from dllm_jax.data.layouts import SFTLayout
from dllm_jax.data.tokenizers import Tokenizer
from dllm_jax.diffusion import objectives
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import abstract_params
from dllm_jax.parallel import mesh as mesh_lib
from dllm_jax.training import accuracy
from dllm_jax.training import checkpoint as ckpt_lib
from dllm_jax.training import config as config_lib
from dllm_jax.training import data as data_lib
from dllm_jax.training import optimizer as opt_lib
from dllm_jax.training import state as state_lib


@dataclasses.dataclass
class Experiment:
  """The built pieces of a config (see the module docstring)."""
  config: Any
  model_cfg: ModelConfig
  tokenizer: Tokenizer
  layout: SFTLayout
  mesh: Mesh
  rules: tuple
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  loss_fn: Any
  eval_loss_fn: Any
  boxed_abstract: state_lib.TrainState
  shardings: state_lib.TrainState
  batch_shardings: dict

  @property
  def abstract(self) -> state_lib.TrainState:
    """Plain abstract state carrying the target shardings (for restoring)."""
    return state_lib.unboxed_abstract(self.boxed_abstract, self.shardings)

  @property
  def eval_batch_size(self) -> int:
    return int(self.config.train.batch_size) // int(self.config.opt.grad_accum)


def _check_batch_split(config, mesh: Mesh, rules) -> None:
  batch, accum = int(config.train.batch_size), int(config.opt.grad_accum)
  dp = mesh_lib.data_parallel_size(mesh, rules)
  if batch % (accum * dp):
    raise ValueError(
        f"train.batch_size={batch} must be a multiple of opt.grad_accum={accum} times the "
        f"data-parallel size {dp} (mesh axes under the 'batch' rule) so that every micro-batch "
        f"splits evenly over the devices; use a multiple of {accum * dp}.")
  data_lib.local_batch_size(batch)  # divisible by the number of processes


def build(config, devices=None) -> Experiment:
  """Builds the pieces of a run (validates the config; allocates nothing on devices)."""
  config_lib.validate(config)
  model_cfg = config_lib.model_config(config)
  tokenizer = data_lib.make_tokenizer(config.data)
  layout = data_lib.make_layout(config.data, tokenizer)
  data_lib.check_compatible(model_cfg, tokenizer, layout)
  accuracy.check_decode_config(config, layout)
  mesh = mesh_lib.make_mesh(dict(config.mesh.shape), devices)
  rules = mesh_lib.rules_from_config(config.mesh.rules)
  _check_batch_split(config, mesh, rules)

  steps = int(config.train.steps)
  schedule = opt_lib.make_schedule(config.opt, steps)
  tx = opt_lib.make_optimizer(config.opt, steps)
  options = dict(config.objective.options)
  step_cfg = model_cfg.replace(scan_layers=False) if config.train.unroll_layers else model_cfg
  loss_fn = objectives.make_objective(config.objective.name, step_cfg, **options)
  eval_loss_fn = objectives.make_objective(config.objective.name, step_cfg, train=False,
                                           **options)
  trainable = config.opt.trainable
  boxed = state_lib.abstract_state(model_cfg, tx, trainable)
  opt_lib.partition(boxed.params, trainable)  # raises if the selection is empty
  return Experiment(
      config=config, model_cfg=model_cfg, tokenizer=tokenizer, layout=layout, mesh=mesh,
      rules=rules, tx=tx, schedule=schedule, loss_fn=loss_fn, eval_loss_fn=eval_loss_fn,
      boxed_abstract=boxed, shardings=state_lib.state_shardings(boxed, mesh, rules),
      batch_shardings=data_lib.batch_shardings(mesh, rules))


def _source_kind(path: str) -> str:
  """'run' (a training workdir), 'converted' (checkpoints.save_converted) or 'hf'."""
  p = epath.Path(path)
  if not p.exists():
    raise ckpt_lib.CheckpointError(f"train.init_from={path!r} does not exist.")
  if (p / ckpt_lib.CHECKPOINT_DIR).exists() or p.parent.name == ckpt_lib.CHECKPOINT_DIR \
      or p.name == ckpt_lib.CHECKPOINT_DIR:
    return "run"
  if (p / convert.CONFIG_FILE).exists():
    return "converted"
  if (p / "config.json").exists() and any(p.glob("*.safetensors")):
    return "hf"
  raise ckpt_lib.CheckpointError(
      f"train.init_from={path!r} is neither a training workdir (config.json + checkpoints/), "
      f"a converted checkpoint ({convert.CONFIG_FILE} + params/) nor a HF model directory "
      "(config.json + *.safetensors).")


def _source_model_config(path: str, kind: str, dtype: str) -> ModelConfig:
  if kind == "converted":
    text = (epath.Path(path) / convert.CONFIG_FILE).read_text()
    return convert.config_from_json(text, path)
  if kind == "hf":
    return hf.config_from_hf(path, dtype=dtype)[0]
  workdir, _ = ckpt_lib.resolve_run(path)
  saved = ckpt_lib.read_config(workdir)
  if saved is None:
    raise ckpt_lib.CheckpointError(f"train.init_from={path!r} has no {ckpt_lib.CONFIG_FILE}; "
                                   "point it at the workdir of a training run.")
  source = ml_collections.ConfigDict(json.loads(saved))
  return config_lib.model_config(source)


def canvas_mismatch(exp: Experiment, path: str) -> str | None:
  """A warning when the training run at `path` used other row shapes (L, P) than `exp`.

  A masked-diffusion model never trained on this canvas (e.g. more answer slots) can be a
  poor teacher or init; returns None when the shapes agree or `path` is not a run.
  """
  if _source_kind(path) != "run":
    return None
  workdir, _ = ckpt_lib.resolve_run(path)
  source = ml_collections.ConfigDict(json.loads(ckpt_lib.read_config(workdir)))
  theirs = data_lib.make_layout(source.data, data_lib.make_tokenizer(source.data))
  ours = exp.layout
  if (theirs.seq_len, theirs.prompt_len) == (ours.seq_len, ours.prompt_len):
    return None
  return (f"train.init_from={path!r} was trained on rows of {theirs.seq_len} tokens (prompt "
          f"{theirs.prompt_len}) but this run uses {ours.seq_len} (prompt {ours.prompt_len}); "
          "the source model never saw this canvas. Match data.tasks / data.block_size.")


def initial_params(exp: Experiment, params, path: str):
  """`params` with every leaf that the checkpoint at `path` has replaced by its value.

  `path` is a training workdir (or one of its step dirs), a `checkpoints.save_converted`
  directory or a HF model directory. Leaves only in `params` (e.g. fresh LoRA adapters) keep
  their init; a leaf only in the source, or with another shape, is an error naming it, raised
  before any tensor is read.
  """
  kind = _source_kind(path)
  source_cfg = _source_model_config(path, kind, exp.model_cfg.param_dtype)
  source = traverse_util.flatten_dict(nn.unbox(abstract_params(source_cfg)))
  target = traverse_util.flatten_dict(nn.unbox(exp.boxed_abstract.params))
  for key, leaf in source.items():
    name = "/".join(key)
    if key not in target:
      raise ValueError(f"train.init_from: the source has param {name!r} that this model "
                       "lacks; the model configs differ (compare model.* with the source).")
    if leaf.shape != target[key].shape:
      raise ValueError(f"train.init_from: param {name!r} is {leaf.shape} in the source but "
                       f"{target[key].shape} here; the model configs differ.")
  if kind == "run":
    target_shardings = traverse_util.flatten_dict(exp.shardings.params)
    shardings = traverse_util.unflatten_dict({k: target_shardings[k] for k in source})
    loaded = ckpt_lib.load_params(path, shardings=shardings).params
  elif kind == "converted":
    _, loaded = convert.load_converted(path, mesh=exp.mesh, rules=exp.rules)
  else:
    _, loaded = hf.load_pretrained(path, dtype=exp.model_cfg.param_dtype, mesh=exp.mesh,
                                   rules=exp.rules)
  flat = traverse_util.flatten_dict(params)
  for key, value in traverse_util.flatten_dict(loaded).items():
    flat[key] = value.astype(target[key].dtype)
  return traverse_util.unflatten_dict(flat)
