"""check_finite names the damaged tensor and passes a healthy tree."""

import jax
import jax.numpy as jnp
import pytest

from dllm_jax.models import get_preset, init_params
from dllm_jax.models.finite import NonFiniteParamsError, check_finite


def test_healthy_params_pass():
  check_finite(init_params(get_preset("tiny"), jax.random.key(0)))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_one_bad_entry_is_named(bad):
  params = init_params(get_preset("tiny"), jax.random.key(0))
  params["layers"]["attn"]["q"]["kernel"] = params["layers"]["attn"]["q"]["kernel"].at[1, 2, 3].set(bad)
  with pytest.raises(NonFiniteParamsError, match=r"/ckpt/x: .*layers/attn/q/kernel \(1 of"):
    check_finite(params, "/ckpt/x")
