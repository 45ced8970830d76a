"""Two processes on loopback (2 CPU devices each) train together and checkpoint together.

Each process builds its own rows (`BatchIterator` shard p of 2), the global batch is
assembled with `make_array_from_process_local_data`, both run one SPMD program (one loss),
and the checkpoint records both processes' data positions.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                           process_id=int(sys.argv[2]))
sys.path.insert(0, "tests")
from conftest import tiny_training_config
from dllm_jax.training import trainer

config = tiny_training_config("ar")
config.mesh.shape = {"data": 4}
config.train.steps, config.train.ckpt_every = int(sys.argv[4]), 2
losses = []
trainer.train(config, sys.argv[3], step_callback=lambda s, m: losses.append(m["loss"]))
print("RESULT" + json.dumps({"devices": jax.device_count(), "losses": losses}))
"""


def _run_pair(workdir, steps):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(2))
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, f"127.0.0.1:{port}", str(i),
                             workdir, str(steps)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
           for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-4000:]
  return [json.loads(out.split("RESULT", 1)[1]) for out, _ in outs]


@pytest.mark.slow
def test_two_processes_train_and_checkpoint(tmp_path):
  results = _run_pair(str(tmp_path), 2)
  assert [r["devices"] for r in results] == [4, 4]
  assert len(results[0]["losses"]) == 2
  assert results[0]["losses"] == results[1]["losses"]  # one global program, one loss
  with open(tmp_path / "checkpoints" / "2" / "data" / "metadata") as f:
    states = json.load(f)["process_states"]
  assert [s["process_index"] for s in states] == [0, 1]
  assert all(s["position"] == 2 * 8 for s in states)  # 2 steps of 16 rows, 8 per process
