"""The study's trained models: train once, then load from the local orbax cache.

Each model is an ordinary training run (`dllm_jax.training.trainer.train`) in
`<workdir>/models/<name>`; a run whose latest checkpoint is already at its final step is
loaded without training, and an interrupted one resumes. The D2F student starts from the MDM
run (`train.init_from`), so the three models share tokenizer, task suite and canvas layout.
A student's LoRA adapters are merged into its weights before decoding (`for_decoding`), as
for deployment: all three models then run the same network, and no decoder pays for the
adapters' extra matmuls. Every model decodes over the tokenizer's ids only
(`with_active_vocab`): the model vocab is padded past them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

from ml_collections import config_dict

from dllm_jax.models import lora
from dllm_jax.training import checkpoint as ckpt_lib
from dllm_jax.training import trainer

ORDER = ("ar", "mdm", "d2f")  # d2f distils from mdm, so mdm trains first


def run_dir(workdir, name: str) -> Path:
  return Path(workdir) / "models" / name


def training_config(study_config, name: str, workdir) -> config_dict.ConfigDict:
  """The training config of model `name`, with the study's shared data section applied."""
  base = study_config.models[name]
  cfg = config_dict.ConfigDict(copy.deepcopy(base.to_dict()))
  cfg.data = config_dict.ConfigDict(copy.deepcopy(study_config.data.to_dict()))
  if name == "d2f":
    cfg.train.init_from = str(run_dir(workdir, "mdm"))
    cfg.data.block_size = study_config.data.block_size
  cfg.train.async_checkpoints = False
  cfg.lock()
  return cfg


def is_trained(workdir, name: str, steps: int) -> bool:
  path = run_dir(workdir, name)
  if not path.exists():
    return False
  done = ckpt_lib.steps_in(path)
  return bool(done) and max(done) >= steps


def ensure_models(study_config, workdir, *, log: Callable[[str], None] = print) -> dict:
  """Trains missing models (resuming partial runs) and loads all of them.

  Returns {name: TrainedModel(params, model_cfg, config)}.
  """
  models = {}
  for name in ORDER:
    if name not in study_config.models:
      continue
    cfg = training_config(study_config, name, workdir)
    steps = int(cfg.train.steps)
    if is_trained(workdir, name, steps):
      log(f"[study] {name}: using the cached model in {run_dir(workdir, name)}")
    else:
      log(f"[study] {name}: training {steps} steps into {run_dir(workdir, name)}")
      final = trainer.train(cfg, run_dir(workdir, name))
      log(f"[study] {name}: done, " + ", ".join(
          f"{k}={v:.4g}" for k, v in sorted(final.items()) if k.startswith("eval/")))
    models[name] = for_decoding(ckpt_lib.load_params(run_dir(workdir, name)))
  return models


def for_decoding(model: ckpt_lib.TrainedModel) -> ckpt_lib.TrainedModel:
  """The model with any LoRA adapters folded into its kernels (same logits, plain network)."""
  if not model.model_cfg.lora_rank:
    return model
  cfg, params = lora.merge_lora(model.params, model.model_cfg)
  return model._replace(params=params, model_cfg=cfg)


def with_active_vocab(model: ckpt_lib.TrainedModel, n: int) -> ckpt_lib.TrainedModel:
  """The model restricted to ids < n (the tokenizer's), when its vocab is padded past them:
  an undertrained model then cannot emit an id that decodes to nothing."""
  if n >= model.model_cfg.vocab_size:
    return model
  return model._replace(model_cfg=model.model_cfg.replace(active_vocab_size=int(n)))
