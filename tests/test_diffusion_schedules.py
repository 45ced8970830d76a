"""Noise schedules: ELBO weights against finite differences, LLaDA's eps convention, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.diffusion import corruption, schedules

ALL = [schedules.LinearSchedule(), schedules.CosineSchedule(),
       schedules.PolynomialSchedule(exponent=3.0), schedules.GeometricSchedule()]


@pytest.mark.parametrize("sched", ALL, ids=lambda s: type(s).__name__)
def test_weight_matches_finite_difference(sched):
  t = np.linspace(0.05, 0.95, 19)

  def central(h):  # -alpha'(t) = d mask_prob / dt; mask_prob is the accurate one near t=0
    up, down = (np.asarray(sched.mask_prob(t + s), np.float64) for s in (h, -h))
    return (up - down) / (2 * h)

  neg_dalpha = (4 * central(5e-3) - central(1e-2)) / 3  # Richardson: O(h^4) error
  expected = neg_dalpha / np.asarray(sched.mask_prob(t), np.float64)
  np.testing.assert_allclose(np.asarray(sched.weight(t)), expected, rtol=1e-3)
  # dalpha is the exact derivative of alpha.
  grad = jax.vmap(jax.grad(lambda x: sched.alpha(x)))(jnp.asarray(t, jnp.float32))
  np.testing.assert_allclose(np.asarray(sched.dalpha(t)), np.asarray(grad), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(sched.mask_prob(t)), 1.0 - np.asarray(sched.alpha(t)),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sched", ALL[:3], ids=lambda s: type(s).__name__)
def test_endpoints_and_monotone(sched):
  t = np.linspace(0.0, 1.0, 101)
  alpha = np.asarray(sched.alpha(t))
  assert alpha[0] == pytest.approx(1.0) and alpha[-1] == pytest.approx(0.0, abs=1e-6)
  assert np.all(np.diff(alpha) < 0)


def test_linear_with_eps_is_llada():
  """t = eps + (1 - eps) u gives p_mask = (1 - eps) u + eps and weight 1 / p_mask."""
  eps = 1e-3
  key = jax.random.key(0)
  u = np.asarray(corruption.uniform(key, (64,)), np.float64)
  t = corruption.sample_times(key, (64,), t_min=eps)
  sched = schedules.get_schedule("linear")
  p_mask = (1 - eps) * u + eps
  np.testing.assert_allclose(np.asarray(sched.mask_prob(t)), p_mask, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(sched.weight(t)), 1.0 / p_mask, rtol=1e-5)


def test_polynomial_weight_closed_form():
  t = np.linspace(0.1, 0.9, 9)
  np.testing.assert_allclose(np.asarray(schedules.PolynomialSchedule(2.5).weight(t)), 2.5 / t,
                             rtol=1e-5)


def test_get_schedule_errors():
  with pytest.raises(ValueError, match="available: .*cosine.*linear"):
    schedules.get_schedule("sqrt")
  with pytest.raises(ValueError, match="unknown"):
    schedules.get_schedule("linear", exponent=2.0)
  with pytest.raises(ValueError, match="exponent"):
    schedules.get_schedule("polynomial", exponent=-1.0)
  assert schedules.get_schedule("polynomial", exponent=3.0).exponent == 3.0
  built = schedules.CosineSchedule()
  assert schedules.get_schedule(built) is built
  assert hash(built) == hash(schedules.CosineSchedule())  # usable as a static jit argument
