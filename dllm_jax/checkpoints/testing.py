"""Tiny checkpoints in published layouts and a float64 NumPy reference forward.

For tests, and for checking a conversion by hand. Everything here restates the published
layouts on its own (names are spelled out, not taken from families.py), so a test that loads
these files through `load_pretrained` checks the name maps rather than repeating them.

Neutral weights (`Weights`): HF orientation ([out, in] linears), one dict per layer with keys
attn_norm, q, k, v, o, (q_bias, k_bias, v_bias), mlp_norm, gate, up, down; plus embed [V, D],
final_norm [D] and head [V, D] (None when tied).
Shapes: B batch, T tokens, D d_model, H/K heads, Dh head dim, F mlp width, V vocab, r rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dllm_jax.checkpoints.safetensors_io import TensorSpec, write_checkpoint

Weights = dict


def random_weights(*, vocab: int, d: int, layers: int, heads: int, kv_heads: int, mlp: int,
                   qkv_bias: bool = False, tied: bool = False, seed: int = 0) -> Weights:
  """Random neutral weights at a scale that keeps activations O(1) (float32)."""
  rng = np.random.default_rng(seed)
  dh = d // heads
  normal = lambda *shape, fan_in: (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
  norm = lambda: (1.0 + 0.2 * rng.standard_normal(d)).astype(np.float32)
  out = {"embed": rng.standard_normal((vocab, d)).astype(np.float32), "final_norm": norm(),
         "head": None if tied else normal(vocab, d, fan_in=d), "layers": []}
  for _ in range(layers):
    layer = {"attn_norm": norm(), "mlp_norm": norm(),
             "q": normal(heads * dh, d, fan_in=d), "k": normal(kv_heads * dh, d, fan_in=d),
             "v": normal(kv_heads * dh, d, fan_in=d), "o": normal(d, heads * dh, fan_in=d),
             "gate": normal(mlp, d, fan_in=d), "up": normal(mlp, d, fan_in=d),
             "down": normal(d, mlp, fan_in=mlp)}
    if qkv_bias:
      for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        layer[f"{p}_bias"] = (0.1 * rng.standard_normal(n * dh)).astype(np.float32)
    out["layers"].append(layer)
  return out


_LLADA_LAYER = {"attn_norm": "attn_norm.weight", "q": "q_proj.weight", "k": "k_proj.weight",
                "v": "v_proj.weight", "o": "attn_out.weight", "mlp_norm": "ff_norm.weight",
                "gate": "ff_proj.weight", "up": "up_proj.weight", "down": "ff_out.weight",
                "q_bias": "q_proj.bias", "k_bias": "k_proj.bias", "v_bias": "v_proj.bias"}


def llada_tensors(w: Weights) -> dict[str, np.ndarray]:
  """Neutral weights under LLaDA's published tensor names."""
  out = {"model.transformer.wte.weight": w["embed"],
         "model.transformer.ln_f.weight": w["final_norm"]}
  if w["head"] is not None:
    out["model.transformer.ff_out.weight"] = w["head"]
  for i, layer in enumerate(w["layers"]):
    for key, value in layer.items():
      out[f"model.transformer.blocks.{i}.{_LLADA_LAYER[key]}"] = value
  return out


def llada_config(w: Weights, *, heads: int, kv_heads: int, mask_token_id: int,
                 eos_token_id: int, rope_theta: float = 500000.0, eps: float = 1e-5,
                 vocab_size: int | None = None, **extra) -> dict:
  """A config.json with LLaDA's key names (`embedding_size` = the embedding rows)."""
  rows, d = w["embed"].shape
  layer = w["layers"][0]
  config = {
      "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": d,
      "n_heads": heads, "n_kv_heads": kv_heads, "n_layers": len(w["layers"]),
      "mlp_hidden_size": layer["gate"].shape[0], "mlp_ratio": 4,
      "vocab_size": vocab_size or rows, "embedding_size": rows, "max_sequence_length": 64,
      "rope_theta": rope_theta, "rms_norm_eps": eps, "mask_token_id": mask_token_id,
      "eos_token_id": eos_token_id, "pad_token_id": eos_token_id,
      "weight_tying": w["head"] is None, "include_bias": False,
      "include_qkv_bias": "q_bias" in layer, "block_type": "llama", "layer_norm_type": "rms",
      "activation_type": "silu", "rope": True, "alibi": False, "attention_layer_norm": False,
      "scale_logits": False, "input_emb_norm": False, "block_group_size": 1,
      "use_cache": False}
  config.update(extra)
  return config


_QWEN_LAYER = {"attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
               "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
               "o": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
               "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
               "down": "mlp.down_proj.weight", "q_bias": "self_attn.q_proj.bias",
               "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias"}


def qwen_tensors(w: Weights) -> dict[str, np.ndarray]:
  """Neutral weights under the LLaMA / Qwen2 / Dream tensor names."""
  out = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["final_norm"]}
  if w["head"] is not None:
    out["lm_head.weight"] = w["head"]
  for i, layer in enumerate(w["layers"]):
    for key, value in layer.items():
      out[f"model.layers.{i}.{_QWEN_LAYER[key]}"] = value
  return out


def qwen_config(w: Weights, *, heads: int, kv_heads: int, model_type: str = "qwen2",
                rope_theta: float = 10000.0, eps: float = 1e-6, **extra) -> dict:
  """A transformers-style config.json (model_type llama / qwen2 / Dream)."""
  vocab, d = w["embed"].shape
  arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "Dream": "DreamModel"}
  config = {
      "architectures": [arch[model_type]], "model_type": model_type, "vocab_size": vocab,
      "hidden_size": d, "intermediate_size": w["layers"][0]["gate"].shape[0],
      "num_hidden_layers": len(w["layers"]), "num_attention_heads": heads,
      "num_key_value_heads": kv_heads, "max_position_embeddings": 64, "rms_norm_eps": eps,
      "rope_theta": rope_theta, "hidden_act": "silu", "tie_word_embeddings": w["head"] is None}
  config.update(extra)
  return config


def write_tensors(directory, tensors: dict[str, np.ndarray], config: dict | None = None,
                  max_shard_bytes: int = 1 << 40) -> Path:
  """Writes `tensors` as model.safetensors (or shards + index) and config.json."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  specs = [TensorSpec(n, a.dtype, a.shape) for n, a in tensors.items()]
  write_checkpoint(directory, specs, tensors.__getitem__, max_shard_bytes)
  if config is not None:
    (directory / "config.json").write_text(json.dumps(config, indent=2))
  return directory


def write_peft_adapter(directory, factors: dict[str, tuple[np.ndarray, np.ndarray]], *,
                       r: int, alpha: float, target_modules, dropout: float = 0.0,
                       **extra) -> Path:
  """A PEFT adapter dir: {module name: (A [r, in], B [out, r])} under PEFT's names."""
  directory = Path(directory)
  tensors = {}
  for module, (a, b) in factors.items():
    tensors[f"base_model.model.{module}.lora_A.weight"] = a
    tensors[f"base_model.model.{module}.lora_B.weight"] = b
  directory.mkdir(parents=True, exist_ok=True)
  specs = [TensorSpec(n, a.dtype, a.shape) for n, a in tensors.items()]
  write_checkpoint(directory, specs, tensors.__getitem__, 1 << 40, stem="adapter_model")
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
            "lora_dropout": dropout, "target_modules": target_modules, "bias": "none",
            "fan_in_fan_out": False, **extra}
  (directory / "adapter_config.json").write_text(json.dumps(config))
  return directory


def _rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, theta):
  """x [B, T, N, Dh]; half-split rotation (rotate_half), as LLaMA / Qwen2 / LLaDA."""
  dh = x.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh)
  angles = positions[..., None].astype(np.float64) * inv_freq
  angles = np.concatenate([angles, angles], axis=-1)[:, :, None, :]
  x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
  return x * np.cos(angles) + np.concatenate([-x2, x1], axis=-1) * np.sin(angles)


def reference_logits(w: Weights, tokens, *, heads: int, kv_heads: int, rope_theta: float,
                     eps: float, causal: bool, valid=None, positions=None,
                     shift: bool = False) -> np.ndarray:
  """Float64 forward of the pre-norm RMSNorm / RoPE / GQA / SwiGLU transformer -> [B, T, V].

  `valid` [B, T] hides padding keys; `positions` default to 0..T-1. `shift` reads the
  prediction for position i from output i - 1 (Dream).
  """
  f64 = lambda a: np.asarray(a, np.float64)
  tokens = np.asarray(tokens)
  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t) if positions is None else positions, (b, t))
  visible = np.ones((b, t, t), bool)
  if causal:
    visible &= np.tril(np.ones((t, t), bool))
  if valid is not None:
    visible &= np.asarray(valid, bool)[:, None, :]
  x = f64(w["embed"])[tokens]
  for layer in w["layers"]:
    lw = {k: f64(v) for k, v in layer.items()}
    h = _rms(x, lw["attn_norm"], eps)
    proj = lambda p: h @ lw[p].T + lw.get(f"{p}_bias", 0.0)
    dh = lw["q"].shape[0] // heads
    q = _rope(proj("q").reshape(b, t, heads, dh), positions, rope_theta)
    k = _rope(proj("k").reshape(b, t, kv_heads, dh), positions, rope_theta)
    v = proj("v").reshape(b, t, kv_heads, dh)
    k, v = (np.repeat(a, heads // kv_heads, axis=2) for a in (k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
    scores = np.where(visible[:, None], scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(-1, keepdims=True)
    attn = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, heads * dh)
    x = x + attn @ lw["o"].T
    h = _rms(x, lw["mlp_norm"], eps)
    gate = h @ lw["gate"].T
    x = x + ((gate / (1.0 + np.exp(-gate))) * (h @ lw["up"].T)) @ lw["down"].T
  x = _rms(x, f64(w["final_norm"]), eps)
  head = f64(w["embed"] if w["head"] is None else w["head"])
  logits = x @ head.T
  if shift:
    logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
  return logits
