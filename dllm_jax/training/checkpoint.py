"""Checkpoints of a training run (orbax), resumption, and loading trained params for decoding.

A workdir holds `config.json` (the run's config) and `checkpoints/<step>/`, each step a
composite of four items saved together:

  params     StandardSave   the model params (restorable alone, for decoding)
  opt_state  StandardSave   optimizer state of the trainable subtree
  progress   StandardSave   {"step": [] int32, "rng": [2] uint32}
  data       JsonSave       {"process_states": [iterator state of process 0, 1, ...]}

Saving is asynchronous where orbax supports it (`wait()` before reading the files); the last
`keep` steps are kept. `config.json` is the config that wrote the newest checkpoint: the
trainer replaces it (atomically) only when its first checkpoint is saved, so a resume that
fails or is refused leaves the workdir as it found it.

A step whose files fail to restore raises `DamagedCheckpointError`, one line naming the step
directory (orbax's tensorstore details go to `-v 1` logging; its after-failure noise is
filtered, see `quiet.py`). Nothing here deletes or overwrites a damaged step: `load_params`
falls back to the newest intact step with a warning; the trainer does the same and moves the
damaged directory to `workdir/damaged_checkpoints/<step>` before it saves that step again.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from dllm_jax.checkpoints import convert
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.finite import check_finite
from dllm_jax.models.transformer import abstract_params
from dllm_jax.parallel import mesh as mesh_lib
from dllm_jax.training import config as config_lib
from dllm_jax.training import quiet
from dllm_jax.training.state import TrainState

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "damaged_checkpoints"
_HF_CONFIG_KEYS = ("model_type", "architectures", "hidden_size", "vocab_size")
ITEMS = ("params", "opt_state", "progress", "data")


class CheckpointError(RuntimeError):
  """A checkpoint directory is missing, incomplete, corrupted, or belongs to another run."""


class DamagedCheckpointError(CheckpointError):
  """One step's files are missing or unreadable (an earlier step may still be intact)."""

  def __init__(self, message: str, step: int, reason: str):
    super().__init__(message)
    self.step, self.reason = step, reason


def short_reason(error: BaseException) -> str:
  """One line of an orbax / tensorstore error: its status, minus the JSON specs it carries."""
  text = str(error).split(" [tensorstore_spec")[0].split(" See full TensorStore")[0]
  text = text.strip().splitlines()[0] if text.strip() else ""
  files = re.findall(r'local file "([^"]+)"', text)
  if files:  # tensorstore names the unreadable file: that is the useful part
    status = text.split(":", 1)[0] if re.match(r"^[A-Z_]+:", text) else type(error).__name__
    text = f"{status} reading {files[-1]}"
  elif len(text) > 160:
    text = text[:157] + "..."
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def checkpoint_dir(workdir: str | os.PathLike) -> epath.Path:
  # orbax refuses relative paths; accept them from users and CLIs.
  return epath.Path(os.path.abspath(workdir)) / CHECKPOINT_DIR


def _gather_data_states(local_state: Mapping[str, int]) -> list[dict[str, int]]:
  """Every process's iterator state (all processes call this together)."""
  if jax.process_count() == 1:
    return [dict(local_state)]
  keys = sorted(local_state)
  values = np.asarray([int(local_state[k]) for k in keys], np.int64)
  gathered = np.asarray(multihost_utils.process_allgather(values))
  return [dict(zip(keys, map(int, row))) for row in gathered]


class Checkpointer:
  """An orbax `CheckpointManager` over `workdir/checkpoints` with this run's four items."""

  def __init__(self, workdir: str | os.PathLike, *, keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    self.directory = checkpoint_dir(workdir)
    if read_only and not self.directory.exists():
      raise CheckpointError(f"no checkpoint directory at {self.directory}: was the run "
                            "saved there? Pass the workdir that `train` was given.")
    with quiet.read_only_notes():
      options = ocp.CheckpointManagerOptions(
          max_to_keep=keep, create=not read_only, read_only=read_only,
          enable_async_checkpointing=async_save)
      self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def save(self, state: TrainState, data_state: Mapping[str, int]) -> int:
    """Saves `state` at its own step (async); returns the step."""
    step = int(jax.device_get(state.step))
    data = {"process_states": _gather_data_states(data_state)}
    self.manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        opt_state=ocp.args.StandardSave(state.opt_state),
        progress=ocp.args.StandardSave({"step": state.step, "rng": state.rng}),
        data=ocp.args.JsonSave(data)))
    return step

  def restore(self, step: int, abstract: TrainState) -> tuple[TrainState, dict[str, int]]:
    """State (into the shardings of `abstract`) and this process's iterator state."""
    args = ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract.params),
        opt_state=ocp.args.StandardRestore(abstract.opt_state),
        progress=ocp.args.StandardRestore({"step": abstract.step, "rng": abstract.rng}),
        data=ocp.args.JsonRestore())
    restored = self._restore(step, args)
    progress = restored["progress"]
    if int(jax.device_get(progress["step"])) != step:
      raise DamagedCheckpointError(
          f"checkpoint {self.step_dir(step)} records step {int(progress['step'])}, not "
          f"{step}: the directory was renamed or mixed with another run's.", step,
          f"records step {int(progress['step'])}")
    states = (restored["data"] or {}).get("process_states")
    if not isinstance(states, list) or len(states) != jax.process_count():
      raise CheckpointError(
          f"checkpoint {self.step_dir(step)} holds data positions for "
          f"{len(states) if isinstance(states, list) else 'no'} processes, but this run has "
          f"{jax.process_count()}; resume with the same number of processes.")
    state = TrainState(step=progress["step"], params=restored["params"],
                       opt_state=restored["opt_state"], rng=progress["rng"])
    return state, states[jax.process_index()]

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    return self._restore(step, ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params)))["params"]

  def _restore(self, step: int, args: ocp.args.Composite):
    path = self.step_dir(step)
    if step not in self.steps():
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory} "
                            f"(steps present: {self.steps()}).")
    missing = [name for name in args.keys() if not (path / name).exists()]
    if missing:
      raise DamagedCheckpointError(
          f"checkpoint {path} is incomplete: item(s) {missing} are missing "
          f"(steps present: {self.steps()}).", step, f"missing {missing}")
    try:
      return self.manager.restore(step, args=args)
    except Exception as e:  # orbax / tensorstore raise many types for damaged files
      quiet.install()
      reason = short_reason(e)
      logging.vlog(1, "restoring %s failed: %r", path, e)
      raise DamagedCheckpointError(
          f"checkpoint {path} is damaged ({reason}); nothing was changed on disk "
          f"(steps present: {self.steps()}).", step, reason) from None

  def set_aside(self, step: int) -> epath.Path:
    """Moves a damaged step to `workdir/damaged_checkpoints/<step>[.n]` (never deletes it),
    so the step can be saved again; returns where it went."""
    root = self.directory.parent / DAMAGED_DIR
    target, n = root / str(step), 1
    while target.exists():
      target, n = root / f"{step}.{n}", n + 1
    if jax.process_index() == 0:
      root.mkdir(parents=True, exist_ok=True)
      self.step_dir(step).rename(target)
    multihost_utils.sync_global_devices(f"dllm_jax_set_aside_{step}")
    self.manager.reload()
    return target

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def write_config(workdir: str | os.PathLike, config_json: str) -> None:
  if jax.process_index() == 0:
    path = epath.Path(workdir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / (CONFIG_FILE + ".tmp")
    tmp.write_text(config_json)
    tmp.replace(path)


def read_config(workdir: str | os.PathLike) -> str | None:
  path = epath.Path(workdir) / CONFIG_FILE
  return path.read_text() if path.exists() else None


def resolve_run(path: str | os.PathLike, step: int | None = None) -> tuple[epath.Path, int | None]:
  """Accepts a workdir, its `checkpoints/` dir or one `checkpoints/<step>` dir."""
  path = epath.Path(os.path.abspath(path))
  if not path.exists():
    raise CheckpointError(f"checkpoint path {path} does not exist.")
  if path.name.isdigit() and path.parent.name == CHECKPOINT_DIR:
    return path.parent.parent, int(path.name) if step is None else step
  if path.name == CHECKPOINT_DIR:
    return path.parent, step
  return path, step


class TrainedModel(NamedTuple):
  """What `load_params` returns: params, their `ModelConfig` and the run's full config."""
  params: Any
  model_cfg: ModelConfig
  config: ml_collections.ConfigDict


def check_is_run(workdir: epath.Path) -> None:
  """Raises a named CheckpointError when `workdir` is not a training workdir: a HF model
  directory, a converted checkpoint, or neither."""
  if (workdir / CHECKPOINT_DIR).exists():
    return
  config_path = workdir / CONFIG_FILE
  saved = None
  if config_path.exists():
    try:
      saved = json.loads(config_path.read_text())
    except ValueError:
      saved = None
  hf_keys = isinstance(saved, dict) and any(k in saved for k in _HF_CONFIG_KEYS)
  if hf_keys or any(workdir.glob("*.safetensors")):
    raise CheckpointError(
        f"{workdir} is a Hugging Face model directory (config.json + *.safetensors), not a "
        "training workdir; load it with dllm_jax.checkpoints.load_pretrained(path).")
  if (workdir / convert.CONFIG_FILE).exists():
    raise CheckpointError(
        f"{workdir} is a converted checkpoint ({convert.CONFIG_FILE} + params/), not a "
        "training workdir; load it with dllm_jax.checkpoints.load_converted(path).")
  if isinstance(saved, dict) and "model" in saved and "train" in saved:
    raise CheckpointError(f"{workdir} holds the config.json of a training run but no "
                          f"{CHECKPOINT_DIR}/: the run saved no checkpoint yet.")
  raise CheckpointError(
      f"{workdir} is not a training workdir (config.json + {CHECKPOINT_DIR}/), a Hugging Face "
      "model directory (load_pretrained) nor a converted checkpoint (load_converted); pass "
      "the workdir that `train` was given.")


def load_params(path: str | os.PathLike, step: int | None = None, *, mesh: Mesh | None = None,
                rules=None, shardings: Any = None) -> TrainedModel:
  """Trained params of a run, for decoding or as an init.

    params, cfg, config = load_params("/tmp/dllm_jax_runs/mdm_tiny")
    out = dllm_jax.decoding.api.generate(params, cfg, prompts, method="llada", ...)

  `path` is a workdir given to `train` (or its checkpoints dir, or one step dir); the newest
  intact step is read unless `step` is given: a damaged newer step is skipped with a
  warning naming it (an explicitly asked-for damaged step is an error). The model shape
  comes from the run's `config.json`. Placement: `shardings` (a tree), else `mesh` (+
  logical `rules`, default the run's), else the first device. Only the params item is read,
  never the optimizer state. A NaN/inf weight raises `NonFiniteParamsError` naming it.
  A HF model directory or a converted checkpoint is refused with the loader to use.
  """
  workdir, step = resolve_run(path, step)
  check_is_run(workdir)
  saved = read_config(workdir)
  if saved is None:
    raise CheckpointError(f"{workdir} has no {CONFIG_FILE}; pass the workdir a training run "
                          "wrote (it holds config.json and checkpoints/).")
  config = ml_collections.ConfigDict(json.loads(saved))
  model_cfg = config_lib.model_config(config)
  boxed = abstract_params(model_cfg)
  if shardings is None and mesh is not None:
    rules = mesh_lib.rules_from_config(config.mesh.rules if rules is None else rules)
    shardings = mesh_lib.param_shardings(boxed, mesh, rules)
  abstract = nn.unbox(boxed)
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract)
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          abstract, shardings)
  ckpt = Checkpointer(workdir, read_only=True, async_save=False)
  try:
    if step is not None:
      try:
        params = ckpt.restore_params(step, abstract)
      except DamagedCheckpointError as e:
        raise DamagedCheckpointError(
            f"{e} Step {step} was asked for explicitly; load another step (or omit `step` "
            "for the newest intact one).", e.step, e.reason) from None
    else:
      step, params, damaged = newest_intact(ckpt, lambda s: ckpt.restore_params(s, abstract))
      if damaged:
        logging.warning("%s", damaged_warning(ckpt, damaged, f"loaded step {step}"))
  finally:
    ckpt.close()
  check_finite(params, str(ckpt.step_dir(step)))
  return TrainedModel(params, model_cfg, config)


def newest_intact(ckpt: Checkpointer, restore) -> tuple[int, Any, list[DamagedCheckpointError]]:
  """(step, restore(step), errors of the newer damaged steps) for the newest step that
  restores; other errors propagate, and a workdir with no intact step is an error."""
  steps = ckpt.steps()
  if not steps:
    raise CheckpointError(f"{ckpt.directory} holds no finished checkpoint.")
  damaged = []
  for step in reversed(steps):
    try:
      value = restore(step)
    except DamagedCheckpointError as e:
      damaged.append(e)
      continue
    return step, value, damaged
  raise CheckpointError(
      f"every checkpoint in {ckpt.directory} is damaged (steps {steps}; newest: "
      f"{damaged[0].reason}); nothing was changed on disk.")


def damaged_warning(ckpt: Checkpointer, damaged: Sequence[DamagedCheckpointError],
                    action: str) -> str:
  """One line: which steps are damaged, why, and what was done instead."""
  named = "; ".join(f"{ckpt.step_dir(e.step)} ({e.reason})" for e in damaged)
  return f"skipping damaged checkpoint {named}: {action}, the newest intact one."


def steps_in(workdir: str | os.PathLike) -> Sequence[int]:
  """Finished checkpoint steps of a workdir (empty when none)."""
  directory = checkpoint_dir(workdir)
  if not directory.exists():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
