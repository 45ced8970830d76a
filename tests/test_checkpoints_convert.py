"""Orbax conversions and safetensors export: exact round trips, atomic writes."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest

from dllm_jax.checkpoints import (convert, export_safetensors, load_converted, load_pretrained,
                                  save_converted)
from dllm_jax.checkpoints import safetensors_io
from dllm_jax.checkpoints import testing as ckt
from dllm_jax.checkpoints.safetensors_io import TensorStore

HEADS, KV_HEADS = 4, 2


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _write(path, family, seed=0):
  qkv_bias = family in ("qwen2", "Dream")
  w = ckt.random_weights(vocab=64, d=32, layers=2, heads=HEADS, kv_heads=KV_HEADS, mlp=64,
                         qkv_bias=qkv_bias, tied=family == "llama", seed=seed)
  if family == "llada":
    tensors = ckt.llada_tensors(w)
    config = ckt.llada_config(w, heads=HEADS, kv_heads=KV_HEADS, mask_token_id=63,
                              eos_token_id=62)
  else:
    tensors = ckt.qwen_tensors(w)
    config = ckt.qwen_config(w, heads=HEADS, kv_heads=KV_HEADS, model_type=family,
                             eos_token_id=62, bos_token_id=61, pad_token_id=62,
                             mask_token_id=63 if family == "Dream" else None)
  ckt.write_tensors(path, tensors, config)
  return w, tensors


def test_orbax_round_trip_and_atomicity(tmp_path, monkeypatch):
  _write(tmp_path / "hf", "llada")
  cfg, params = load_pretrained(tmp_path / "hf", dtype="float32")
  target = tmp_path / "converted"
  save_converted(target, cfg, params)
  cfg2, params2 = load_converted(target)
  assert cfg2 == cfg
  _assert_trees_equal(params2, params)

  with pytest.raises(FileExistsError, match="overwrite=True"):
    save_converted(target, cfg, params)
  with pytest.raises(ValueError, match="do not match cfg"):
    save_converted(tmp_path / "other", cfg.replace(n_layers=3), params)

  def fail(_):
    raise RuntimeError("disk full")
  monkeypatch.setattr(convert, "config_to_json", fail)
  for path, overwrite in ((tmp_path / "new", False), (target, True)):
    with pytest.raises(RuntimeError, match="disk full"):
      save_converted(path, cfg, params, overwrite=overwrite)
  assert not (tmp_path / "new").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["converted", "hf"]  # no partial dirs
  monkeypatch.undo()
  _assert_trees_equal(load_converted(target)[1], params)  # the good one survived


@pytest.mark.parametrize("family", ["llada", "Dream"])
def test_export_round_trip(tmp_path, family):
  _, tensors = _write(tmp_path / "hf", family)
  cfg, params = load_pretrained(tmp_path / "hf", dtype="float32")
  name = "dream" if family == "Dream" else family
  out = export_safetensors(params, cfg, tmp_path / "out", family=name, max_shard_bytes=30_000)
  store = TensorStore.from_directory(out)
  assert (out / "model.safetensors.index.json").is_file()
  assert sorted(store.names()) == sorted(tensors)
  for key, value in tensors.items():
    np.testing.assert_array_equal(store.read(key), value)
  cfg2, params2 = load_pretrained(out, dtype="float32")
  assert cfg2.replace(name=cfg.name) == cfg
  _assert_trees_equal(params2, params)
  with pytest.raises(ValueError, match="shift|biases"):
    export_safetensors(params, cfg, tmp_path / "x", family="llada" if name == "dream" else "dream")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_export_loads_in_transformers(tmp_path, family):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  w, _ = _write(tmp_path / "hf", family, seed=5)
  cfg, params = load_pretrained(tmp_path / "hf", dtype="float32")
  out = export_safetensors(params, cfg, tmp_path / "out", family=family)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  tokens = np.random.default_rng(0).integers(0, 64, (2, 9))
  with torch.no_grad():
    hf = model.eval()(torch.tensor(tokens)).logits.numpy()
  ref = ckt.reference_logits(w, tokens, heads=HEADS, kv_heads=KV_HEADS,
                             rope_theta=10000.0, eps=1e-6, causal=True)
  np.testing.assert_allclose(hf, ref, atol=1e-4, rtol=0)
  assert model.config.eos_token_id == 62 and model.config.tie_word_embeddings == (family == "llama")
  # bfloat16 export, read back by the safetensors library itself.
  from safetensors import safe_open
  out16 = export_safetensors(params, cfg, tmp_path / "bf16", family=family, dtype="bfloat16")
  name = "model.layers.1.mlp.down_proj.weight"
  with safe_open(str(out16 / "model.safetensors"), framework="pt") as f:
    stored = f.get_tensor(name)
  assert stored.dtype == torch.bfloat16
  np.testing.assert_array_equal(stored.float().numpy(),
                                torch.tensor(w["layers"][1]["down"]).bfloat16().float().numpy())


def test_export_merges_lora_and_is_atomic(tmp_path, monkeypatch):
  _write(tmp_path / "hf", "llada")
  rng = np.random.default_rng(0)
  factors = {f"model.transformer.blocks.{i}.q_proj": (rng.standard_normal((2, 32), np.float32),
                                                     rng.standard_normal((32, 2), np.float32))
             for i in range(2)}
  ckt.write_peft_adapter(tmp_path / "lora", factors, r=2, alpha=4.0, target_modules=["q_proj"])
  cfg, params = load_pretrained(tmp_path / "hf", dtype="float32", adapter_dir=tmp_path / "lora")
  with pytest.raises(ValueError, match="merge_lora=True"):
    export_safetensors(params, cfg, tmp_path / "out", family="llada")
  out = export_safetensors(params, cfg, tmp_path / "out", family="llada", merge_lora=True)
  _, merged = load_pretrained(tmp_path / "hf", dtype="float32", adapter_dir=tmp_path / "lora",
                              merge_lora=True)
  _, exported = load_pretrained(out, dtype="float32")
  for x, y in zip(jax.tree.leaves(exported), jax.tree.leaves(merged)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=0)

  real_write = safetensors_io.write_file
  calls = []

  def flaky(path, *args, **kw):
    calls.append(path)
    if len(calls) == 2:
      raise OSError("disk full")
    return real_write(path, *args, **kw)
  monkeypatch.setattr(safetensors_io, "write_file", flaky)
  with pytest.raises(OSError, match="disk full"):
    export_safetensors(merged, cfg.replace(lora_rank=0), tmp_path / "broken", family="llada",
                       max_shard_bytes=30_000)
  assert len(calls) == 2 and not (tmp_path / "broken").exists()
  assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
  assert json.loads((out / "config.json").read_text())["model_type"] == "llada"
