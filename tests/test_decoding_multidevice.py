"""Decoding on 8 fake CPU devices (data x fsdp x tensor) gives exactly the 1-device tokens.

Runs in a subprocess (XLA reads the device count once, at import). The batch of 3 rows is
padded to the data-parallel size 4 by `generate`; sampling at temperature > 0 checks that a
row's random keys do not depend on the padding or the sharding.
"""

import pytest

CODE = """
import sys
sys.path.insert(0, "tests")
import jax
import numpy as np
from dllm_jax.decoding import api
from dllm_jax.models import get_preset
from dllm_jax.parallel import mesh as mesh_lib
from test_decoding_llada import PROMPTS, random_params

assert len(jax.devices()) == 8
cfg = get_preset("tiny").replace(eos_token_id=None)
params = random_params(cfg)
mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
runs = {
    "ar": dict(gen_length=12, temperature=1.0, top_k=10),
    "llada": dict(gen_length=16, block_length=8, steps=8, cfg_scale=1.0, temperature=0.7),
    "fast_dllm": dict(gen_length=16, block_length=8, threshold=0.5, cache="dual"),
}
for method, kw in runs.items():
  rng = jax.random.key(5)
  one = api.generate(params, cfg, PROMPTS, method=method, rng=rng, **kw)
  many = api.generate(params, cfg, PROMPTS, method=method, rng=rng, mesh=mesh, **kw)
  assert many.tokens.shape == one.tokens.shape, (method, many.tokens.shape)
  assert len(many.tokens.sharding.device_set) == 8, method
  for field in ("tokens", "lengths", "nfe", "steps", "committed", "done"):
    np.testing.assert_array_equal(np.asarray(getattr(many, field)),
                                  np.asarray(getattr(one, field)), err_msg=method + field)
  print(method, "ok")
"""


@pytest.mark.slow
def test_eight_devices_equal_one(run_devices):
  out = run_devices(CODE, devices=8)
  assert out.split() == ["ar", "ok", "llada", "ok", "fast_dllm", "ok"]
