"""Checkpoint / resume / failure handling of `trainer.train`, against an uninterrupted run.

One uninterrupted 6-step run (checkpoints at 2, 4, 6) is the reference. A run killed at step
5 (after the step-4 checkpoint) and restarted must log exactly the same losses and end with
exactly the same params. A damaged newest step is skipped for the newest intact one (and
kept, byte for byte); missing or foreign checkpoints and refused resumes raise a clear error and
leave every checkpoint file and config.json as they were.
"""

import glob
import hashlib
import json
import logging
import os
import shutil

import chex
import jax
import numpy as np
import pytest
from flax import traverse_util

from dllm_jax.checkpoints import testing as ckpt_testing
from dllm_jax.models.finite import NonFiniteParamsError
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
  final = trainer.train(config, workdir, step_callback=lambda s, m: seen.append(s))
  assert seen == [5, 6]  # continued from the step-4 checkpoint
  assert (final["start_step"], final["step"]) == (4, 6)
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


def _damage(step_dir, damage):
  """Deletes or garbles the params manifest, or truncates the largest params array file."""
  if damage == "truncate":
    files = glob.glob(os.path.join(step_dir, "params", "ocdbt.process_0", "d", "*"))
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
      f.truncate(os.path.getsize(target) // 2)
    return
  target = os.path.join(step_dir, "params", "manifest.ocdbt")
  if damage == "delete":
    os.remove(target)
  else:
    with open(target, "r+b") as f:
      f.write(b"\xff" * 64)


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("damage", ["delete", "garble", "truncate"])
def test_damaged_newest_checkpoint_is_skipped_by_load_params(reference, tmp_path, caplog,
                                                             damage):
  ref_dir, _ = reference
  workdir = str(tmp_path / "run")
  shutil.copytree(ref_dir, workdir)
  _damage(os.path.join(workdir, "checkpoints", "6"), damage)
  before = _tree_hash(workdir)

  with caplog.at_level(logging.WARNING):
    params = ckpt_lib.load_params(workdir).params
  chex.assert_trees_all_equal(params, ckpt_lib.load_params(ref_dir, step=4).params)
  warnings = _warnings(caplog)
  assert len(warnings) == 1 and "\n" not in warnings[0], warnings
  assert "damaged checkpoint" in warnings[0] and f"{workdir}/checkpoints/6 (" in warnings[0]
  assert "loaded step 4" in warnings[0] and "tensorstore_spec" not in warnings[0]

  with pytest.raises(ckpt_lib.DamagedCheckpointError,
                     match=r"checkpoints/6 is (damaged|incomplete).*asked for explicitly") as e:
    ckpt_lib.load_params(workdir, step=6)
  assert "\n" not in str(e.value) and len(str(e.value)) < 600, str(e.value)
  assert e.value.__cause__ is None  # orbax's traceback is not chained under it
  assert _tree_hash(workdir) == before  # nothing moved, nothing rewritten


# The leftovers of orbax's failed restore (training.quiet) must not reach pytest's own
# unraisable hook either, which would report them as a warning of this test.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_damaged_newest_checkpoint_is_set_aside_and_training_resumes(reference, tmp_path,
                                                                     caplog):
  """A truncated array file in step 6: the run resumes from step 4 (same losses as the
  reference), moves step 6 byte for byte to damaged_checkpoints/6, and saves 6 and 8 anew."""
  ref_dir, config = reference
  workdir = str(tmp_path / "run")
  shutil.copytree(ref_dir, workdir)
  _damage(os.path.join(workdir, "checkpoints", "6"), "truncate")
  damaged = _tree_hash(os.path.join(workdir, "checkpoints", "6"))
  config_bytes = open(os.path.join(workdir, ckpt_lib.CONFIG_FILE), "rb").read()

  longer = config.copy_and_resolve_references()
  longer.train.steps = 8
  seen = []
  with caplog.at_level(logging.WARNING):
    trainer.train(longer, workdir, step_callback=lambda s, m: seen.append(s))
  assert seen == [5, 6, 7, 8]
  warnings = [w for w in _warnings(caplog) if "damaged" in w]
  assert len(warnings) == 1 and "\n" not in warnings[0], warnings
  assert f"{workdir}/checkpoints/6 (" in warnings[0] and "resuming from step 4" in warnings[0]
  assert f"{workdir}/damaged_checkpoints/6" in warnings[0]
  assert _tree_hash(os.path.join(workdir, "damaged_checkpoints", "6")) == damaged
  assert ckpt_lib.steps_in(workdir) == [4, 6, 8]
  ref_losses, losses = _losses(ref_dir), _losses(workdir)
  assert [losses[s] for s in (5, 6)] == [ref_losses[s] for s in (5, 6)]  # same data and noise
  # config.json now describes the newest checkpoints (train.steps=8); the rest is unchanged.
  saved = json.loads(open(os.path.join(workdir, ckpt_lib.CONFIG_FILE)).read())
  assert saved["train"]["steps"] == 8 and config_bytes != open(
      os.path.join(workdir, ckpt_lib.CONFIG_FILE), "rb").read()
  assert config_lib.config_differences(config_bytes.decode(), longer) == []


def test_every_checkpoint_damaged_is_an_error_that_changes_nothing(reference, tmp_path):
  ref_dir, config = reference
  workdir = str(tmp_path / "run")
  shutil.copytree(ref_dir, workdir)
  for step in (2, 4, 6):
    _damage(os.path.join(workdir, "checkpoints", str(step)), "garble")
  before = _tree_hash(workdir)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"every checkpoint in .* is damaged"):
    ckpt_lib.load_params(workdir)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"every checkpoint in .* is damaged"):
    trainer.train(config, workdir)
  assert _tree_hash(workdir) == before


def _checkpoints_and_config(workdir):
  digest = _tree_hash(os.path.join(workdir, "checkpoints"))
  with open(os.path.join(workdir, ckpt_lib.CONFIG_FILE), "rb") as f:
    digest[ckpt_lib.CONFIG_FILE] = hashlib.sha256(f.read()).hexdigest()
  return digest


def test_refused_or_failed_resume_leaves_config_and_checkpoints(reference, tmp_path):
  """allow_config_change with a new model shape is refused before anything is read; a new
  lr=1e30 restores, then diverges at once: either way config.json stays byte-identical, the
  checkpoints too, and the original command then resumes."""
  ref_dir, config = reference
  workdir = str(tmp_path / "run")
  shutil.copytree(ref_dir, workdir)
  before = _checkpoints_and_config(workdir)

  wider = config.copy_and_resolve_references()
  wider.model.d_model, wider.train.allow_config_change = 64, True
  with pytest.raises(ckpt_lib.CheckpointError,
                     match=r"changes the shapes of the saved state \(params/embed/embedding: "
                           r"\(64, 32\) -> \(64, 64\).*through model\.d_model: None -> 64"):
    trainer.train(wider, workdir)
  assert _checkpoints_and_config(workdir) == before

  hot = config.copy_and_resolve_references()
  hot.opt.lr, hot.train.steps, hot.train.allow_config_change = 1e30, 8, True
  with pytest.raises(trainer.NonFiniteError, match="diverged at step 7"):
    trainer.train(hot, workdir)
  assert _checkpoints_and_config(workdir) == before

  chex.assert_trees_all_equal(ckpt_lib.load_params(workdir).params,
                              ckpt_lib.load_params(ref_dir).params)
  final = trainer.train(config, workdir)  # the original command: resumes the finished run
  assert final["step"] == final["start_step"] == 6
  assert _checkpoints_and_config(workdir) == before


def test_load_params_names_other_kinds_of_directory(tmp_path):
  """A HF model directory, a converted checkpoint, and neither: named errors, nothing written."""
  hf_dir = tmp_path / "hf"
  w = ckpt_testing.random_weights(vocab=32, d=16, layers=1, heads=2, kv_heads=2, mlp=32)
  ckpt_testing.write_tensors(hf_dir, ckpt_testing.qwen_tensors(w),
                             ckpt_testing.qwen_config(w, heads=2, kv_heads=2))
  converted = tmp_path / "converted"
  converted.mkdir()
  (converted / "model_config.json").write_text("{}")
  (converted / "params").mkdir()
  neither = tmp_path / "neither"
  neither.mkdir()
  (neither / "notes.txt").write_text("hello")
  before = _tree_hash(tmp_path)
  with pytest.raises(ckpt_lib.CheckpointError,
                     match=r"Hugging Face model directory.*checkpoints\.load_pretrained"):
    ckpt_lib.load_params(hf_dir)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"converted checkpoint.*load_converted"):
    ckpt_lib.load_params(converted)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"is not a training workdir"):
    ckpt_lib.load_params(neither)
  assert _tree_hash(tmp_path) == before


def test_load_params_names_a_nan_weight(reference, tmp_path):
  ref_dir, config = reference
  workdir = str(tmp_path / "nan")
  os.makedirs(workdir)
  shutil.copy(os.path.join(ref_dir, ckpt_lib.CONFIG_FILE), workdir)
  source = ckpt_lib.Checkpointer(ref_dir, read_only=True)
  try:
    state, data_state = source.restore(6, _abstract(config))
  finally:
    source.close()
  params = jax.tree.map(lambda x: x, state.params)
  params["final_norm"]["scale"] = params["final_norm"]["scale"].at[1].set(np.inf)
  target = ckpt_lib.Checkpointer(workdir, async_save=False)
  target.save(state.replace(params=params), data_state)
  target.close()
  before = _tree_hash(workdir)
  with pytest.raises(NonFiniteParamsError,
                     match=r"checkpoints/6: non-finite weights .* final_norm/scale \(1 of 32"):
    ckpt_lib.load_params(workdir)
  assert _tree_hash(workdir) == before


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
