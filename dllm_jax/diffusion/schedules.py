"""Noise schedules of absorbing-state (masked) diffusion.

A schedule maps diffusion time t in [0, 1] to `alpha(t)`, the probability that a token of the
clean sequence x0 is still clean in x_t (`alpha(0) = 1`, `alpha(1) = 0`, decreasing). Each
token is masked independently with `mask_prob(t) = 1 - alpha(t)`. The continuous-time ELBO
(MDLM, Sahoo et al. 2024; MD4, Shi et al. 2024) is

    -log p(x0) <= E_{t ~ U(0, 1)} [ w(t) * sum_{i masked in x_t} -log p(x0_i | x_t) ],
    w(t) = -alpha'(t) / (1 - alpha(t)).

LLaDA's convention (ML-GSAI/LLaDA GUIDELINES.md) is the linear schedule `alpha(t) = 1 - t`,
so `mask_prob(t) = t` and `w(t) = 1 / t`, with t drawn from U(eps, 1) rather than U(0, 1):
the objectives draw `t = eps + (1 - eps) * u`, `u ~ U(0, 1)` (see corruption.sample_times),
which is exactly LLaDA's `p_mask = (1 - eps) * u + eps` and weight `1 / p_mask`. That loss
is the ELBO restricted to [eps, 1] divided by (1 - eps), the usual LLaDA/MDLM estimator.

All methods take and return float arrays of any shape and are jit-able; schedules are frozen,
hashable dataclasses so they can be static arguments.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Base class: subclasses define `alpha` and its time derivative `dalpha`."""

  def alpha(self, t):
    raise NotImplementedError

  def dalpha(self, t):
    raise NotImplementedError

  def mask_prob(self, t):
    """Probability that a token is masked at time t: 1 - alpha(t)."""
    return 1.0 - self.alpha(t)

  def weight(self, t):
    """ELBO weight -alpha'(t) / (1 - alpha(t)); finite for t > 0."""
    return -self.dalpha(t) / self.mask_prob(t)


@dataclasses.dataclass(frozen=True)
class LinearSchedule(Schedule):
  """alpha(t) = 1 - t: mask_prob(t) = t, weight(t) = 1 / t (LLaDA, MDLM's default)."""

  def alpha(self, t):
    return 1.0 - jnp.asarray(t)

  def dalpha(self, t):
    return -jnp.ones_like(jnp.asarray(t))

  def mask_prob(self, t):
    return jnp.asarray(t)

  def weight(self, t):
    return 1.0 / jnp.asarray(t)


@dataclasses.dataclass(frozen=True)
class CosineSchedule(Schedule):
  """alpha(t) = 1 - cos(pi/2 * (1 - t)) (MD4's cosine): weight = pi/2 * tan(pi/2 * (1 - t))."""

  def alpha(self, t):
    return 1.0 - jnp.cos(0.5 * math.pi * (1.0 - jnp.asarray(t)))

  def dalpha(self, t):
    return -0.5 * math.pi * jnp.sin(0.5 * math.pi * (1.0 - jnp.asarray(t)))

  def mask_prob(self, t):
    return jnp.cos(0.5 * math.pi * (1.0 - jnp.asarray(t)))


@dataclasses.dataclass(frozen=True)
class PolynomialSchedule(Schedule):
  """alpha(t) = 1 - t**exponent: weight = exponent / t (exponent 1 is the linear schedule)."""
  exponent: float = 2.0

  def __post_init__(self):
    if not self.exponent > 0:
      raise ValueError(f"PolynomialSchedule.exponent must be > 0, got {self.exponent}.")

  def alpha(self, t):
    return 1.0 - jnp.asarray(t) ** self.exponent

  def dalpha(self, t):
    t = jnp.asarray(t)
    return -self.exponent * t ** (self.exponent - 1.0)

  def mask_prob(self, t):
    return jnp.asarray(t) ** self.exponent


@dataclasses.dataclass(frozen=True)
class GeometricSchedule(Schedule):
  """alpha(t) = exp(-sigma(t)), sigma(t) = sigma_min**(1-t) * sigma_max**t (MD4's geometric).

  alpha(0) = exp(-sigma_min) is 1 only up to sigma_min; alpha(1) = exp(-sigma_max).
  """
  sigma_min: float = 1e-4
  sigma_max: float = 10.0

  def __post_init__(self):
    if not 0 < self.sigma_min < self.sigma_max:
      raise ValueError(
          "GeometricSchedule needs 0 < sigma_min < sigma_max, got "
          f"sigma_min={self.sigma_min}, sigma_max={self.sigma_max}.")

  def _sigma(self, t):
    t = jnp.asarray(t)
    return jnp.exp((1.0 - t) * math.log(self.sigma_min) + t * math.log(self.sigma_max))

  def alpha(self, t):
    return jnp.exp(-self._sigma(t))

  def dalpha(self, t):
    sigma = self._sigma(t)
    return -jnp.exp(-sigma) * sigma * (math.log(self.sigma_max) - math.log(self.sigma_min))

  def mask_prob(self, t):
    return -jnp.expm1(-self._sigma(t))


SCHEDULES: dict[str, type[Schedule]] = {
    "linear": LinearSchedule,
    "cosine": CosineSchedule,
    "polynomial": PolynomialSchedule,
    "geometric": GeometricSchedule,
}


def get_schedule(name: str | Schedule, **kwargs) -> Schedule:
  """Returns a schedule by name (`linear`, `cosine`, `polynomial`, `geometric`).

  A Schedule instance is passed through unchanged. `kwargs` go to the schedule's
  constructor (e.g. `get_schedule("polynomial", exponent=3.0)`).
  """
  if isinstance(name, Schedule):
    if kwargs:
      raise ValueError(f"Got a Schedule instance {name!r} and extra arguments {kwargs}; "
                       "pass either a name with arguments or a built schedule.")
    return name
  if name not in SCHEDULES:
    raise ValueError(f"Unknown noise schedule {name!r}; available: {sorted(SCHEDULES)}.")
  cls = SCHEDULES[name]
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise ValueError(f"Schedule {name!r} takes {sorted(fields) or 'no'} arguments; "
                     f"got unknown {unknown}.")
  return cls(**kwargs)
