"""Training losses as pure functions of logits, targets, masks and weights.

These carry all the arithmetic of the objectives (objectives.py only corrupts the batch and
runs the network), so each can be checked exactly against a NumPy re-statement.

Shapes: B batch, L tokens, V vocab. Logits are cast to float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NORMALIZATIONS = ("batch_length", "answer_length", "masked_tokens")


def token_ce(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
  """[B, L, V], [B, L] -> [B, L] cross-entropy -log softmax(logits)[target]."""
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - picked


def soft_ce(student_logits: jnp.ndarray, teacher_logits: jnp.ndarray) -> jnp.ndarray:
  """[B, L, V] x2 -> [B, L] -sum_v softmax(teacher)_v * log_softmax(student)_v."""
  probs = jax.nn.softmax(teacher_logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(probs * jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1),
                  axis=-1)


def entropy(logits: jnp.ndarray) -> jnp.ndarray:
  """[B, L, V] -> [B, L] entropy of softmax(logits)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def masked_mean(values: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
  """Mean of `values` over `mask` (0 when the mask is empty)."""
  mask = mask.astype(jnp.float32)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def ar_loss_from_logits(logits: jnp.ndarray, targets: jnp.ndarray,
                        mask: jnp.ndarray) -> jnp.ndarray:
  """Next-token cross-entropy averaged over trained tokens.

  logits [B, L, V] are already aligned with targets [B, L] (logits[:, i] predicts
  targets[:, i]); mask [B, L] marks trained tokens. Returns sum(ce * mask) / sum(mask).
  """
  return masked_mean(token_ce(logits, targets), mask)


def diffusion_loss_from_logits(logits: jnp.ndarray, targets: jnp.ndarray, masked: jnp.ndarray,
                               weight: jnp.ndarray, *, normalization: str,
                               loss_mask: jnp.ndarray | None = None) -> jnp.ndarray:
  """The masked-diffusion ELBO estimate: weighted cross-entropy on masked tokens.

  token_loss[b, i] = masked[b, i] * weight[b, i] * CE(logits[b, i], targets[b, i]), then

    "batch_length"   sum(token_loss) / (B * L)                    LLaDA pre-training
    "answer_length"  mean_b [ sum_i token_loss[b, i] / n_b ]     LLaDA SFT, n_b = number of
                     loss_mask tokens of row b (answer + its EOS padding; at least 1)
    "masked_tokens"  sum(token_loss) / number of masked tokens     D2F / per-token mean

  (ML-GSAI/LLaDA GUIDELINES.md: pre-training `token_loss.sum() / (b * l)`; SFT
  `sum(token_loss / answer_lengths[masked]) / b` with answer_lengths counting the
  non-prompt tokens including the EOS padding.) weight broadcasts to [B, L].
  """
  if normalization not in NORMALIZATIONS:
    raise ValueError(f"Unknown normalization {normalization!r}; use one of {NORMALIZATIONS}.")
  b, l = targets.shape
  weight = jnp.broadcast_to(jnp.asarray(weight, jnp.float32), (b, l))
  token_loss = jnp.where(masked, weight * token_ce(logits, targets), 0.0)
  if normalization == "batch_length":
    return jnp.sum(token_loss) / (b * l)
  if normalization == "answer_length":
    if loss_mask is None:
      raise ValueError("normalization='answer_length' needs loss_mask to count answer tokens.")
    n = jnp.maximum(jnp.sum(loss_mask.astype(jnp.float32), axis=1), 1.0)
    return jnp.mean(jnp.sum(token_loss, axis=1) / n)
  return jnp.sum(token_loss) / jnp.maximum(jnp.sum(masked.astype(jnp.float32)), 1.0)


def d2f_loss_from_logits(student_logits: jnp.ndarray, teacher_logits: jnp.ndarray,
                         masked: jnp.ndarray, ratio: jnp.ndarray):
  """D2F's asymmetric distillation loss and its KL.

  On every masked token: soft-target cross-entropy of the student against
  softmax(teacher), divided by that token's block mask ratio; the mean is taken over all
  masked tokens of the batch, as the reference does
  (SJTU-DENG-Lab/Discrete-Diffusion-Forcing, D2F-train/utils/loss.py:
  `(F.cross_entropy(logits[masked], softmax(ref)[masked], reduction='none') /
  p_mask[masked]).mean()`). The teacher is treated as constant (stop_gradient).

  Returns (loss, kl) where kl is the unweighted mean KL(teacher || student) over masked
  tokens.
  """
  teacher_logits = jax.lax.stop_gradient(teacher_logits)
  ce = soft_ce(student_logits, teacher_logits)
  safe_ratio = jnp.where(masked, ratio, 1.0)
  loss = masked_mean(ce / safe_ratio, masked)
  kl = masked_mean(ce - entropy(teacher_logits), masked)
  return loss, kl
