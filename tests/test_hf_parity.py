"""Logit parity with HF transformers (float32, eager attention) after load_pretrained.

Tiny random LlamaForCausalLM / Qwen2ForCausalLM (GQA, Qwen2 q/k/v biases) are saved with
save_pretrained (Qwen2 sharded), loaded into dllm_jax and compared on random token batches:
causal, bidirectional (HF given an all-visible 4D mask), left-padded batches (HF given
attention_mask + position_ids) and Dream (a Qwen2 checkpoint read bidirectionally, shifted).
"""

import functools
import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dllm_jax.checkpoints import load_pretrained
from dllm_jax.models import Transformer, masks

VOCAB, D, LAYERS, HEADS, KV_HEADS, MLP = 100, 32, 2, 4, 2, 64
TOL = 1e-4


@functools.partial(jax.jit, static_argnums=1)
def _apply(params, cfg, tokens, block_ids, positions, valid):
  return Transformer(cfg).apply({"params": params}, tokens, block_ids=block_ids,
                                positions=positions, valid=valid)


def forward(params, cfg, tokens, attention, valid=None):
  """One compiled program per cfg: the attention kind and padding are data."""
  valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid)
  positions = masks.left_pad_positions(valid)
  ids = masks.ids_for(attention, positions)
  return np.asarray(_apply(params, cfg, jnp.asarray(tokens), ids, positions, valid))


def _build(kind):
  torch.manual_seed(0 if kind == "llama" else 1)
  common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=MLP, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.1,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
  if kind == "llama":
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_theta=5000.0, **common))
  else:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(rope_theta=20000.0, **common))
  with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make them matter.
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.2 * torch.randn_like(p))
  model.config._attn_implementation = "eager"
  return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for kind in ("llama", "qwen2"):
    model = _build(kind)
    shard = {"max_shard_size": "20KB"} if kind == "qwen2" else {}
    model.save_pretrained(root / kind, **shard)
    cfg, params = load_pretrained(root / kind, dtype="float32")
    out[kind] = (model, cfg, params, root / kind)
  assert len(list((root / "qwen2").glob("model-*.safetensors"))) > 1  # really sharded
  return out


def _hf_logits(model, tokens, **kw):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens)), **kw).logits.numpy()


def _tokens(seed, shape=(3, 11)):
  return np.random.default_rng(seed).integers(0, VOCAB, shape)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_config_read_from_checkpoint(checkpoints, kind):
  _, cfg, params, _ = checkpoints[kind]
  assert (cfg.n_heads, cfg.n_kv_heads, cfg.qkv_bias) == (HEADS, KV_HEADS, kind == "qwen2")
  assert cfg.rope_theta == (5000.0 if kind == "llama" else 20000.0)
  assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
  assert params["layers"]["attn"]["q"]["kernel"].shape == (LAYERS, D, HEADS * D // HEADS)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_causal_logits_match_hf(checkpoints, kind):
  model, cfg, params, _ = checkpoints[kind]
  tokens = _tokens(0)
  ours = forward(params, cfg, tokens, "causal")
  np.testing.assert_allclose(ours, _hf_logits(model, tokens), atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bidirectional_logits_match_hf_full_mask(checkpoints, kind):
  model, cfg, params, _ = checkpoints[kind]
  tokens = _tokens(1)
  b, t = tokens.shape
  ref = _hf_logits(model, tokens, attention_mask=torch.zeros(b, 1, t, t))
  # The 4D mask is honoured by the eager path: the result is not the causal one.
  assert np.abs(ref - _hf_logits(model, tokens)).max() > 1e-2
  ours = forward(params, cfg, tokens, "bidirectional")
  np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_left_padded_batch_matches_hf(checkpoints, kind):
  model, cfg, params, _ = checkpoints[kind]
  tokens = _tokens(2)
  pads = np.array([0, 3, 6])
  valid = np.arange(tokens.shape[1])[None, :] >= pads[:, None]
  tokens = np.where(valid, tokens, 0)
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  ref = _hf_logits(model, tokens, attention_mask=torch.tensor(valid.astype(np.int64)),
                   position_ids=torch.tensor(positions))
  ours = forward(params, cfg, tokens, "causal", valid)
  np.testing.assert_allclose(ours[valid], ref[valid], atol=TOL, rtol=0)


def test_dream_matches_hf_qwen2_bidirectional_shifted(checkpoints, tmp_path):
  model, _, _, qwen_dir = checkpoints["qwen2"]
  dream_dir = tmp_path / "dream"
  shutil.copytree(qwen_dir, dream_dir)
  config = json.loads((dream_dir / "config.json").read_text())
  config.update(model_type="Dream", architectures=["DreamModel"], mask_token_id=VOCAB - 1)
  (dream_dir / "config.json").write_text(json.dumps(config))
  cfg, params = load_pretrained(dream_dir, dtype="float32")
  assert cfg.shift_logits and cfg.qkv_bias and cfg.mask_token_id == VOCAB - 1
  tokens = _tokens(3)
  b, t = tokens.shape
  hf = _hf_logits(model, tokens, attention_mask=torch.zeros(b, 1, t, t))
  ref = np.concatenate([hf[:, :1], hf[:, :-1]], axis=1)  # prediction for i read at i - 1
  ours = forward(params, cfg, tokens, "bidirectional")
  np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_bfloat16_checkpoint_loads_exactly(checkpoints, tmp_path):
  """A bf16 safetensors file (unreadable by safetensors' NumPy framework) loads bit-exactly."""
  model, _, _, _ = checkpoints["qwen2"]
  model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
  model.to(torch.float32)
  cfg, params = load_pretrained(tmp_path / "bf16")  # default dtype: bfloat16
  assert cfg.param_dtype == cfg.dtype == "bfloat16"
  for i in range(LAYERS):
    layer = model.model.layers[i]
    pairs = ((params["layers"]["mlp"]["gate"]["kernel"][i], layer.mlp.gate_proj.weight.T),
             (params["layers"]["attn"]["k"]["bias"][i], layer.self_attn.k_proj.bias))
    for ours, theirs in pairs:
      assert ours.dtype == jnp.bfloat16
      ref = theirs.detach().to(torch.bfloat16).float().numpy()
      np.testing.assert_array_equal(np.asarray(ours, np.float32), ref)
