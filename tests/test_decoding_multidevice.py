"""Decoding on 8 fake CPU devices gives exactly the 1-device tokens, for every method.

Runs in ONE subprocess for the whole module (XLA reads the device count once, at import; a
second interpreter would import JAX and compile the shared 1-device programs again). The
subprocess prints one line per check; each test asserts on its own lines.

First part: the batch of 3 rows is padded to the data-parallel size 4 by `generate`;
sampling at temperature > 0 checks that a row's random keys do not depend on the padding or
the sharding, and with top-k / top-p that the vocabulary sorts (over a `tensor`-sharded
vocabulary) put no collective over every device into a shard's loop: the shards' loops run
different trip counts under shard_map, so such a collective deadlocks. The diffusion methods rank with batch_invariant=True (the grid) in both parts:
the default ranks exact scores, as the references do, and promises no mesh invariance.

Second part: the model's own random init, whose confidences nearly tie (entropy noise across
batch sizes and meshes is ~1e-6): every row alone, in a batch of 4 and on a
{data: 2, tensor: 4} mesh must get the same tokens (batch_invariant: ranking on a grid,
lowest slot first),
and params already sharded on the mesh must be used where they are. Its 2 kv heads do not
split over tensor=4, so the k/v kernels keep whole heads and no shard's loop holds a
collective permute (RoPE's half swap over half-heads would be one). Its AR run uses the
first part's gen_length (12); it is greedy where the first part samples, so the two compile
separate 1-device programs.
"""

import pytest

from conftest import run_python

CODE = r"""
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
    "ar": dict(gen_length=12, temperature=1.0, top_k=10, top_p=0.9),
    "llada": dict(gen_length=16, block_length=8, steps=8, cfg_scale=1.0, temperature=0.7,
                  batch_invariant=True),
    "fast_dllm": dict(gen_length=16, block_length=8, threshold=0.5, cache="dual",
                      batch_invariant=True),
}
for method, kw in runs.items():
  rng = jax.random.key(5)
  one = api.generate(params, cfg, PROMPTS, method=method, rng=rng, **kw)
  many = api.generate(params, cfg, PROMPTS, method=method, rng=rng, mesh=mesh,
                      data_parallel="spmd", **kw)
  assert many.tokens.shape == one.tokens.shape, (method, many.tokens.shape)
  assert len(many.tokens.sharding.device_set) == 8, method
  for field in ("tokens", "lengths", "nfe", "steps", "committed", "done"):
    np.testing.assert_array_equal(np.asarray(getattr(many, field)),
                                  np.asarray(getattr(one, field)), err_msg=method + field)
  # shard_map (the default on a data axis; this mesh's fsdp axis makes spmd the default):
  # the same tokens; each shard stops with its own rows, so the largest shard's step count
  # is at most the whole batch's.
  own = api.generate(params, cfg, PROMPTS, method=method, rng=rng, mesh=mesh,
                     data_parallel="shard_map", **kw)
  assert len(own.tokens.sharding.device_set) == 8, method
  for field in ("tokens", "lengths", "committed", "done"):
    np.testing.assert_array_equal(np.asarray(getattr(own, field)),
                                  np.asarray(getattr(one, field)), err_msg=method + field)
  assert int(own.steps) <= int(one.steps) and int(own.nfe) <= int(one.nfe), method
  print("devices", method, "ok")

assert mesh_lib.default_data_parallel(mesh) == "spmd"  # params sharded over fsdp stay so
assert mesh_lib.default_data_parallel(mesh_lib.make_mesh({"data": 4, "tensor": 2})) == "shard_map"
assert mesh_lib.default_data_parallel(mesh_lib.make_mesh({"tensor": 8})) == "spmd"

# The hybrids on the same mesh (shard_map): sampled rows draw their keys by
# global row index, so each shard's rows equal the one-device batch's.
drafter = random_params(cfg, seed=1)
hybrids = {
    "speculative": dict(gen_length=8, drafter="ar", draft_length=3, temperature=0.8,
                        top_p=0.9, drafter_params=drafter, drafter_cfg=cfg),
    "selfspec": dict(gen_length=8, draft_length=3, temperature=0.8, top_k=20, top_p=0.9),
    "adaptive": dict(gen_length=8, draft_length=3, parallel_confidence=0.66,
                     ar_confidence=0.55, drafter_params=drafter, drafter_cfg=cfg),
}
# Greedy batches whose every row a tag forces into AR or VERIFY: that mode's own decoder
# (the AR one without the drafter's params).
for mode in ("ar", "verify"):
  hybrids["adaptive " + mode] = dict(gen_length=8, draft_length=3, drafter_params=drafter,
                                     drafter_cfg=cfg, task_modes={"t": mode},
                                     tasks=["t"] * len(PROMPTS))
for name, kw in hybrids.items():
  method = name.split()[0]
  rng = jax.random.key(5)
  one = api.generate(params, cfg, PROMPTS, method=method, rng=rng, **kw)
  own = api.generate(params, cfg, PROMPTS, method=method, rng=rng, mesh=mesh,
                     data_parallel="shard_map", **kw)
  assert len(own.tokens.sharding.device_set) == 8, method
  for field in ("tokens", "lengths", "committed", "done"):
    np.testing.assert_array_equal(np.asarray(getattr(own, field)),
                                  np.asarray(getattr(one, field)), err_msg=name + field)
  print("hybrids", name, "ok")

# The shard_map programs so far, by name (the module's fixture dumps them).
import glob, os, re
dump = re.search(r"--xla_dump_to=(\S+)", os.environ["XLA_FLAGS"]).group(1)
programs = lambda: {os.path.basename(p) for p in glob.glob(
    os.path.join(dump, "*_sharded*after_optimizations.txt"))}
first_parts = programs()
print("data_mesh_programs", *sorted(first_parts))

import flax.linen as nn
from dllm_jax.decoding import base
from dllm_jax.models import init_params

cfg = get_preset("tiny").replace(eos_token_id=None)
params = nn.unbox(init_params(cfg, jax.random.key(0)))
mesh = mesh_lib.make_mesh({"data": 2, "tensor": 4})
rules = mesh_lib.DEFAULT_RULES
from dllm_jax.models import abstract_params
abstract = lambda: abstract_params(cfg)
from dllm_jax.parallel import sharding
sharded = sharding.place_params(params, mesh, rules, abstract=abstract)
assert sharding.place_params(sharded, mesh, rules, abstract=abstract) is sharded
four = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20, 21, 22, 23]]
runs = {
    "ar": dict(gen_length=12),
    "llada": dict(gen_length=16, block_length=8, steps=8, batch_invariant=True),
    "dream": dict(gen_length=16, block_length=8, steps=8, batch_invariant=True),
    "fast_dllm": dict(gen_length=16, block_length=8, threshold=0.5, cache="dual",
                      batch_invariant=True),
    "d2f": dict(gen_length=16, block_length=4, remasking="entropy", tau_conf=0.7,
                tau_add=0.5, tau_act=0.5, batch_invariant=True),
    "block_diffusion": dict(gen_length=16, block_length=4, steps_per_block=2,
                            remasking="entropy", batch_invariant=True),
}
real_put = jax.device_put
leaves = {id(x) for x in jax.tree_util.tree_leaves(sharded)}
def put(x, *a, **k):
  assert not any(id(l) in leaves for l in jax.tree_util.tree_leaves(x)), "params re-placed"
  return real_put(x, *a, **k)
jax.device_put = put
for method, kw in runs.items():
  batch = np.asarray(api.generate(params, cfg, four, method=method, **kw).tokens)
  meshed = np.asarray(api.generate(sharded, cfg, four, method=method, mesh=mesh, **kw).tokens)
  np.testing.assert_array_equal(meshed, batch, err_msg=method + " mesh")
  for i, prompt in enumerate(four):  # every row alone: lengths 2..5 share one program
    alone = np.asarray(api.generate(params, cfg, [prompt], method=method, **kw).tokens)[0]
    np.testing.assert_array_equal(alone, batch[i], err_msg=f"{method} row {i} alone")
  print("invariance", method, "ok")

# The third part's shard_map programs (its mesh has 2 kv heads on a tensor axis of 4).
print("tensor4_programs", *sorted(programs() - first_parts))
"""


@pytest.fixture(scope="module")
def shard_programs(tmp_path_factory):
  """Where the subprocess dumps its shard_map programs (`data_parallel._sharded`) as text."""
  return tmp_path_factory.mktemp("shard_programs")


@pytest.fixture(scope="module")
def lines(shard_programs):
  """The subprocess's output lines, keyed by their first word (run once per module)."""
  dump = (f"--xla_dump_to={shard_programs} --xla_dump_hlo_as_text "
          "--xla_dump_hlo_module_re=.*_sharded.*")
  out = run_python(CODE, devices=8, timeout=2400.0, xla_extra=dump)  # 600 + 1800 s before
  by_part = {}
  for line in out.splitlines():
    part, *words = line.split()
    by_part.setdefault(part, []).extend(words)
  return by_part


@pytest.mark.slow
def test_eight_devices_equal_one(lines):
  assert lines["devices"] == ["ar", "ok", "llada", "ok", "fast_dllm", "ok"]


@pytest.mark.slow
def test_hybrids_on_a_data_mesh_equal_one_device(lines):
  assert lines["hybrids"] == ["speculative", "ok", "selfspec", "ok", "adaptive", "ok",
                             "adaptive", "ar", "ok", "adaptive", "verify", "ok"]


@pytest.mark.slow
def test_no_collective_permute_in_a_shards_program(lines, shard_programs):
  """The shards' loops run different trip counts, so a collective over every device in one
  (XLA:CPU's collective permute, e.g. a reversed `tensor`-sharded vocabulary) deadlocks when
  rows finish at different steps: none may be compiled into a shard_map decode
  (docs/decoders.md). That includes the third part's {data: 2, tensor: 4} mesh, where 2 kv
  heads cannot split over 4 devices: the k/v kernels keep whole heads (replicated on tensor)
  rather than half a head per device, whose RoPE half swap would move data between them."""
  names = lines["data_mesh_programs"]
  assert len(names) >= 6, names  # every shard_map run of the first two parts
  third = lines["tensor4_programs"]
  assert len(third) >= 6, third  # every method of the third part ran under shard_map
  for name in names + third:
    assert "collective-permute" not in (shard_programs / name).read_text(), name


@pytest.mark.slow
def test_near_ties_rank_the_same_alone_batched_and_on_a_mesh(lines):
  assert lines["invariance"] == [w for m in ("ar", "llada", "dream", "fast_dllm", "d2f",
                                             "block_diffusion") for w in (m, "ok")]
