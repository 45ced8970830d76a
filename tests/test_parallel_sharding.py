"""Params placement on 8 fake CPU devices (data=2, fsdp=2, tensor=2).

`init_params(..., mesh=mesh)` creates every leaf in the shardings `param_shardings` gives,
with the values of the unsharded init (to float32 rounding: jit fuses the init's scaling); `shard_params` places an existing tree the same way
and leaves an already-placed leaf alone. Runs in a subprocess (XLA_FLAGS is read at import).
"""

import json

import pytest

CODE = r"""
import json
import jax, numpy as np
from dllm_jax.models import abstract_params, get_preset, init_params
from dllm_jax.parallel import make_mesh, mesh as mesh_lib, shard_params

cfg = get_preset("tiny", lora_rank=2)
mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
expected = mesh_lib.param_shardings(abstract_params(cfg), mesh, mesh_lib.DEFAULT_RULES)
key = jax.random.key(3)
plain = init_params(cfg, key)
sharded = init_params(cfg, key, mesh=mesh)
placed = shard_params(jax.tree.map(np.asarray, plain), cfg, mesh)
again = shard_params(placed, cfg, mesh)

out = {"leaves": 0, "sharded_leaves": 0}
for name, tree in (("init", sharded), ("shard_params", placed)):
  for (path, x), want, ref in zip(jax.tree_util.tree_leaves_with_path(tree),
                                  jax.tree.leaves(expected), jax.tree.leaves(plain)):
    assert x.sharding.is_equivalent_to(want, x.ndim), (name, path, x.sharding, want)
    if name == "init":
      np.testing.assert_allclose(np.asarray(x), np.asarray(ref), rtol=1e-6, atol=0,
                                 err_msg=f"{name} {path}")
    else:  # placing moves values, it never changes them
      np.testing.assert_array_equal(np.asarray(x), np.asarray(ref), err_msg=f"{name} {path}")
    out["leaves"] += 1
    out["sharded_leaves"] += int(len({str(s.index) for s in x.addressable_shards}) > 1)
out["kept"] = all(a is b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(again)))
q = sharded["layers"]["attn"]["q"]["kernel"]
out["q_spec"], out["q_shards"] = str(q.sharding.spec), len({str(s.index) for s in q.addressable_shards})
out["ffn_spec"] = str(sharded["layers"]["mlp"]["up"]["kernel"].sharding.spec)
rules = (("embed", None), ("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"),
         ("vocab", None), ("layers", None), ("norm", None), ("lora", None))
custom = init_params(cfg, key, mesh=mesh, rules=rules)
out["custom_q_spec"] = str(custom["layers"]["attn"]["q"]["kernel"].sharding.spec)
try:
  shard_params({"embed": plain["embed"]}, cfg, mesh)
except ValueError as e:
  out["missing_error"] = str(e)
bad = jax.tree.map(np.asarray, plain)
bad["final_norm"]["scale"] = np.zeros(3, np.float32)
try:
  shard_params(bad, cfg, mesh)
except ValueError as e:
  out["shape_error"] = str(e)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_sharded_init_and_shard_params_on_eight_devices(run_devices):
  out = json.loads(run_devices(CODE, devices=8).split("RESULT", 1)[1])
  assert out["leaves"] > 0 and out["sharded_leaves"] > out["leaves"] // 4
  assert out["q_spec"] == "P(None, 'fsdp', 'tensor')" and out["q_shards"] == 4
  assert out["ffn_spec"] == "P(None, 'fsdp', 'tensor')"
  assert out["custom_q_spec"] == "P(None, None, 'tensor')"
  assert out["kept"]  # already-placed leaves are returned as they are
  assert "missing leaves ['final_norm/scale'," in out["missing_error"]
  assert "param 'final_norm/scale' is (3,) but the model config" in out["shape_error"]
