"""Losses from fixed logits, checked exactly against float64 NumPy re-statements."""

import functools

import jax
import numpy as np
import pytest

from dllm_jax.diffusion import losses

B, L, V = 3, 7, 11
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
ar_loss = fast_jit(losses.ar_loss_from_logits)
diffusion_loss = fast_jit(losses.diffusion_loss_from_logits, static_argnames="normalization")
d2f_loss = fast_jit(losses.d2f_loss_from_logits)


def np_log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_ce(logits, targets):
  return -np.take_along_axis(np_log_softmax(logits), targets[..., None], -1)[..., 0]


@pytest.fixture
def data():
  rs = np.random.RandomState(0)
  logits = rs.randn(B, L, V).astype(np.float32) * 2
  targets = rs.randint(0, V, (B, L)).astype(np.int32)
  loss_mask = np.ones((B, L), bool)
  loss_mask[:, :2] = False  # prompt
  loss_mask[2, :4] = False
  masked = (rs.rand(B, L) < 0.5) & loss_mask
  masked[0, 3] = True
  return logits, targets, loss_mask, masked


def test_ar_cross_entropy(data):
  logits, targets, loss_mask, _ = data
  got = ar_loss(logits, targets, loss_mask)
  want = sum(np_ce(logits[b, i], targets[b, i]) for b in range(B) for i in range(L)
             if loss_mask[b, i]) / loss_mask.sum()
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_llada_pretraining_normalisation(data):
  """token_loss = CE[masked] / p_mask[masked]; loss = token_loss.sum() / (b * l)."""
  logits, targets, loss_mask, masked = data
  eps, t = 1e-3, np.array([0.0, 0.4, 0.97])
  p_mask = np.repeat(((1 - eps) * t + eps)[:, None], L, 1)
  got = diffusion_loss(logits, targets, masked, 1.0 / p_mask[:, :1],
                       normalization="batch_length")
  token_loss = np_ce(logits, targets)[masked] / p_mask[masked]
  np.testing.assert_allclose(float(got), token_loss.sum() / (B * L), rtol=1e-5)


def test_llada_sft_normalisation(data):
  """ce_loss = sum(token_loss / answer_lengths[masked]) / b (LLaDA GUIDELINES.md, SFT)."""
  logits, targets, loss_mask, masked = data
  p_mask = np.repeat(np.array([[0.3], [0.6], [0.9]]), L, 1)
  got = diffusion_loss(logits, targets, masked, 1.0 / p_mask,
                       normalization="answer_length", loss_mask=loss_mask)
  answer_lengths = np.repeat(loss_mask.sum(1, keepdims=True), L, 1)
  token_loss = np_ce(logits, targets)[masked] / p_mask[masked]
  want = np.sum(token_loss / answer_lengths[masked]) / B
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_masked_token_mean_and_errors(data):
  logits, targets, _, masked = data
  w = np.random.RandomState(1).rand(B, L) + 0.5
  got = diffusion_loss(logits, targets, masked, w, normalization="masked_tokens")
  want = (np_ce(logits, targets) * w)[masked].mean()
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  with pytest.raises(ValueError, match="normalization"):
    losses.diffusion_loss_from_logits(logits, targets, masked, w, normalization="mean")
  with pytest.raises(ValueError, match="loss_mask"):
    losses.diffusion_loss_from_logits(logits, targets, masked, w, normalization="answer_length")


def test_d2f_loss_with_known_teacher(data):
  student, _, _, masked = data
  rs = np.random.RandomState(2)
  probs = rs.dirichlet(np.ones(V) * 0.5, size=(B, L))  # a known teacher distribution
  teacher = np.log(probs).astype(np.float32)
  ratio = np.repeat(np.array([[0.2, 0.2, 0.35, 0.35, 0.5, 0.5, 0.7]]), B, 0)
  loss, kl = d2f_loss(student, teacher, masked, ratio)
  p = np.exp(np_log_softmax(teacher))
  ce = -(p * np_log_softmax(student)).sum(-1)
  ent = -(p * np.log(p)).sum(-1)
  np.testing.assert_allclose(float(loss), (ce / ratio)[masked].mean(), rtol=1e-5)
  np.testing.assert_allclose(float(kl), (ce - ent)[masked].mean(), rtol=1e-4)
  # A student equal to the teacher has zero KL.
  _, kl_self = d2f_loss(teacher, teacher, masked, ratio)
  assert abs(float(kl_self)) < 1e-5


def test_soft_ce_with_one_hot_teacher_is_ce(data):
  logits, targets, _, _ = data
  one_hot = np.where(np.arange(V) == targets[..., None], 0.0, -1e9).astype(np.float32)
  np.testing.assert_allclose(np.asarray(losses.soft_ce(logits, one_hot)),
                             np_ce(logits, targets), rtol=1e-5)
