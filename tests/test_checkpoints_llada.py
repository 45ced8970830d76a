"""LLaDA checkpoints (published names and config keys) against a float64 NumPy forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.checkpoints import load_pretrained
from dllm_jax.checkpoints import testing as ckt
from dllm_jax.models import Transformer, masks

HEADS, KV_HEADS, THETA, EPS = 4, 2, 500000.0, 1e-5


@functools.partial(jax.jit, static_argnums=1)
def _apply(params, cfg, tokens, block_ids):
  return Transformer(cfg).apply({"params": params}, tokens, block_ids=block_ids)


def _logits(params, cfg, tokens, attention):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return np.asarray(_apply(params, cfg, jnp.asarray(tokens), masks.ids_for(attention, positions)))


def _reference(w, tokens, causal):
  return ckt.reference_logits(w, tokens, heads=HEADS, kv_heads=KV_HEADS, rope_theta=THETA,
                              eps=EPS, causal=causal)


@pytest.mark.parametrize("variant", ["padded_vocab", "tied_qkv_bias_sharded"])
def test_llada_matches_numpy_float64(tmp_path, variant):
  tied = variant != "padded_vocab"
  w = ckt.random_weights(vocab=96, d=32, layers=2, heads=HEADS, kv_heads=KV_HEADS, mlp=64,
                         qkv_bias=tied, tied=tied, seed=len(variant))
  # LLaDA pads the embedding past vocab_size: the weight's 96 rows decide the logits width.
  config = ckt.llada_config(w, heads=HEADS, kv_heads=KV_HEADS, mask_token_id=95, eos_token_id=94,
                            rope_theta=THETA, eps=EPS, vocab_size=90 if not tied else None)
  ckt.write_tensors(tmp_path, ckt.llada_tensors(w), config,
                    max_shard_bytes=20_000 if tied else 1 << 40)
  assert (tmp_path / "model.safetensors.index.json").is_file() == tied
  cfg, params = load_pretrained(tmp_path, dtype="float32")
  assert (cfg.vocab_size, cfg.n_kv_heads, cfg.mlp_dim) == (96, KV_HEADS, 64)
  assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (95, 94, 94)
  assert (cfg.tie_embeddings, cfg.qkv_bias, cfg.shift_logits) == (tied, tied, False)
  assert ("lm_head" in params) == (not tied)

  tokens = np.random.default_rng(0).integers(0, 96, (2, 12))
  for attention in ("bidirectional", "causal"):
    ours = _logits(params, cfg, tokens, attention)
    ref = _reference(w, tokens, causal=attention == "causal")
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_llada_gate_is_ff_proj(tmp_path):
  """Swapping ff_proj (gate) and up_proj changes the logits: the map cannot mix them up."""
  w = ckt.random_weights(vocab=64, d=32, layers=1, heads=HEADS, kv_heads=KV_HEADS, mlp=64, seed=3)
  config = ckt.llada_config(w, heads=HEADS, kv_heads=KV_HEADS, mask_token_id=63, eos_token_id=62,
                            rope_theta=THETA, eps=EPS)
  ckt.write_tensors(tmp_path, ckt.llada_tensors(w), config)
  cfg, params = load_pretrained(tmp_path, dtype="float32")
  np.testing.assert_array_equal(np.asarray(params["layers"]["mlp"]["gate"]["kernel"][0]),
                                w["layers"][0]["gate"].T)
  np.testing.assert_array_equal(np.asarray(params["layers"]["mlp"]["down"]["kernel"][0]),
                                w["layers"][0]["down"].T)
  swapped = dict(w["layers"][0], gate=w["layers"][0]["up"], up=w["layers"][0]["gate"])
  tokens = np.arange(10)[None]
  ref = _reference(w, tokens, causal=False)
  assert np.abs(_reference(dict(w, layers=[swapped]), tokens, causal=False) - ref).max() > 1e-2
