"""PEFT LoRA adapters: applied == merged == hand-merged reference; errors; export round trip."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.checkpoints import export_lora_adapter, load_pretrained
from dllm_jax.checkpoints import testing as ckt
from dllm_jax.checkpoints.safetensors_io import TensorStore
from dllm_jax.models import Transformer

HEADS, KV_HEADS, D, MLP, LAYERS, VOCAB, R, ALPHA = 4, 2, 32, 64, 2, 64, 4, 8.0
LLADA_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "attn_out"}


@functools.partial(jax.jit, static_argnums=1)
def _bidirectional(params, cfg, tokens):
  return Transformer(cfg).apply({"params": params}, tokens, block_ids=jnp.zeros_like(tokens))


def _factors(rng, p):
  """PEFT factors A [r, in], B [out, r] of projection p (every input is D wide here)."""
  d_out = {"q": D, "k": D // HEADS * KV_HEADS, "v": D // HEADS * KV_HEADS, "o": D}[p]
  a = (rng.standard_normal((R, D)) / np.sqrt(D)).astype(np.float32)
  b = (0.5 * rng.standard_normal((d_out, R))).astype(np.float32)
  return a, b


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
  """A LLaDA base, a D2F-style adapter on q/k/v/attn_out, and hand-merged weights."""
  root = tmp_path_factory.mktemp("lora")
  w = ckt.random_weights(vocab=VOCAB, d=D, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS,
                         mlp=MLP, seed=7)
  ckt.write_tensors(root / "base", ckt.llada_tensors(w), ckt.llada_config(
      w, heads=HEADS, kv_heads=KV_HEADS, mask_token_id=63, eos_token_id=62))
  rng = np.random.default_rng(0)
  factors, merged = {}, [dict(layer) for layer in w["layers"]]
  for i in range(LAYERS):
    for p, module in LLADA_MODULES.items():
      a, b = _factors(rng, p)
      factors[f"model.transformer.blocks.{i}.{module}"] = (a, b)
      merged[i][p] = w["layers"][i][p] + (ALPHA / R) * (b @ a)  # W + (alpha / r) B A
  ckt.write_peft_adapter(root / "adapter", factors, r=R, alpha=ALPHA,
                         target_modules=list(LLADA_MODULES.values()), dropout=0.1)
  return root, w, dict(w, layers=merged), factors


def test_applied_equals_merged_equals_reference(llada):
  root, _, merged_w, factors = llada
  cfg_a, params_a = load_pretrained(root / "base", dtype="float32", adapter_dir=root / "adapter")
  cfg_m, params_m = load_pretrained(root / "base", dtype="float32", adapter_dir=root / "adapter",
                                    merge_lora=True)
  assert (cfg_a.lora_rank, cfg_a.lora_scale, cfg_a.lora_dropout) == (R, ALPHA / R, 0.1)
  assert cfg_m.lora_rank == 0 and "lora_a" not in params_m["layers"]["attn"]["q"]
  a, b = factors["model.transformer.blocks.1.attn_out"]
  np.testing.assert_array_equal(np.asarray(params_a["layers"]["attn"]["o"]["lora_a"][1]), a.T)
  np.testing.assert_array_equal(np.asarray(params_a["layers"]["attn"]["o"]["lora_b"][1]), b.T)

  tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 10)))
  applied = np.asarray(_bidirectional(params_a, cfg_a, tokens))
  merged = np.asarray(_bidirectional(params_m, cfg_m, tokens))
  ref = ckt.reference_logits(merged_w, np.asarray(tokens), heads=HEADS, kv_heads=KV_HEADS,
                             rope_theta=500000.0, eps=1e-5, causal=False)
  base = ckt.reference_logits(llada[1], np.asarray(tokens), heads=HEADS, kv_heads=KV_HEADS,
                              rope_theta=500000.0, eps=1e-5, causal=False)
  assert np.abs(ref - base).max() > 1e-1  # the adapter matters
  np.testing.assert_allclose(applied, merged, atol=1e-4, rtol=0)
  np.testing.assert_allclose(merged, ref, atol=1e-4, rtol=0)


def test_export_round_trip(llada, tmp_path):
  root, _, _, _ = llada
  cfg, params = load_pretrained(root / "base", dtype="float32", adapter_dir=root / "adapter")
  out = export_lora_adapter(params, cfg, tmp_path / "exported", family="llada")
  original, exported = (TensorStore.from_file(d / "adapter_model.safetensors")
                        for d in (root / "adapter", out))
  assert sorted(original.names()) == sorted(exported.names())
  for name in original.names():
    np.testing.assert_array_equal(original.read(name), exported.read(name))
  config = json.loads((out / "adapter_config.json").read_text())
  assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (R, ALPHA, 0.1)
  assert sorted(config["target_modules"]) == sorted(LLADA_MODULES.values())
  with pytest.raises(FileExistsError, match="overwrite=True"):
    export_lora_adapter(params, cfg, out, family="llada")


@pytest.fixture(scope="module")
def qwen_base(tmp_path_factory):
  root = tmp_path_factory.mktemp("qwen_lora")
  w = ckt.random_weights(vocab=VOCAB, d=D, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS,
                         mlp=MLP, qkv_bias=True, seed=9)
  ckt.write_tensors(root / "base", ckt.qwen_tensors(w), ckt.qwen_config(
      w, heads=HEADS, kv_heads=KV_HEADS, model_type="Dream", mask_token_id=63))
  return root, w


def test_partial_targets_rslora_and_mlp_merge(qwen_base, tmp_path):
  root, w = qwen_base
  rng = np.random.default_rng(2)
  factors = {}
  for i in range(LAYERS):
    factors[f"model.layers.{i}.self_attn.q_proj"] = _factors(rng, "q")
    factors[f"model.layers.{i}.self_attn.v_proj"] = _factors(rng, "v")
  ckt.write_peft_adapter(tmp_path / "qv", factors, r=R, alpha=ALPHA, use_rslora=True,
                         target_modules=["q_proj", "v_proj"])
  cfg, params = load_pretrained(root / "base", dtype="float32", adapter_dir=tmp_path / "qv")
  assert cfg.lora_scale == pytest.approx(ALPHA / np.sqrt(R))
  attn = params["layers"]["attn"]
  for p in ("k", "o"):  # not targeted: exact no-op adapters
    assert not np.any(np.asarray(attn[p]["lora_a"])) and not np.any(np.asarray(attn[p]["lora_b"]))
  a, _ = factors["model.layers.1.self_attn.v_proj"]
  np.testing.assert_array_equal(np.asarray(attn["v"]["lora_a"][1]), a.T)
  out = export_lora_adapter(params, cfg, tmp_path / "out", family="dream")
  assert sorted(json.loads((out / "adapter_config.json").read_text())["target_modules"]) == [
      "q_proj", "v_proj"]

  # MLP targets can only be merged; merging matches W + s * B @ A by hand.
  a = (rng.standard_normal((R, D)) / np.sqrt(D)).astype(np.float32)
  b = rng.standard_normal((MLP, R)).astype(np.float32)
  ckt.write_peft_adapter(tmp_path / "mlp", {"model.layers.0.mlp.gate_proj": (a, b)}, r=R,
                         alpha=ALPHA, target_modules=["gate_proj"], layers_to_transform=[0])
  with pytest.raises(ValueError, match="merge_lora=True"):
    load_pretrained(root / "base", dtype="float32", adapter_dir=tmp_path / "mlp")
  _, merged = load_pretrained(root / "base", dtype="float32", adapter_dir=tmp_path / "mlp",
                              merge_lora=True)
  gate = np.asarray(merged["layers"]["mlp"]["gate"]["kernel"])
  np.testing.assert_allclose(gate[0], (w["layers"][0]["gate"] + ALPHA / R * b @ a).T, atol=1e-6)
  np.testing.assert_array_equal(gate[1], w["layers"][1]["gate"].T)


@pytest.mark.parametrize("change, message", [
    (dict(target_modules=["q_proj", "c_attn"]), "unknown LoRA target module 'c_attn'"),
    (dict(target_modules=["attn_out"]), "unknown LoRA target module 'attn_out'"),
    (dict(use_dora=True), "use_dora"),
    (dict(r=8), "lacks|shape"),
])
def test_adapter_errors(qwen_base, tmp_path, change, message):
  root, _ = qwen_base
  rng = np.random.default_rng(3)
  factors = {f"model.layers.{i}.self_attn.q_proj": _factors(rng, "q") for i in range(LAYERS)}
  kw = dict(r=R, alpha=ALPHA, target_modules=["q_proj"])
  kw.update(change)
  ckt.write_peft_adapter(tmp_path / "bad", factors, **kw)
  with pytest.raises(ValueError, match=message):
    load_pretrained(root / "base", dtype="float32", adapter_dir=tmp_path / "bad")
