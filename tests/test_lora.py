"""LoRA adapters: init, merge, split / merge_trees, trainable masks, save / load."""

import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dllm_jax.models import abstract_params, forward, get_preset, lora

CFG = get_preset("tiny")
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
# One compiled forward per config, shared by the tests.
bidirectional = fast_jit(functools.partial(forward, attention="bidirectional"), static_argnums=1)
TOKENS = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 10)).astype(np.int32)


def random_params(cfg, seed=0, scale=0.1):
  """Random weights of the right shapes without compiling an init (norm scales 1)."""
  rs = np.random.RandomState(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.ones(x.shape, x.dtype) if "norm" in jax.tree_util.keystr(path)
      else jnp.asarray(rs.randn(*x.shape) * scale, x.dtype), nn.unbox(abstract_params(cfg)))


@pytest.fixture(scope="module")
def base():
  return random_params(CFG)


@pytest.fixture(scope="module")
def adapted(base):
  """(cfg, params) with trained-looking (nonzero) adapters on q and v only."""
  cfg, params = lora.add_lora(base, CFG, jax.random.key(1), rank=4, alpha=8.0,
                              targets=("q", "v"), dropout=0.1)
  rs = np.random.RandomState(1)
  frozen, adapters = lora.split_lora(params, targets=("q", "v"))
  adapters = jax.tree.map(lambda x: x + jnp.asarray(rs.randn(*x.shape) * 0.1, x.dtype), adapters)
  return cfg, lora.merge_trees(frozen, adapters)


def test_add_lora_init(base):
  cfg, params = lora.add_lora(base, CFG, jax.random.key(0), rank=4, alpha=8.0,
                              targets=("q", "k", "o"))
  assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_scale) == (4, 8.0, 2.0)
  attn = params["layers"]["attn"]
  for name, (d_in, d_out) in {"q": (32, 32), "k": (32, 16), "v": (32, 16), "o": (32, 32)}.items():
    a, b = np.asarray(attn[name]["lora_a"]), np.asarray(attn[name]["lora_b"])
    assert a.shape == (CFG.n_layers, d_in, 4) and b.shape == (CFG.n_layers, 4, d_out)
    assert not b.any()  # B = 0
    if name == "v":  # untargeted: a = b = 0, a fixed point of training
      assert not a.any()
    else:  # PEFT kaiming-uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
      assert np.abs(a).max() <= 1 / np.sqrt(d_in) and np.abs(a).max() > 0.8 / np.sqrt(d_in)
      assert not np.allclose(a[0], a[1])  # layers differ
  np.testing.assert_array_equal(np.asarray(attn["q"]["kernel"]),
                                np.asarray(base["layers"]["attn"]["q"]["kernel"]))
  # lora_b = 0: the adapted model is the base model at init.
  np.testing.assert_array_equal(np.asarray(bidirectional(params, cfg, TOKENS)),
                                np.asarray(bidirectional(base, CFG, TOKENS)))


def test_merge_lora_gives_same_logits(base, adapted):
  cfg, params = adapted
  adapted_logits = np.asarray(bidirectional(params, cfg, TOKENS))
  assert np.abs(adapted_logits - np.asarray(bidirectional(base, CFG, TOKENS))).max() > 1e-3
  merged_cfg, merged = lora.merge_lora(params, cfg)
  assert merged_cfg.lora_rank == 0 and not lora.has_lora(merged)
  assert merged_cfg == CFG.replace(lora_rank=0)
  np.testing.assert_allclose(np.asarray(bidirectional(merged, merged_cfg, TOKENS)),
                             adapted_logits, atol=1e-5)
  # The merged kernel is W + (alpha / r) a @ b, in NumPy.
  attn = params["layers"]["attn"]["q"]
  want = (np.asarray(attn["kernel"], np.float64) + 2.0 * np.einsum(
      "lir,lro->lio", np.asarray(attn["lora_a"], np.float64), np.asarray(attn["lora_b"])))
  np.testing.assert_allclose(np.asarray(merged["layers"]["attn"]["q"]["kernel"]), want,
                             rtol=1e-5, atol=1e-7)


def test_split_merge_and_trainable_masks(adapted):
  cfg, params = adapted
  frozen, adapters = lora.split_lora(params, targets=("q", "v"))
  assert set(adapters["layers"]["attn"]) == {"q", "v"}
  assert set(frozen["layers"]["attn"]["k"]) == {"kernel", "lora_a", "lora_b"}
  assert jax.tree.structure(lora.merge_trees(frozen, adapters)) == jax.tree.structure(params)
  with pytest.raises(ValueError, match="same leaves"):
    lora.merge_trees(params, adapters)
  assert lora.num_lora_params(adapters) == CFG.n_layers * 4 * (32 + 32 + 32 + 16)
  assert not lora.has_lora(lora.strip_lora(params))

  mask = lora.trainable_mask(params, targets=("q", "v"))
  flat = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
  assert sorted(k for k, m in flat.items() if m) == sorted(
      f"['layers']['attn']['{t}']['{leaf}']" for t in "qv" for leaf in ("lora_a", "lora_b"))
  labels = lora.param_labels(params, targets=("q", "v"))
  assert set(jax.tree.leaves(labels)) == {"lora", "frozen"}

  # One optax step through multi_transform moves only the targeted adapters.
  opt = optax.multi_transform({"lora": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = opt.update(grads, opt.init(params), params)
  moved = optax.apply_updates(params, updates)
  for (path, old), new, m in zip(jax.tree_util.tree_leaves_with_path(params),
                                 jax.tree.leaves(moved), jax.tree.leaves(mask)):
    assert np.array_equal(np.asarray(old), np.asarray(new)) != m, jax.tree_util.keystr(path)


def test_save_load_round_trip(tmp_path, base, adapted):
  cfg, params = adapted
  _, adapters = lora.split_lora(params, targets=("q", "v"))
  info = lora.save_lora(str(tmp_path), params, cfg)  # a full tree: only adapters are written
  assert info == lora.LoraInfo(4, 8.0, 0.1, ("q", "k", "v", "o"))
  info = lora.save_lora(str(tmp_path), adapters, cfg)
  assert info.targets == ("q", "v")
  assert sorted(os.listdir(tmp_path)) == sorted([lora.CONFIG_FILE, lora.WEIGHTS_FILE])
  meta = json.loads((tmp_path / lora.CONFIG_FILE).read_text())
  assert meta == {"format": lora.FORMAT, "rank": 4, "alpha": 8.0, "dropout": 0.1,
                  "targets": ["q", "v"]}
  loaded, loaded_info = lora.load_lora(str(tmp_path))
  assert loaded_info == info
  for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(adapters)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # Attaching the loaded adapters to the base model reproduces the adapted model.
  new_cfg, attached = lora.attach_lora(base, CFG, loaded, loaded_info)
  assert new_cfg == cfg
  np.testing.assert_array_equal(np.asarray(bidirectional(attached, new_cfg, TOKENS)),
                                np.asarray(bidirectional(params, cfg, TOKENS)))


def test_bfloat16_adapters_round_trip(tmp_path, base):
  cfg16 = CFG.replace(param_dtype="bfloat16")
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
  cfg, params = lora.add_lora(params16, cfg16, jax.random.key(3), rank=4, alpha=2.0)
  _, adapters = lora.split_lora(params)
  lora.save_lora(str(tmp_path), adapters, cfg)
  loaded, _ = lora.load_lora(str(tmp_path))
  for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(adapters)):
    assert x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_errors(tmp_path, base, adapted):
  cfg, params = adapted
  with pytest.raises(ValueError, match="already carry"):
    lora.add_lora(params, cfg, jax.random.key(0), rank=4, alpha=2.0)
  with pytest.raises(ValueError, match="subset"):
    lora.add_lora(base, CFG, jax.random.key(0), rank=2, alpha=2.0, targets=("gate",))
  with pytest.raises(ValueError, match="rank"):
    lora.add_lora(base, CFG, jax.random.key(0), rank=0, alpha=2.0)
  with pytest.raises(ValueError, match="lora_rank > 0"):
    lora.merge_lora(base, CFG)
  with pytest.raises(ValueError, match="split off"):
    lora.merge_lora(lora.split_lora(params)[0], cfg)
  with pytest.raises(ValueError, match="save_lora"):
    lora.load_lora(str(tmp_path / "missing"))
  with pytest.raises(ValueError, match="no lora_a"):
    lora.save_lora(str(tmp_path), base, cfg)
  wrong_cfg = CFG.replace(lora_rank=0)
  _, adapters = lora.split_lora(params, targets=("q", "v"))
  bad = jax.tree.map(lambda x: x[:, :-1], adapters)
  with pytest.raises(ValueError, match="shape"):
    lora.attach_lora(base, wrong_cfg, bad, lora.LoraInfo(4, 8.0, 0.0, ("q", "v")))
