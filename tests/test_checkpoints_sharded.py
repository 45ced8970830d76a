"""Sharded loading on 8 fake CPU devices, and host memory during a load.

Both run in fresh subprocesses: the device count must be set before JAX starts, and peak
RSS must be measured in a process that has not loaded anything big before.
"""

import json
import os
import subprocess
import sys

import pytest

from dllm_jax.checkpoints import testing as ckt

SHARDED = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from dllm_jax.checkpoints import load_converted, load_pretrained, save_converted
from dllm_jax.checkpoints import testing as ckt
from dllm_jax.models import forward
from dllm_jax.parallel.mesh import make_mesh

assert jax.device_count() == 8, jax.devices()
root = sys.argv[1]
w = ckt.random_weights(vocab=64, d=32, layers=2, heads=4, kv_heads=2, mlp=64, qkv_bias=True)
ckt.write_tensors(root + "/hf", ckt.qwen_tensors(w), ckt.qwen_config(
    w, heads=4, kv_heads=2, model_type="Dream", mask_token_id=63), max_shard_bytes=20000)
mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
cfg, sharded = load_pretrained(root + "/hf", dtype="float32", mesh=mesh)
_, single = load_pretrained(root + "/hf", dtype="float32")

q = sharded["layers"]["attn"]["q"]["kernel"]
embed = sharded["embed"]["embedding"]
assert q.sharding.spec == P(None, "fsdp", "tensor"), q.sharding
assert q.addressable_shards[0].data.shape == (2, 16, 16)
assert embed.sharding.spec == P("tensor", "fsdp"), embed.sharding
split = [p for p, x in jax.tree_util.tree_leaves_with_path(sharded)
         if not x.sharding.is_fully_replicated]
leaves = jax.tree.leaves(sharded)
for a, b in zip(leaves, jax.tree.leaves(single)):
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

# Leaves equal the single-device load exactly; so do the logits, up to reduction order.
tokens = np.random.default_rng(0).integers(0, 64, (4, 8))
run = jax.jit(lambda p, t: forward(p, cfg, t, attention="bidirectional"))
logits = np.asarray(run(sharded, tokens))
diff = float(np.abs(logits - np.asarray(run(single, tokens))).max())
ref = ckt.reference_logits(w, tokens, heads=4, kv_heads=2, rope_theta=10000.0, eps=1e-6,
                           causal=False, shift=True)
assert diff <= 1e-5 and np.abs(logits - ref).max() <= 1e-4, (diff, np.abs(logits - ref).max())

save_converted(root + "/converted", cfg, single)
cfg2, restored = load_converted(root + "/converted", mesh=mesh)
assert cfg2 == cfg
for a, b in zip(jax.tree.leaves(restored), leaves):
  assert a.sharding == b.sharding, (a.sharding, b.sharding)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
print(json.dumps({"split": len(split), "leaves": len(leaves), "logit_diff": diff}))
"""

MEMORY = r"""
import ctypes, gc, json, re, sys, tempfile
root, mode = sys.argv[1], sys.argv[2]

def status(key):
  for line in open("/proc/self/status"):
    if line.startswith(key):
      return int(line.split()[1]) * 1024

if mode == "ours":
  import jax
  from dllm_jax.checkpoints import load_pretrained
  from dllm_jax.checkpoints import testing as ckt
  with tempfile.TemporaryDirectory() as tiny:  # start the runtime: not part of a load
    w = ckt.random_weights(vocab=64, d=32, layers=1, heads=4, kv_heads=4, mlp=64)
    ckt.write_tensors(tiny, ckt.qwen_tensors(w), ckt.qwen_config(w, heads=4, kv_heads=4,
                                                                 model_type="llama"))
    load_pretrained(tiny, dtype="float32")
  gc.collect()
  # A first load of the same shapes compiles the placement helpers (XLA compile memory is not a
  # copy of the model); its buffers are then freed, and `retained` checks they really went back
  # to the OS (what is left is live: compiled programs, caches), so the measured load below
  # cannot hide a second copy in freed pages.
  before = status("VmRSS")
  jax.block_until_ready(jax.tree.leaves(load_pretrained(root, dtype="float32")[1]))
  gc.collect()
  ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS: it cannot hide a copy
  retained = status("VmRSS") - before
  open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
  base = status("VmRSS")
  cfg, params = load_pretrained(root, dtype="float32")
  kept = sum(x.nbytes for x in jax.block_until_ready(jax.tree.leaves(params)))
else:  # the naive way: read the whole file, then stack layers on the host
  import numpy as np
  from safetensors.numpy import load_file
  open("/proc/self/clear_refs", "w").write("5")
  base = status("VmRSS")
  retained = 0
  tensors = load_file(root + "/model.safetensors")
  groups = {}
  for name, value in tensors.items():
    groups.setdefault(re.sub(r"\.\d+\.", ".", name), []).append(value.T)
  kept = sum(np.stack(v).nbytes for v in groups.values())
print(json.dumps({"growth": status("VmHWM") - base, "kept": kept, "retained": retained}))
"""


def _run(code, *args, devices=1, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else None


def test_sharded_load_matches_single_device(tmp_path):
  result = _run(SHARDED, tmp_path, devices=8)
  assert result["split"] >= result["leaves"] // 2  # most leaves really are split
  assert result["logit_diff"] <= 1e-5


def _writable_clear_refs():
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


@pytest.mark.skipif(not _writable_clear_refs(), reason="needs Linux /proc/self/clear_refs")
def test_load_never_holds_a_second_copy_of_the_model(tmp_path):
  """32 layers, 135 MB in float32; the largest tensor is 1 MB, the largest stacked leaf 32 MB.

  On the CPU backend device buffers are host memory, so the loaded params themselves count in
  RSS; what must stay small is the growth beyond them (read buffers, one layer slice,
  compiled helpers). Reading the file and stacking on the host, the control, costs a full
  second copy.
  """
  w = ckt.random_weights(vocab=256, d=256, layers=32, heads=4, kv_heads=4, mlp=1024)
  ckt.write_tensors(tmp_path, ckt.qwen_tensors(w), ckt.qwen_config(
      w, heads=4, kv_heads=4, model_type="llama"))
  del w
  ours = _run(MEMORY, tmp_path, "ours")
  naive = _run(MEMORY, tmp_path, "naive")
  model = ours["kept"]
  assert model > 100e6
  assert naive["growth"] - naive["kept"] > 0.8 * model, naive  # the measurement can fail
  assert ours["retained"] < 0.3 * model, ours  # the warm-up load's memory was given back
  assert ours["growth"] - model < 0.3 * model, (ours, model)
