"""Building blocks: RMSNorm, RoPE, LoRA-capable dense, grouped-query attention, SwiGLU.

Shape legend: B batch, T query tokens, S key slots (cache + chunk), D d_model, H query heads,
K kv heads, G = H // K query heads per kv head, Dh head dim, F mlp width, r LoRA rank.

Parameter names and logical axes (docs/design.md) mirror the HF layouts one to one so that
checkpoint conversion is a transpose, never a reshuffle:
  attn/{q,k,v,o}/kernel  [D, H*Dh] / [D, K*Dh] / [D, K*Dh] / [H*Dh, D]
  mlp/{gate,up,down}/kernel  [D, F] / [D, F] / [F, D]
  */lora_a [in, r], */lora_b [r, out]  (PEFT's lora_A.T and lora_B.T)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dllm_jax.models import masks
from dllm_jax.models.config import ModelConfig
from dllm_jax.parallel.mesh import with_unit_partitioning

Array = jnp.ndarray
_KERNEL_INIT = nn.initializers.normal(stddev=0.02)
_LORA_A_INIT = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


class RMSNorm(nn.Module):
  """x / rms(x) * scale, computed in float32."""
  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * scale.astype(jnp.float32)).astype(self.dtype)


def rope(x: Array, positions: Array, theta: float) -> Array:
  """Rotary embedding, half-split convention of LLaMA/Qwen2/LLaDA.

  x: [B, T, N, Dh]; positions: [B, T] int. Computed in float32.
  """
  dh = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def _matmul(x: Array, w: Array) -> Array:
  """x[..., I] @ w[I, O] as one 2-D dot over the flattened leading axes.

  The same products as `jnp.dot(x, w)` on a 3-D x, but XLA:CPU then lays the backward pass
  out without writing the `[tokens, out]` gradient transposed through a strided loop: the
  study's train steps are 22-38% cheaper on a CPU (BENCHMARKS.md section 3). The summation
  order differs from the 3-D dot's, so results move in the last bits.
  """
  return jnp.dot(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[-1])


class Dense(nn.Module):
  """y = x @ kernel (+ bias) (+ (alpha / r) * dropout(x) @ lora_a @ lora_b).

  `units` pairs a logical axis with the width of one indivisible unit along it (attention's
  flat H*Dh dims: (("heads", Dh),)); the mesh then splits those dims only between units.
  """
  features: int
  axes: tuple[str, str]
  dtype: jnp.dtype
  param_dtype: jnp.dtype
  use_bias: bool = False
  lora_rank: int = 0
  lora_scale: float = 0.0
  lora_dropout: float = 0.0
  units: tuple[tuple[str, int], ...] = ()

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    d_in = x.shape[-1]
    boxed = lambda init, names: with_unit_partitioning(init, names, self.units)
    kernel = self.param("kernel", boxed(_KERNEL_INIT, self.axes),
                        (d_in, self.features), self.param_dtype)
    y = _matmul(x.astype(self.dtype), kernel.astype(self.dtype))
    if self.use_bias:
      bias = self.param("bias", boxed(nn.initializers.zeros, (self.axes[1],)),
                        (self.features,), self.param_dtype)
      y = y + bias.astype(self.dtype)
    if self.lora_rank:
      lora_a = self.param("lora_a", boxed(_LORA_A_INIT, (self.axes[0], "lora")),
                          (d_in, self.lora_rank), self.param_dtype)
      lora_b = self.param("lora_b", boxed(nn.initializers.zeros, ("lora", self.axes[1])),
                          (self.lora_rank, self.features), self.param_dtype)
      h = nn.Dropout(self.lora_dropout)(x, deterministic=deterministic)
      h = _matmul(_matmul(h.astype(self.dtype), lora_a.astype(self.dtype)),
                  lora_b.astype(self.dtype))
      y = y + self.lora_scale * h
    return y


class Attention(nn.Module):
  """Grouped-query attention over `cache slots ++ chunk`, visibility chosen by block ids."""
  cfg: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array, positions: Array, query_ids: Array, key_ids: Array,
               cache_k: Array | None, cache_v: Array | None,
               branches: tuple[Array, Array] | None = None):
    """x: [B, T, D]; positions/query_ids: [B, T]; key_ids: [B, S] for cache ++ chunk;
    branches: None, or (query [B, T], key [B, S]) branch ids (masks.visibility).

    Returns (out [B, T, D], (k, v) [B, T, K, Dh] of the chunk after RoPE).
    """
    cfg = self.cfg
    h, kh, dh = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    b, t, _ = x.shape
    # The flat H*Dh / K*Dh dims split over the mesh only between heads (parallel.mesh).
    dense = lambda n, axes, bias, name: Dense(
        n, axes, cfg.jnp_dtype, cfg.jnp_param_dtype, use_bias=bias, lora_rank=cfg.lora_rank,
        lora_scale=cfg.lora_scale, lora_dropout=cfg.lora_dropout,
        units=(("heads", dh), ("kv_heads", dh)), name=name)
    q = dense(h * dh, ("embed", "heads"), cfg.qkv_bias, "q")(x, self.deterministic)
    k = dense(kh * dh, ("embed", "kv_heads"), cfg.qkv_bias, "k")(x, self.deterministic)
    v = dense(kh * dh, ("embed", "kv_heads"), cfg.qkv_bias, "v")(x, self.deterministic)
    q = rope(q.reshape(b, t, h, dh), positions, cfg.rope_theta)
    k = rope(k.reshape(b, t, kh, dh), positions, cfg.rope_theta)
    v = v.reshape(b, t, kh, dh)
    new_kv = (k, v)
    if cache_k is not None:
      k = jnp.concatenate([cache_k.astype(k.dtype), k], axis=1)
      v = jnp.concatenate([cache_v.astype(v.dtype), v], axis=1)
    # Head-major operands: both einsums are then batched matmuls over (B, K) with the
    # contracted axis innermost. The same products as einsums on the token-major [B, T, K, Dh]
    # layout, but XLA:CPU lays those out through strided copies: a training step's attention
    # (forward + backward) at 421 slots took 1.8x as long (BENCHMARKS.md section 3).
    q = q.reshape(b, t, kh, h // kh, dh).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, Dh]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)         # [B, K, S, Dh]
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
    visible = masks.visibility(query_ids, key_ids,
                               *(branches or (None, None)))[:, None, None]  # [B, 1, 1, T, S]
    scores = jnp.where(visible, scores, masks.MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(cfg.jnp_dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v)                  # [B, K, G, T, Dh]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, h * dh)
    out = dense(cfg.d_model, ("heads", "embed"), False, "o")(out, self.deterministic)
    return out, new_kv


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.cfg
    dense = lambda n, axes, name: Dense(n, axes, cfg.jnp_dtype, cfg.jnp_param_dtype, name=name)
    gate = dense(cfg.mlp_dim, ("embed", "mlp"), "gate")(x)
    up = dense(cfg.mlp_dim, ("embed", "mlp"), "up")(x)
    hidden = nn.silu(gate.astype(jnp.float32)).astype(cfg.jnp_dtype) * up
    return dense(cfg.d_model, ("mlp", "embed"), "down")(hidden)
