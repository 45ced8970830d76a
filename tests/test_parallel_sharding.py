"""Params placement on 8 fake CPU devices (data=2, fsdp=2, tensor=2).

`init_params(..., mesh=mesh)` creates every leaf in the shardings `param_shardings` gives,
with the values of the unsharded init (to float32 rounding: jit fuses the init's scaling);
`place_params` places an existing tree the same way (given the abstract params), leaves an
already-placed tree alone, keeps already-placed leaves of a partly placed tree, and with
`replicate_axes` replicates every leaf over those axes (shard_map's data axes). Runs in a
subprocess (XLA_FLAGS is read at import).

The head-unit rule (a flat H*Dh dim splits over `tensor` only when `tensor` divides the head
count) is checked on abstract meshes in this process: no devices are needed for shardings.
"""

import json
import math

import flax.linen as nn
import jax
import pytest
from jax.sharding import AbstractMesh, AxisType

from dllm_jax.models import abstract_params, get_preset
from dllm_jax.parallel import mesh as mesh_lib

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
# tensor=4 over 2 kv heads: the init keeps whole kv heads (the k/v kernels replicated on
# tensor) and gives the same values; q (4 heads) is still split.
mesh4 = make_mesh({"data": 2, "tensor": 4})
four = init_params(cfg, key, mesh=mesh4)
want4 = mesh_lib.param_shardings(abstract, mesh4)
out["tensor4_ok"] = all(x.sharding.is_equivalent_to(w, x.ndim) for x, w in
                        zip(jax.tree.leaves(four), jax.tree.leaves(want4)))
for ref, x in zip(jax.tree.leaves(plain), jax.tree.leaves(four)):
  np.testing.assert_allclose(np.asarray(x), np.asarray(ref), rtol=1e-6, atol=0)
out["tensor4_specs"] = {n: str(four["layers"]["attn"][n]["kernel"].sharding.spec)
                        for n in ("q", "k", "v", "o")}
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
  assert out["tensor4_ok"]
  assert out["tensor4_specs"] == {"q": "P(None, None, 'tensor')", "k": "P(None, None, None)",
                                  "v": "P(None, None, None)", "o": "P(None, 'tensor', None)"}


def _attn_specs(cfg, **mesh_shape):
  """{param path under layers/attn: its PartitionSpec} on an abstract mesh of `mesh_shape`."""
  sizes = tuple(mesh_shape.get(a, 1) for a in mesh_lib.MESH_AXES)
  mesh = AbstractMesh(sizes, mesh_lib.MESH_AXES, axis_types=(AxisType.Auto,) * len(sizes))
  attn = mesh_lib.param_shardings(abstract_params(cfg), mesh)["layers"]["attn"]
  return {f"{name}/{leaf}": tuple(s.spec) for name in attn for leaf, s in attn[name].items()}


def test_heads_split_over_tensor_only_between_whole_heads():
  """tiny: 4 query heads, 2 kv heads of Dh = 8, so the flat k/v dims (16) divide by 4 but the
  kv heads do not: tensor=4 would put half a head on each device, and RoPE's half swap would
  then be a collective permute inside every decode loop. Kernels, biases and LoRA factors
  ([layers, in, out]) all follow the rule."""
  cfg = get_preset("tiny", lora_rank=2, qkv_bias=True)
  assert (cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim) == (4, 2, 8)
  t, rep = "tensor", (None, None, None)
  four = _attn_specs(cfg, data=2, tensor=4)
  for name in ("k", "v"):
    assert four[f"{name}/kernel"] == rep and four[f"{name}/lora_b"] == rep
    assert four[f"{name}/bias"] == (None, None)
  assert four["q/kernel"] == (None, None, t) and four["q/lora_b"] == (None, None, t)
  assert four["q/bias"] == (None, t)
  assert four["o/kernel"] == (None, t, None) and four["o/lora_a"] == (None, t, None)
  two = _attn_specs(cfg, data=2, fsdp=2, tensor=2)
  for name in ("q", "k", "v"):
    assert two[f"{name}/kernel"] == (None, "fsdp", t) and two[f"{name}/lora_b"] == (None, None, t)
    assert two[f"{name}/bias"] == (None, t)
  assert two["o/kernel"] == (None, t, "fsdp") and two["o/lora_a"] == (None, t, None)
  eight = _attn_specs(cfg, tensor=8)  # 4 query heads over 8: q and o whole too
  assert all(spec == rep for path, spec in eight.items() if path.endswith("kernel"))


def _flat_rule(box, mesh):
  """The rule before heads were units: a dim splits whenever its mesh axes divide it."""
  axes = nn.logical_to_mesh_axes(box.names, mesh_lib.DEFAULT_RULES)
  size = lambda a: 1 if a is None else math.prod(
      mesh.shape[n] for n in (a if isinstance(a, tuple) else (a,)))
  return tuple(a if size(a) > 1 and d % size(a) == 0 else None
               for d, a in zip(box.value.shape, axes))


@pytest.mark.parametrize("preset", ["tiny", "small", "base_100m", "qwen2_5_7b"])
@pytest.mark.parametrize("fsdp,tensor", [(1, 1), (2, 2), (1, 4), (2, 4), (1, 8)])
def test_head_rule_keeps_every_sharding_where_tensor_divides_the_heads(preset, fsdp, tensor):
  """No regression in memory per device: where the tensor axis divides both head counts,
  every param (LoRA and biases included) is split exactly as the flat-dim rule split it;
  where it does not, only attention params differ, and they are replicated on tensor."""
  cfg = get_preset(preset, lora_rank=4, qkv_bias=True)
  sizes = (1, fsdp, tensor)
  mesh = AbstractMesh(sizes, mesh_lib.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
  boxed = abstract_params(cfg)
  is_box = lambda x: isinstance(x, nn.Partitioned)
  flat = jax.tree.map(lambda b: _flat_rule(b, mesh), boxed, is_leaf=is_box)
  got = jax.tree.map(lambda s: tuple(s.spec), mesh_lib.param_shardings(boxed, mesh))
  changed = [jax.tree_util.keystr(path) for (path, g), f in zip(
      jax.tree_util.tree_leaves_with_path(got, is_leaf=lambda x: isinstance(x, tuple)),
      jax.tree.leaves(flat, is_leaf=lambda x: isinstance(x, tuple))) if g != f]
  if cfg.n_heads % tensor == 0 and cfg.n_kv_heads % tensor == 0:
    assert changed == []
  else:
    assert changed and all("['attn']" in path for path in changed), changed
    for path, spec in jax.tree_util.tree_leaves_with_path(
        got, is_leaf=lambda x: isinstance(x, tuple)):
      if jax.tree_util.keystr(path) in changed:
        assert "tensor" not in spec, (path, spec)
