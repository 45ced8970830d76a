"""One train step on 8 fake CPU devices (data=2, fsdp=2, tensor=2) equals the 1-device step.

Runs in a subprocess (XLA_FLAGS must be set before JAX starts). The step is the trainer's own
compiled, donating, sharded `train_step`, with gradient accumulation over 2 micro-batches and
the MDM objective, so the noise draw, the micro-batch split and the optimizer all run
sharded. Parameters start identical (initialised on one device, then resharded).
"""

import json

import pytest

CODE = r"""
import json
import jax, numpy as np
from dllm_jax.training import config as config_lib, data as data_lib, experiment, trainer
from dllm_jax.training import state as state_lib

def make_config(mesh):
  c = config_lib.base_config()
  c.model.preset = "tiny"
  c.data.tasks, c.data.train_size, c.data.eval_size = "arithmetic:1", 256, 64
  c.objective.name, c.objective.options = "mdm", {"sft": True}
  c.opt.lr, c.opt.schedule, c.opt.warmup_steps, c.opt.grad_accum = 1e-3, "constant", 0, 2
  c.train.batch_size = 16
  c.mesh.shape = mesh
  return config_lib.finalize(c)

one = experiment.build(make_config({"data": 1}), devices=jax.devices()[:1])
eight = experiment.build(make_config({"data": 2, "fsdp": 2, "tensor": 2}))
assert eight.mesh.devices.size == 8

state1, _ = state_lib.init_state(one.model_cfg, one.tx, jax.random.PRNGKey(0), one.mesh,
                                 one.rules, shardings=one.shardings)
state8 = jax.device_put(jax.tree.map(np.asarray, state1), eight.shardings)  # fresh buffers
before = jax.tree.map(np.asarray, state1.params)
source, _ = data_lib.make_sources(one.config.data)
local = next(data_lib.train_iterator(source, one.layout, 16, seed=0))

out = {}
for name, exp, state in (("one", one, state1), ("eight", eight, state8)):
  batch = data_lib.to_global(local, exp.batch_shardings)
  new_state, metrics = trainer.compile_train_step(exp)(state, batch)
  out[name] = {"metrics": {k: float(v) for k, v in metrics.items()},
               "params": [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(new_state.params)],
               "step": int(new_state.step)}
  if name == "eight":
    q = new_state.params["layers"]["attn"]["q"]["kernel"]
    out["q_spec"] = str(q.sharding.spec)
    out["q_shards"] = len({str(s.index) for s in q.addressable_shards})
    out["batch_spec"] = str(batch["tokens"].sharding.spec)
out["moved"] = max(float(np.max(np.abs(np.asarray(a).ravel() - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(before), out["one"]["params"]))
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_eight_device_step_matches_one_device(run_devices):
  stdout = run_devices(CODE, devices=8)
  out = json.loads(stdout.split("RESULT", 1)[1])
  # The 8-device run really is sharded: params over fsdp x tensor, the batch over data x fsdp.
  assert out["q_spec"] == "P(None, 'fsdp', 'tensor')"
  assert out["q_shards"] == 4
  assert out["batch_spec"] == "P(('data', 'fsdp'), None)"
  assert out["moved"] > 5e-4  # the step changed the params (Adam moves them by ~lr)
  one, eight = out["one"], out["eight"]
  assert one["step"] == eight["step"] == 1
  assert one["metrics"].keys() == eight["metrics"].keys()
  for key, value in one["metrics"].items():
    assert eight["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
  for a, b in zip(one["params"], eight["params"]):
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5
