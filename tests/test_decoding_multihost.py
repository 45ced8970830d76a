"""Decoding and a train step across 2 processes on loopback equal 1 process.

Two processes (4 fake CPU devices each, gloo collectives, coordinator on 127.0.0.1) form one
8-device mesh. Both pass the same prompts to `generate` (shard_map data parallelism over the
8 devices) and both get the whole output; a one-step training run gives one loss. A third
process with 8 local devices computes the same decodes and loss as the reference.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORK = r"""
import json, sys
import jax
if sys.argv[1] != "single":  # argv: coordinator, process id, workdir (shared by both)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                             process_id=int(sys.argv[2]), initialization_timeout=120)
sys.path.insert(0, "tests")
sys.path.insert(0, "experiments")  # studylib: the study's modules
import numpy as np
from conftest import tiny_training_config
from dllm_jax.decoding import api
from dllm_jax.models import get_preset
from dllm_jax.parallel import mesh as mesh_lib
from dllm_jax.training import trainer
from studylib import dp_bench

cfg = get_preset("tiny")
params = dp_bench.random_params(cfg)
mesh = mesh_lib.make_mesh({"data": 8})
prompts = [[5 + i, 9, 11 + 2 * i][: 1 + i % 3] for i in range(6)]
result = {"devices": jax.device_count(), "local": jax.local_device_count()}
for method, kw in {"ar": dict(gen_length=8, temperature=1.0),
                   "d2f": dict(gen_length=8, block_length=4, temperature=1.0)}.items():
  out = api.generate(params, cfg, prompts, method=method, rng=jax.random.key(4), mesh=mesh,
                     **kw)
  result[method] = np.asarray(out.tokens).tolist()
config = tiny_training_config("ar")
config.mesh.shape = {"data": 8}
config.train.steps, config.train.ckpt_every = 1, 0
losses = []
trainer.train(config, sys.argv[3], step_callback=lambda s, m: losses.append(m["loss"]))
result["losses"] = [float(x) for x in losses]
print("RESULT" + json.dumps(result))
"""


def _run(args, devices):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))  # all 3 alike
  return subprocess.Popen([sys.executable, "-c", WORK, *args], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(proc):
  try:
    out, err = proc.communicate(timeout=900)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise
  assert proc.returncode == 0, err[-4000:]
  return json.loads(out.split("RESULT", 1)[1])


@pytest.mark.slow
def test_two_processes_decode_and_train_like_one(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  pair = [_run([f"127.0.0.1:{port}", str(i), str(tmp_path / "pair")], 4) for i in range(2)]
  results = [_result(p) for p in pair]
  single = _result(_run(["single", "0", str(tmp_path / "single")], 8))
  assert [(r["devices"], r["local"]) for r in results] == [(8, 4), (8, 4)]
  assert (single["devices"], single["local"]) == (8, 8)
  for method in ("ar", "d2f"):
    assert results[0][method] == results[1][method] == single[method], method
  assert len(single["losses"]) == 1
  np.testing.assert_allclose(results[0]["losses"], single["losses"], rtol=1e-5)
  assert results[0]["losses"] == results[1]["losses"]
