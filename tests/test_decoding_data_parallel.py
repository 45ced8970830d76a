"""shard_map data-parallel decoding: one while_loop per data shard, the 1-device tokens.

The 8-device checks run in a subprocess (XLA reads the device count once, at import). The
batch has one long row and seven short ones (`dp_bench.uneven_batch` picks the EOS id from
the model's own greedy AR output), one row per device: the devices' step counts differ,
and every method's tokens equal 1-device decoding, greedy and sampled (each shard draws its
rows' keys by global row index). The diffusion methods rank with batch_invariant=True (the
grid): the default ranks exact scores, as the references do, and promises no invariance
across batch sizes and meshes.

The subprocess compiles at XLA's backend optimization level 0: both sides of every
comparison are compiled alike, and compiling, not running, is most of its time.
"""

import pytest

from dllm_jax.decoding import api
from dllm_jax.parallel import mesh as mesh_lib

EIGHT = """
import sys
import jax
import numpy as np
from dllm_jax.decoding import api, data_parallel
from dllm_jax.models import get_preset
from dllm_jax.parallel import mesh as mesh_lib
sys.path.insert(0, "experiments")  # studylib: the study's modules
from studylib import dp_bench

assert len(jax.devices()) == 8
base_cfg = get_preset("tiny")
params = dp_bench.random_params(base_cfg)
mesh = mesh_lib.make_mesh({"data": 8})
runs = {
    "ar": dict(gen_length=8, top_k=10),
    "llada": dict(gen_length=8, block_length=4, steps=8, batch_invariant=True),
    "dream": dict(gen_length=8, block_length=4, steps=8, batch_invariant=True),
    "fast_dllm": dict(gen_length=8, block_length=4, threshold=0.5, cache="dual",
                      batch_invariant=True),
    "d2f": dict(gen_length=8, block_length=2, tau_conf=0.5, tau_add=0.5, tau_act=0.5,
                batch_invariant=True),
    "block_diffusion": dict(gen_length=8, block_length=2, steps_per_block=1,
                            batch_invariant=True),
}
# fast_dllm's keys use the batch's loop step, which depends on when the whole batch moves to
# the next block, so its sampled tokens already differ between a row alone and in a batch.
temperatures = {m: (0.0,) if m == "fast_dllm" else (0.0, 1.0) for m in runs}
# The EOS id that makes row 0 the one long row, from AR's and from D2F's greedy answers.
uneven = {m: dp_bench.uneven_batch(params, base_cfg, method=m, **runs[m])
          for m in ("ar", "d2f")}
for method, kw in runs.items():
  cfg, prompts = uneven["ar" if method == "ar" else "d2f"]
  tokens, valid = api.as_prompt_batch(cfg, prompts)
  for temperature in temperatures[method]:
    rng = jax.random.key(7)
    one = api.generate(params, cfg, (tokens, valid), method=method, rng=rng, pad_to=None,
                       batch_buckets=None, temperature=temperature, **kw)
    out, stats = data_parallel.decode(params, cfg, tokens, valid, rng, mesh=mesh,
                                      method=method, temperature=temperature, **kw)
    for field in ("tokens", "lengths", "committed", "done", "finite"):
      np.testing.assert_array_equal(np.asarray(getattr(out, field)),
                                    np.asarray(getattr(one, field)),
                                    err_msg=f"{method} T={temperature} {field}")
    assert stats.steps.shape == (8,) and int(out.steps) == stats.steps.max()
    assert int(out.nfe) == stats.nfe.max() and stats.rows.tolist() == [1] * 8
    if method in ("ar", "d2f") and temperature == 0.0:
      assert stats.steps[0] > stats.steps[1:].max(), (method, stats.steps)
      assert int(one.steps) == stats.steps[0], (method, int(one.steps), stats.steps)
    print(method, temperature, stats.steps.tolist())

cfg, prompts = uneven["ar"]
# Tensor parallelism inside each data shard; generate picks shard_map by default and pads
# 3 rows to the data-parallel size; params already sharded on the mesh are used there.
mixed = mesh_lib.make_mesh({"data": 4, "tensor": 2})
calls = []
real = data_parallel.run_plan
data_parallel.run_plan = lambda *a, **k: calls.append(k["mesh"]) or real(*a, **k)
from dllm_jax.models import abstract_params
from dllm_jax.parallel import sharding
placed = sharding.place_params(params, mixed, abstract=lambda: abstract_params(cfg),
                               replicate_axes=mesh_lib.data_axes(mixed))
kw = dict(gen_length=8, temperature=1.0, top_p=0.9)
rng = jax.random.key(1)
one = api.generate(params, cfg, prompts[:3], method="ar", rng=rng, **kw)
many = api.generate(placed, cfg, prompts[:3], method="ar", rng=rng, mesh=mixed, **kw)
spmd = api.generate(params, cfg, prompts[:3], method="ar", rng=rng, mesh=mixed,
                    data_parallel="spmd", **kw)
assert calls == [mixed], calls
assert many.tokens.shape == one.tokens.shape == (3, 8)
np.testing.assert_array_equal(np.asarray(many.tokens), np.asarray(one.tokens))
np.testing.assert_array_equal(np.asarray(spmd.tokens), np.asarray(one.tokens))
print("mixed ok")
"""


@pytest.mark.slow
def test_shard_map_steps_per_device_and_tokens_equal_one_device(run_devices):
  out = run_devices(EIGHT, devices=8)
  lines = out.strip().splitlines()
  assert lines[-1] == "mixed ok"
  assert len(lines) == 12, out


def test_data_axes_and_rules_without_them():
  import jax
  mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  assert mesh_lib.data_axes(mesh) == ()
  rules = mesh_lib.without_axes(mesh_lib.DEFAULT_RULES, ("data", "fsdp"))
  as_dict = dict(rules)
  assert as_dict["batch"] is None and as_dict["embed"] is None
  assert as_dict["heads"] == "tensor" and as_dict["vocab"] == "tensor"
  assert dict(mesh_lib.without_axes((("batch", ("data", "fsdp")),), ("data",))) == {
      "batch": "fsdp"}


def test_data_parallel_mode_is_checked_and_defaults():
  import jax
  mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  assert api._data_parallel_mode(None, None, None) is None
  assert api._data_parallel_mode(None, mesh, None) == "spmd"  # nothing to split
  assert api._data_parallel_mode("shard_map", mesh, None) == "spmd"
  with pytest.raises(ValueError, match="data_parallel='pmap'.*shard_map"):
    api.generate(None, None, [[1]], method="ar", mesh=mesh, data_parallel="pmap")
