"""Log-likelihoods of a continuation given a context: exact for causal models, LLaDA's
Monte-Carlo ELBO for masked-diffusion models. Jitted; the lm-eval model batches the requests.

Shape legend: B batch, P padded sequence length (context + continuation, left padded, so a
row's last token is at column P - 1), W scored columns (the last W of P, W <= P - 1),
N Monte-Carlo batches, b rows per Monte-Carlo batch, V vocab.

Only the W scored columns go through the LM head (`transformer.project(..., at=)`): the head
of a 126k-token vocabulary is the largest tensor of a forward.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.models import transformer
from dllm_jax.models.config import ModelConfig


def _head(params, cfg: ModelConfig, hidden, at):
  """[B, W] float32 log-softmax inputs: logits of the W slots `at` (pre-shift outputs)."""
  at = jnp.broadcast_to(at, (hidden.shape[0], at.shape[-1]))
  return transformer.project(params, cfg, hidden, at)


@functools.partial(jax.jit, static_argnames=("cfg", "width"))
def causal_loglikelihood(params, tokens, valid, lengths, *, cfg: ModelConfig, width: int):
  """log p(continuation | context) of a causal LM, exactly, and whether greedy decoding
  reproduces the continuation.

  Args:
    tokens, valid: [B, P] context + continuation, left padded.
    lengths: [B] continuation tokens of each row (its last lengths[i] tokens), <= width.
    width: W, static; W <= P - 1 (every row has at least one context token).

  Returns:
    (logprob [B] = sum over the continuation tokens x_j of log softmax(logits_{j-1})[x_j],
     greedy [B] = every such x_j is the argmax of its logits).
  The prediction of column j is the model's output at j - 1, with or without Dream's
  `shift_logits` (which only moves where the logits are returned).
  """
  p = tokens.shape[1]
  cols = p - width + jnp.arange(width)
  hidden = transformer.forward(params, cfg, tokens, attention="causal", valid=valid,
                               head=False)
  logp = jax.nn.log_softmax(_head(params, cfg, hidden, cols - 1), axis=-1)   # [B, W, V]
  targets = tokens[:, cols]                                                   # [B, W]
  token_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  scored = jnp.arange(width)[None, :] >= width - lengths[:, None]
  total = jnp.sum(jnp.where(scored, token_logp, 0.0), axis=-1)
  greedy = jnp.all(jnp.where(scored, jnp.argmax(logp, axis=-1) == targets, True), axis=-1)
  return total, greedy


def mc_masks(rng, target_len, *, width: int, num_batches: int, batch: int):
  """LLaDA's masks for the Monte-Carlo ELBO (eval_llada.py `_forward_process`).

  For each of N batches of b rows: k ~ U{1..L} (L = target_len, traced), row i masks
  x_i = ((round(k + i L / b) - 1) mod L) + 1 of the L continuation tokens (so the batch
  spreads its mask counts evenly over 1..L, and each row's x_i is uniform on 1..L), at
  positions drawn uniformly without replacement (a random permutation).

  Returns (masked [N, b, W] bool over the last W columns, counts [N, b] int32 = x).
  """
  length = jnp.asarray(target_len, jnp.int32)
  in_target = jnp.arange(width) >= width - length                               # [W]

  def one(n):
    k_count, k_perm = jax.random.split(jax.random.fold_in(rng, n))
    k = jax.random.randint(k_count, (), 1, length + 1)
    spread = k + jnp.arange(batch, dtype=jnp.float32) * (length / batch)
    counts = (jnp.round(spread).astype(jnp.int32) - 1) % length + 1           # [b]
    keys = jnp.where(in_target, jax.random.uniform(k_perm, (batch, width)), 2.0)
    rank = jnp.argsort(jnp.argsort(keys, axis=-1), axis=-1)
    return rank < counts[:, None], counts

  return jax.lax.map(one, jnp.arange(num_batches))


@functools.partial(jax.jit, static_argnames=("cfg",))
def elbo_batch_losses(params, tokens, valid, masked, counts, target_len, *, cfg: ModelConfig):
  """The Monte-Carlo ELBO's per-batch losses, LLaDA's `get_loglikelihood` loop body.

  Args:
    tokens, valid: [P] one context + continuation, left padded.
    masked, counts: [N, b, W], [N, b] from `mc_masks` (W <= P - 1).
    target_len: L, the continuation's tokens (the last L columns).

  Returns [N]: loss_n = (1/b) sum_i sum_{j masked in row i} -log p(x_j | canvas_i) / (x_i / L),
  each canvas the sequence with its masked columns set to [MASK], read bidirectionally.
  """
  if cfg.mask_token_id is None:
    raise ValueError(f"model {cfg.name!r} has no mask_token_id, so it cannot be scored by "
                     "the masked-diffusion ELBO; use likelihood=ar for a causal model.")
  p, width = tokens.shape[0], masked.shape[-1]
  cols = p - width + jnp.arange(width)
  targets = tokens[cols]
  shift = 1 if cfg.shift_logits else 0      # Dream reads slot j's prediction at j - 1
  length = jnp.asarray(target_len, jnp.float32)

  def loss(batch):
    masked_n, counts_n = batch
    rows = masked_n.shape[0]
    canvas = jnp.broadcast_to(tokens, (rows, p)).at[:, cols].set(
        jnp.where(masked_n, cfg.mask_token_id, targets))
    hidden = transformer.forward(params, cfg, canvas, attention="bidirectional",
                                 valid=jnp.broadcast_to(valid, (rows, p)), head=False)
    logits = _head(params, cfg, hidden, cols - shift)                          # [b, W, V]
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
        logits, jnp.broadcast_to(targets, (rows, width))[..., None], -1)[..., 0]
    weight = length / counts_n.astype(jnp.float32)                              # 1 / t
    return jnp.sum(jnp.where(masked_n, ce, 0.0) * weight[:, None]) / rows

  return jax.lax.map(loss, (masked, counts))


@functools.partial(jax.jit, static_argnames=("cfg", "width", "mc_num", "mc_batch"))
def diffusion_elbo(params, tokens, valid, target_len, rng, *, cfg: ModelConfig, width: int,
                   mc_num: int, mc_batch: int):
  """The per-batch losses of LLaDA's Monte-Carlo estimate of log p(continuation | context).

      log p(x_0 | c) >= E_{t, x_t}[ (1/t) sum_{j: x_t^j = [MASK]} log p_theta(x_0^j | c, x_t) ]

  with t = x/L the masked fraction (x masked of the L continuation tokens) and x_t the
  continuation with those tokens masked: `mc_masks` draws mc_num (x, mask) samples in
  mc_num / mc_batch batches, `elbo_batch_losses` scores them. The estimate is
  -mean(losses); it is unbiased for the bound, and the batch means are independent, so
  its standard error is std(losses) / sqrt(N). Shapes as `elbo_batch_losses`.
  """
  masked, counts = mc_masks(rng, target_len, width=width, num_batches=mc_num // mc_batch,
                            batch=mc_batch)
  return elbo_batch_losses(params, tokens, valid, masked, counts, target_len, cfg=cfg)


def request_key(seed: int, ids) -> jax.Array:
  """The PRNG key of one request's Monte-Carlo samples: the seed folded with a checksum of
  its token ids, so a (context, continuation) pair gets the same estimate in any order or
  batch of requests."""
  digest = zlib.crc32(np.asarray(ids, np.int32).tobytes()) & 0x7FFFFFFF
  return jax.random.fold_in(jax.random.key(seed), digest)
