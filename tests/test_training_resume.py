"""Checkpoint / resume / failure handling of `trainer.train`, against an uninterrupted run.

One uninterrupted 6-step run (checkpoints at 2, 4, 6) is the reference. A run killed at step
5 (after the step-4 checkpoint) and restarted must log exactly the same losses and end with
exactly the same params. Damaged, missing or foreign checkpoints must raise a clear error and
leave every file of the last good checkpoint as it was.
"""

import hashlib
import os
import shutil

import jax
import numpy as np
import pytest
from flax import traverse_util

from dllm_jax.training import checkpoint as ckpt_lib
from dllm_jax.training import config as config_lib
from dllm_jax.training import experiment
from dllm_jax.training import metrics as metrics_lib
from dllm_jax.training import trainer

pytestmark = pytest.mark.usefixtures("compile_cache")


class Killed(Exception):
  pass


def _kill_at(step):
  def callback(s, metrics):
    if s == step:
      raise Killed(f"killed at step {s}")
  return callback


def _losses(workdir):
  return {r["step"]: r["loss"] for r in metrics_lib.read_metrics(workdir, "train")}


def _tree_hash(path):
  digest = {}
  for root, _, files in os.walk(path):
    for name in sorted(files):
      full = os.path.join(root, name)
      with open(full, "rb") as f:
        digest[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
  return digest


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_config):
  """An uninterrupted run: (workdir, config)."""
  config = tiny_config("mdm", sft=True)
  workdir = str(tmp_path_factory.mktemp("reference"))
  trainer.train(config, workdir)
  return workdir, config


def test_resume_matches_uninterrupted_run(reference, tmp_path):
  ref_dir, config = reference
  workdir = str(tmp_path / "run")
  with pytest.raises(Killed):
    trainer.train(config, workdir, step_callback=_kill_at(5))
  assert ckpt_lib.steps_in(workdir) == [2, 4]
  assert max(_losses(workdir)) == 5  # step 5 ran and was logged, but never saved

  seen = []
  trainer.train(config, workdir, step_callback=lambda s, m: seen.append(s))
  assert seen == [5, 6]  # continued from the step-4 checkpoint
  assert _losses(workdir) == _losses(ref_dir)  # same data, same noise: bit-identical losses
  assert len(metrics_lib.read_metrics(workdir, "train")) == 6  # the log was cut back to 4

  ref_params = ckpt_lib.load_params(ref_dir).params
  params, model_cfg, run_config = ckpt_lib.load_params(workdir)
  assert model_cfg == config_lib.model_config(config) and run_config.train.steps == 6
  for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  ckpt = ckpt_lib.Checkpointer(workdir, read_only=True)
  try:
    state, data_state = ckpt.restore(4, _abstract(config))
  finally:
    ckpt.close()
  assert int(state.step) == 4
  assert data_state["position"] == 4 * config.train.batch_size  # rows consumed by 4 steps


def _abstract(config):
  return experiment.build(config).abstract


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["delete", "garble"])
def test_corrupted_latest_checkpoint_is_named_and_left_alone(reference, tmp_path, damage):
  ref_dir, config = reference
  workdir = str(tmp_path / "run")
  shutil.copytree(ref_dir, workdir)
  step_dir = os.path.join(workdir, "checkpoints", "6")
  target = os.path.join(step_dir, "params", "manifest.ocdbt")
  if damage == "delete":
    os.remove(target)
  else:
    with open(target, "r+b") as f:
      f.write(b"\xff" * 64)
  before = _tree_hash(os.path.join(workdir, "checkpoints"))

  longer = config.copy_and_resolve_references()
  longer.train.steps = 8
  with pytest.raises(ckpt_lib.CheckpointError, match=r"checkpoints/6 failed to restore"):
    trainer.train(longer, workdir)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"checkpoints/6"):
    ckpt_lib.load_params(workdir)
  assert _tree_hash(os.path.join(workdir, "checkpoints")) == before
  params = ckpt_lib.load_params(workdir, step=4).params  # the earlier checkpoint still loads
  assert jax.tree.leaves(params)


def test_missing_or_foreign_checkpoints_are_refused(reference, tmp_path):
  ref_dir, config = reference
  # Checkpoints deleted from a workdir that logged past a checkpoint step.
  workdir = str(tmp_path / "gone")
  shutil.copytree(ref_dir, workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  with pytest.raises(ckpt_lib.CheckpointError, match="missing or deleted"):
    trainer.train(config, workdir)

  # A different config pointed at an existing run.
  workdir = str(tmp_path / "foreign")
  shutil.copytree(ref_dir, workdir)
  before = _tree_hash(workdir)
  other = config.copy_and_resolve_references()
  other.opt.lr = 2e-2
  with pytest.raises(ckpt_lib.CheckpointError, match=r"opt\.lr: 0\.01 -> 0\.02"):
    trainer.train(other, workdir)
  assert _tree_hash(workdir) == before

  # Paths that do not exist.
  with pytest.raises(ckpt_lib.CheckpointError, match="does not exist"):
    ckpt_lib.load_params(str(tmp_path / "nowhere"))
  with pytest.raises(ckpt_lib.CheckpointError, match="no checkpoint directory"):
    ckpt_lib.Checkpointer(str(tmp_path / "empty"), read_only=True)


def test_non_finite_loss_stops_without_saving(reference, tmp_path):
  """A NaN injected into the step-2 params makes step 3 diverge: the run stops naming step 3
  and writes nothing (the same config, so the compiled step is reused)."""
  ref_dir, config = reference
  workdir = str(tmp_path / "nan")
  os.makedirs(workdir)
  shutil.copy(os.path.join(ref_dir, ckpt_lib.CONFIG_FILE), workdir)
  source = ckpt_lib.Checkpointer(ref_dir, read_only=True)
  try:
    state, data_state = source.restore(2, _abstract(config))
  finally:
    source.close()
  params = jax.tree.map(lambda x: x, state.params)
  params["final_norm"]["scale"] = params["final_norm"]["scale"].at[0].set(np.nan)
  target = ckpt_lib.Checkpointer(workdir, async_save=False)
  target.save(state.replace(params=params), data_state)
  target.close()
  before = _tree_hash(os.path.join(workdir, "checkpoints"))

  with pytest.raises(trainer.NonFiniteError,
                     match=r"diverged at step 3: loss=nan.*last checkpoint is step 2"):
    trainer.train(config, workdir)
  assert ckpt_lib.steps_in(workdir) == [2]
  assert _tree_hash(os.path.join(workdir, "checkpoints")) == before


@pytest.mark.slow
def test_d2f_student_starts_from_the_run_and_trains_only_lora(reference, tiny_config, tmp_path):
  """train.init_from overlays the MDM run's params; only the LoRA adapters move."""
  ref_dir, ref_config = reference
  config = tiny_config("d2f", init_from=ref_dir, block_size=4)
  config.train.steps, config.train.ckpt_every = 3, 0
  # The student's 4-token blocks give 8 answer slots; the teacher saw 5: flagged.
  assert "never saw this canvas" in experiment.canvas_mismatch(experiment.build(config), ref_dir)
  assert experiment.canvas_mismatch(experiment.build(ref_config), ref_dir) is None
  final = trainer.train(config, str(tmp_path))
  assert np.isfinite(final["train/loss"]) and np.isfinite(final["eval/loss"])
  teacher = ckpt_lib.load_params(ref_dir).params
  student = ckpt_lib.load_params(str(tmp_path)).params
  flat_teacher = traverse_util.flatten_dict(teacher)
  for path, value in traverse_util.flatten_dict(student).items():
    if path[-1] in ("lora_a", "lora_b"):
      continue
    np.testing.assert_array_equal(np.asarray(value), np.asarray(flat_teacher[path]))
  assert np.any(np.asarray(student["layers"]["attn"]["q"]["lora_b"]) != 0)
