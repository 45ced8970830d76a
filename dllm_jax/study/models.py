"""The study's trained models: train once, then load from the local orbax cache.

Each model is an ordinary training run (`dllm_jax.training.trainer.train`) in
`<workdir>/models/<name>`; a run that reached its final step with this study's config is
loaded at that step without training (a run with another config is refused, naming the
differences), and an interrupted one resumes. The D2F student starts from the MDM
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
from dllm_jax.training import config as config_lib
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


def cache_mismatch(workdir, name: str, cfg) -> list[str]:
  """Why the cached run of `name` is not the model `cfg` describes ([] when it is).

  Compares the run's saved config with `cfg` (keys a resumed run may change are ignored, and
  so is the spelling of `train.init_from`: the student always starts from this workdir's MDM).
  """
  saved = ckpt_lib.read_config(run_dir(workdir, name))
  if saved is None:
    return [f"{run_dir(workdir, name)} has no {ckpt_lib.CONFIG_FILE}"]
  return [d for d in config_lib.config_differences(saved, cfg)
          if not d.startswith("train.init_from:")]


def ensure_models(study_config, workdir, *, log: Callable[[str], None] = print) -> dict:
  """Trains missing models (resuming partial runs) and loads all of them.

  A cached model is used only if it was trained with this study's config, and it is loaded
  at exactly the configured step; otherwise a CheckpointError says what differs and how to
  retrain. Returns {name: TrainedModel(params, model_cfg, config)}.
  """
  models = {}
  for name in ORDER:
    if name not in study_config.models:
      continue
    cfg = training_config(study_config, name, workdir)
    steps, path = int(cfg.train.steps), run_dir(workdir, name)
    if is_trained(workdir, name, steps):
      diffs, done = cache_mismatch(workdir, name, cfg), ckpt_lib.steps_in(path)
      if steps not in done:
        diffs.append(f"checkpoints {done} hold none at train.steps={steps}")
      if diffs:
        raise ckpt_lib.CheckpointError(
            f"the cached {name} model in {path} is not the one this study config trains:\n  "
            + "\n  ".join(diffs) + f"\nDelete {path} (and, for the mdm, the d2f run that "
            "distils it) to retrain, or pass another --workdir.")
      log(f"[study] {name}: using the cached model in {path}")
    else:
      log(f"[study] {name}: training {steps} steps into {path}")
      final = trainer.train(cfg, path)
      log(f"[study] {name}: done, " + ", ".join(
          f"{k}={v:.4g}" for k, v in sorted(final.items()) if k.startswith("eval/")))
    models[name] = for_decoding(ckpt_lib.load_params(path, step=steps))
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
