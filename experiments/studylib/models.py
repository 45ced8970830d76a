"""The study's trained models: train once, then load from the local orbax cache.

Each model is an ordinary training run (`dllm_jax.training.trainer.train`) in
`<workdir>/models/<name>`; a run that reached its final step with this study's config is
loaded at that step without training (a run with another config is refused, naming the
differences), and an interrupted one resumes. The D2F student starts from the MDM
run (`train.init_from`), and with `mdm_from_ar` the MDM from the AR run (`init_source`), so
the three models share tokenizer, task suite and canvas layout; the default mode's narrow
block-diffusion drafter `bd_draft` starts from the narrow AR drafter `ar_draft`. The data is
the package's TFDS path: array_record files under `<workdir>/data` (`study_data`), built once by
`builders.prepare` and read with `tfds.data_source`; `check_records` confirms they hold the
synthetic generator's records, so models cached from either source are the same models.
A student's LoRA adapters are merged into its weights before decoding (`for_decoding`), as
for deployment: all three models then run the same network, and no decoder pays for the
adapters' extra matmuls. Every model decodes over the tokenizer's ids only
(`with_active_vocab`): the model vocab is padded past them.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from ml_collections import config_dict

from dllm_jax.data.sources import SyntheticSource
from dllm_jax.models import lora
from dllm_jax.training import checkpoint as ckpt_lib
from dllm_jax.training import config as config_lib
from dllm_jax.training import data as data_lib
from dllm_jax.training import trainer

ORDER = ("ar", "mdm", "d2f")  # d2f distils from mdm (and mdm may start from ar): these first
# Models that always start from another study model's trained params (`init_source`);
# `training_order` puts each right after its source.
STARTS_FROM = {"d2f": "mdm", "bd_draft": "ar_draft", "selfspec": "ar"}
TRAIN_RECORD = "study_train.json"  # <run dir>/: the wall time and final metrics of training
DATA_DIR = "data"  # <workdir>/data: the study's TFDS array_record files
# Keys that choose where the records come from, not which records: a cached model trained on
# either source is the same model, since the TFDS files hold the generator's records exactly
# (checked by `check_records` before any model is trained or loaded).
SOURCE_KEYS = ("data.source", "data.data_dir")
TRAIN_RECORDS_CHECKED = 64  # train records compared with the generator (all eval records are)


def run_dir(workdir, name: str) -> Path:
  return Path(workdir) / "models" / name


def training_order(study_config) -> list[str]:
  """The study's model names in training order: ORDER's first (each starts from one before
  it), then the mode's other models in config order (the narrow AR drafter, from scratch;
  the trade-off mode's schedule MDMs, which start as the MDM does: `init_source`), each
  model of STARTS_FROM right after its source."""
  names = list(study_config.models.keys())
  order: list[str] = []

  def place(name):
    if name not in order:
      source = STARTS_FROM.get(name)
      if source in names:
        place(source)
      order.append(name)

  for name in [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]:
    place(name)
  return order


def train_record(workdir, name: str) -> dict | None:
  """{"seconds", "steps", "first_step", "final"} of the call that finished training model
  `name` in this workdir: its wall time, which for a resumed run covers only steps
  first_step..steps (first_step is 0 for a run trained in one go, and absent from records
  written before it was kept), and its final metrics; None for a model trained before records
  were kept."""
  path = run_dir(workdir, name) / TRAIN_RECORD
  return json.loads(path.read_text()) if path.exists() else None


def study_data(study_config, workdir) -> config_dict.ConfigDict:
  """The study's data section, with data.data_dir = <workdir>/data when data.source='tfds'
  leaves it unset."""
  data = config_dict.ConfigDict(copy.deepcopy(study_config.data.to_dict()))
  if data.source == "tfds" and not data.data_dir:
    data.data_dir = str(Path(workdir) / DATA_DIR)
  return data


def check_records(data_cfg) -> None:
  """Builds the TFDS files if missing (builders.prepare skips existing ones) and checks that
  they hold the synthetic generator's records: every eval record and TRAIN_RECORDS_CHECKED
  train records spread over the split. ValueError naming the folder to delete when they do
  not (files written by another version of the task generator). No-op for source='synthetic'.
  """
  if data_cfg.source != "tfds":
    return
  train, test = data_lib.make_sources(data_cfg)
  suite, seed = data_lib.make_suite(data_cfg), int(data_cfg.seed)
  want_train = SyntheticSource(suite, int(data_cfg.train_size), seed, "train")
  want_test = SyntheticSource(suite, int(data_cfg.eval_size), seed, "test", unique=True)
  checks = [("test", test, want_test, range(len(want_test))),
            ("train", train, want_train,
             sorted({int(i) for i in np.linspace(0, len(want_train) - 1,
                                                 TRAIN_RECORDS_CHECKED)}))]
  for split, got, want, indices in checks:
    if len(got) != len(want):
      problem = f"{len(got)} records, not {len(want)}"
    else:
      first = next((i for i in indices if got[i] != want[i]), None)
      problem = None if first is None else f"record {first} differs"
    if problem:
      raise ValueError(
          f"the TFDS {split} split in data.data_dir={data_cfg.data_dir!r} does not hold the "
          f"records data.tasks={data_cfg.tasks!r} generates (seed {seed}): {problem}. It was "
          "written by another version of the task generator; delete that folder to rebuild "
          "it.")


def init_source(study_config, name: str) -> str | None:
  """The study model whose trained params model `name` starts from: the D2F student from the
  MDM; the MDM from the AR model when `mdm_from_ar` (AR-to-diffusion adaptation, as Dream
  from Qwen2.5: the same network and vocabulary, so every leaf carries over; the [MASK]
  embedding row, which AR training never feeds, starts where AR training left it); the
  trade-off mode's schedule MDMs start as the MDM does; the narrow block-diffusion drafter
  from the narrow AR drafter (the same adaptation at the drafters' width)."""
  if name in STARTS_FROM:
    return STARTS_FROM[name]
  if is_mdm(name) and study_config.get("mdm_from_ar", False):
    return "ar"
  return None


def is_mdm(name: str) -> bool:
  """The study's MDM ("mdm") and the trade-off mode's schedule MDMs ("mdm_<schedule>"): the
  MDMs start alike (from the AR model when `mdm_from_ar`), so only alpha(t) tells them apart."""
  return name == "mdm" or name.startswith("mdm_")


def training_config(study_config, name: str, workdir) -> config_dict.ConfigDict:
  """The training config of model `name`, with the study's shared data section applied."""
  base = study_config.models[name]
  cfg = config_dict.ConfigDict(copy.deepcopy(base.to_dict()))
  cfg.data = study_data(study_config, workdir)
  source = init_source(study_config, name)
  if source:
    cfg.train.init_from = str(run_dir(workdir, source))
  if name == "d2f":
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
  so is the spelling of `train.init_from`: the student always starts from this workdir's MDM;
  and so are SOURCE_KEYS: synthetic and TFDS sources give the same records, see
  `check_records`).
  """
  saved = ckpt_lib.read_config(run_dir(workdir, name))
  if saved is None:
    return [f"{run_dir(workdir, name)} has no {ckpt_lib.CONFIG_FILE}"]
  ignored = ("train.init_from",) + SOURCE_KEYS
  diffs = [d for d in config_lib.config_differences(saved, cfg)
           if d.split(":")[0] not in ignored]
  started = lambda path: Path(path).name if path else None  # noqa: E731  (a study model)
  old = started(json.loads(saved).get("train", {}).get("init_from"))
  if old != started(cfg.train.init_from):
    diffs.append(f"train.init_from: the cached model started from {old or 'scratch'}, this "
                 f"config starts it from {started(cfg.train.init_from) or 'scratch'}")
  return diffs


def ensure_models(study_config, workdir, *, log: Callable[[str], None] = print) -> dict:
  """Trains missing models (resuming partial runs) and loads all of them.

  A cached model is used only if it was trained with this study's config, and it is loaded
  at exactly the configured step; otherwise a CheckpointError says what differs and how to
  retrain. Returns {name: TrainedModel(params, model_cfg, config)}.
  """
  check_records(study_data(study_config, workdir))
  models = {}
  for name in training_order(study_config):
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
      started = time.perf_counter()
      final = trainer.train(cfg, path)
      record = {"seconds": time.perf_counter() - started, "steps": steps,
                "first_step": int(final.pop("start_step", 0)),
                "final": {k: float(v) for k, v in final.items()}}
      (path / TRAIN_RECORD).write_text(json.dumps(record, indent=1))
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
