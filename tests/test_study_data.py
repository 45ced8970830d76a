"""The study's data through the TFDS path (built once, the generator's records exactly), the
cached-model check across sources, and the AR-initialised MDM."""

import importlib.util
import os

import jax
import numpy as np
import pytest
from flax import traverse_util
from ml_collections import config_dict

from dllm_jax.training import checkpoint as ckpt_lib
from dllm_jax.training import config as config_lib
from dllm_jax.training import data as data_lib
from dllm_jax.training import experiment, state as state_lib, trainer
from studylib import models as models_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def study_config(**top):
  spec = importlib.util.spec_from_file_location("study_cfg", os.path.join(ROOT, "configs",
                                                                          "study.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = config_dict.ConfigDict(module.get_config().to_dict())
  for name in models_lib.ORDER:
    m = c.models[name]
    m.train.steps, m.train.batch_size, m.train.log_every = 2, 8, 1
    m.opt.warmup_steps = 1
    m.model.d_model, m.model.n_layers, m.model.mlp_dim = 32, 1, 64
    m.model.n_heads = m.model.n_kv_heads = 2
  c.data.train_size, c.data.eval_size = 64, 16
  for k, v in top.items():
    c[k] = v
  return c


def test_every_study_mode_reads_tfds_under_its_workdir(tmp_path):
  spec = importlib.util.spec_from_file_location("study_cfg", os.path.join(ROOT, "configs",
                                                                          "study.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for mode in module.MODES:
    c = module.get_config(mode)
    # The trade-off mode is the short mode's models plus its own: it adapts alike.
    from_ar = mode in module.FROM_AR or (mode == "tradeoff" and "short" in module.FROM_AR)
    assert c.data.source == "tfds" and c.mdm_from_ar is from_ar, mode
    for name in models_lib.training_order(c):
      cfg = models_lib.training_config(c, name, tmp_path)
      assert cfg.data.data_dir == str(tmp_path / "data"), (mode, name)


def _files(data_dir):
  return {p: p.stat().st_mtime_ns for p in data_dir.rglob("*") if p.is_file()}


def test_tfds_records_equal_the_synthetic_ones_and_are_built_once(tmp_path):
  data = models_lib.study_data(study_config(), tmp_path)
  assert data.source == "tfds" and data.data_dir == str(tmp_path / "data")
  train, test = data_lib.make_sources(data)
  files = _files(tmp_path / "data")
  assert any(p.name.startswith("synthetic_reasoning-train.array_record") for p in files)
  synthetic = config_dict.ConfigDict(data.to_dict())
  synthetic.source = "synthetic"
  want_train, want_test = data_lib.make_sources(synthetic)
  assert type(train).__name__ == "TextSource"  # read through tfds.data_source
  assert list(train) == list(want_train) and list(test) == list(want_test)
  assert len(train) == 64 and len(test) == 16
  # A second build (and the study's record check) reuses the files: nothing is rewritten.
  data_lib.make_sources(data)
  models_lib.check_records(data)
  assert _files(tmp_path / "data") == files


def test_check_records_refuses_files_that_differ_from_the_generator(tmp_path, monkeypatch):
  data = models_lib.study_data(study_config(), tmp_path)
  train, test = data_lib.make_sources(data)
  stale = [dict(r, answer=r["answer"] + "0") if i == 5 else r for i, r in enumerate(test)]
  monkeypatch.setattr(data_lib, "make_sources", lambda cfg: (train, stale))
  with pytest.raises(ValueError, match=r"TFDS test split .* record 5 differs.*delete"):
    models_lib.check_records(data)
  monkeypatch.setattr(data_lib, "make_sources", lambda cfg: (list(train)[:10], test))
  with pytest.raises(ValueError, match="10 records, not 64"):
    models_lib.check_records(data)


def _save_run_config(workdir, name, cfg):
  path = models_lib.run_dir(workdir, name)
  path.mkdir(parents=True)
  (path / ckpt_lib.CONFIG_FILE).write_text(config_lib.to_json(cfg))


def test_cache_check_accepts_either_source_but_not_other_records_or_init(tmp_path):
  """A model trained on the synthetic source is the same model under the TFDS source (same
  records); other data, or an MDM started from scratch where AR init is asked, is refused."""
  c = study_config()
  tfds_cfg = models_lib.training_config(c, "ar", tmp_path)
  synthetic_cfg = models_lib.training_config(c, "ar", tmp_path)
  with synthetic_cfg.unlocked():
    synthetic_cfg.data.source, synthetic_cfg.data.data_dir = "synthetic", None
  _save_run_config(tmp_path, "ar", synthetic_cfg)
  assert models_lib.cache_mismatch(tmp_path, "ar", tfds_cfg) == []
  other = models_lib.training_config(c, "ar", tmp_path)
  with other.unlocked():
    other.data.seed = 1
  assert models_lib.cache_mismatch(tmp_path, "ar", other) == ["data.seed: 0 -> 1"]

  scratch = models_lib.training_config(study_config(mdm_from_ar=False), "mdm", tmp_path)
  _save_run_config(tmp_path, "mdm", scratch)
  from_ar = models_lib.training_config(study_config(mdm_from_ar=True), "mdm", tmp_path)
  assert from_ar.train.init_from == str(tmp_path / "models" / "ar")
  assert models_lib.cache_mismatch(tmp_path, "mdm", from_ar) == [
      "train.init_from: the cached model started from scratch, this config starts it from ar"]
  elsewhere = models_lib.training_config(study_config(mdm_from_ar=True), "mdm", "other/dir")
  _save_run_config(tmp_path / "b", "mdm", elsewhere)  # the same start, spelt elsewhere
  assert models_lib.cache_mismatch(tmp_path / "b", "mdm", from_ar) == []


def test_ar_initialised_mdm_starts_at_the_trained_ar_params(tmp_path):
  c = study_config(mdm_from_ar=True)
  ar_cfg = models_lib.training_config(c, "ar", tmp_path)
  trainer.train(ar_cfg, models_lib.run_dir(tmp_path, "ar"))
  ar = ckpt_lib.load_params(models_lib.run_dir(tmp_path, "ar"))
  mdm_cfg = models_lib.training_config(c, "mdm", tmp_path)
  assert mdm_cfg.objective.name == "mdm" and mdm_cfg.train.init_from
  exp = experiment.build(mdm_cfg, devices=jax.devices()[:1])
  assert exp.model_cfg.mask_token_id is not None
  assert exp.model_cfg.mask_token_id < ar.model_cfg.vocab_size  # AR's embedding has the row
  fresh, _ = state_lib.init_state(exp.model_cfg, exp.tx, jax.random.PRNGKey(0), exp.mesh,
                                  exp.rules, exp.config.opt.trainable, exp.shardings)
  got = traverse_util.flatten_dict(
      experiment.initial_params(exp, fresh.params, mdm_cfg.train.init_from))
  want = traverse_util.flatten_dict(ar.params)
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]),
                                  err_msg="/".join(key))
  # ... and not by accident: the MDM's own init differs.
  fresh_flat = traverse_util.flatten_dict(fresh.params)
  assert any(not np.array_equal(np.asarray(fresh_flat[k]), np.asarray(want[k])) for k in want)
