"""Params placement on 8 fake CPU devices (data=2, fsdp=2, tensor=2).

`init_params(..., mesh=mesh)` creates every leaf in the shardings `param_shardings` gives,
with the values of the unsharded init (to float32 rounding: jit fuses the init's scaling);
`place_params` places an existing tree the same way (given the abstract params), leaves an
already-placed tree alone, keeps already-placed leaves of a partly placed tree, and with
`replicate_axes` replicates every leaf over those axes (shard_map's data axes). Runs in a
subprocess (XLA_FLAGS is read at import).
"""

import json

import pytest

CODE = r"""
import json
import jax, numpy as np
from dllm_jax.models import abstract_params, get_preset, init_params
from dllm_jax.parallel import make_mesh, mesh as mesh_lib, place_params

cfg = get_preset("tiny", lora_rank=2)
mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
expected = mesh_lib.param_shardings(abstract_params(cfg), mesh, mesh_lib.DEFAULT_RULES)
key = jax.random.key(3)
plain = init_params(cfg, key)
sharded = init_params(cfg, key, mesh=mesh)
abstract = abstract_params(cfg)
placed = place_params(jax.tree.map(np.asarray, plain), mesh, abstract=abstract)
again = place_params(placed, mesh)  # already on the mesh: no abstract params needed
# A partly placed tree: the placed leaves stay, the host ones move (the abstract params are
# made only then, by the function passed).
calls = []
partly = dict(placed, final_norm=jax.tree.map(np.asarray, plain["final_norm"]))
partly = place_params(partly, mesh, abstract=lambda: calls.append(1) or abstract)

out = {"leaves": 0, "sharded_leaves": 0}
for name, tree in (("init", sharded), ("place_params", placed), ("partly", partly)):
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
out["kept"] = again is placed
out["partly_kept"] = (partly["layers"]["attn"]["q"]["kernel"] is placed["layers"]["attn"]["q"]["kernel"]
                      and len(calls) == 1)
# Replicated over the data axes, sharded over the rest (what a shard_map over data wants).
axes = mesh_lib.data_axes(mesh, mesh_lib.DEFAULT_RULES)
inner = place_params(jax.tree.map(np.asarray, plain), mesh, abstract=abstract,
                     replicate_axes=axes)
want = mesh_lib.param_shardings(abstract, mesh,
                                mesh_lib.without_axes(mesh_lib.DEFAULT_RULES, axes))
out["replicated_ok"] = all(x.sharding.is_equivalent_to(w, x.ndim) for x, w in
                           zip(jax.tree.leaves(inner), jax.tree.leaves(want)))
out["axes"] = list(axes)
out["inner_embed_spec"] = str(inner["embed"]["embedding"].sharding.spec)
for label, call in (("no_abstract", lambda: place_params(plain, mesh)),
                    ("bad_axis", lambda: place_params(plain, mesh, abstract=abstract,
                                                      replicate_axes=("rows",)))):
  try:
    call()
  except ValueError as e:
    out[label] = str(e)
q = sharded["layers"]["attn"]["q"]["kernel"]
out["q_spec"], out["q_shards"] = str(q.sharding.spec), len({str(s.index) for s in q.addressable_shards})
out["ffn_spec"] = str(sharded["layers"]["mlp"]["up"]["kernel"].sharding.spec)
rules = (("embed", None), ("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"),
         ("vocab", None), ("layers", None), ("norm", None), ("lora", None))
custom = init_params(cfg, key, mesh=mesh, rules=rules)
out["custom_q_spec"] = str(custom["layers"]["attn"]["q"]["kernel"].sharding.spec)
try:
  place_params({"embed": plain["embed"]}, mesh, abstract=abstract)
except ValueError as e:
  out["missing_error"] = str(e)
bad = jax.tree.map(np.asarray, plain)
bad["final_norm"]["scale"] = np.zeros(3, np.float32)
try:
  place_params(bad, mesh, abstract=abstract)
except ValueError as e:
  out["shape_error"] = str(e)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_sharded_init_and_place_params_on_eight_devices(run_devices):
  out = json.loads(run_devices(CODE, devices=8).split("RESULT", 1)[1])
  assert out["leaves"] > 0 and out["sharded_leaves"] > out["leaves"] // 4
  assert out["q_spec"] == "P(None, 'fsdp', 'tensor')" and out["q_shards"] == 4
  assert out["ffn_spec"] == "P(None, 'fsdp', 'tensor')"
  assert out["custom_q_spec"] == "P(None, None, 'tensor')"
  assert out["kept"]  # an already-placed tree is returned as it is
  assert out["partly_kept"]  # placed leaves of a partly placed tree are kept
  assert out["axes"] == ["data", "fsdp"] and out["replicated_ok"]
  assert "fsdp" not in out["inner_embed_spec"] and "data" not in out["inner_embed_spec"]
  assert "pass abstract=" in out["no_abstract"]
  assert "replicate_axes ['rows'] are not axes of the mesh" in out["bad_axis"]
  assert "missing leaves ['final_norm/scale'," in out["missing_error"]
  assert "param 'final_norm/scale' is (3,) but the model config's" in out["shape_error"]
