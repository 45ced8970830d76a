"""A test-sized run learns: AR and MDM on 2-digit addition cut the loss far below its start.

The tiny model's first loss is about log(vocab) = 4.2 nats; 200 steps of batch 16 bring the
held-out loss near 1. The config matches the resume tests' (constant schedule), so with the
compile cache a run here reuses their compiled step.
"""

import math

import pytest

from dllm_jax.training import metrics as metrics_lib
from dllm_jax.training import trainer

pytestmark = pytest.mark.usefixtures("compile_cache")


@pytest.mark.slow
@pytest.mark.parametrize("objective,options", [("ar", {}), ("mdm", {"sft": True})])
def test_loss_falls_well_below_its_start(tiny_config, tmp_path, objective, options):
  config = tiny_config(objective, **options)
  config.train.steps, config.train.ckpt_every = 200, 0
  final = trainer.train(config, str(tmp_path))
  losses = [r["loss"] for r in metrics_lib.read_metrics(tmp_path, "train")]
  assert len(losses) == 200
  assert losses[0] == pytest.approx(math.log(64), abs=0.3)  # untrained: ~uniform over vocab
  assert final["eval/loss"] < 0.35 * losses[0]
  assert max(losses[-20:]) < 0.5 * losses[0]
  assert final["eval/accuracy"] > 0.5  # masked / next-token top-1 accuracy on held-out rows


@pytest.mark.parametrize("objective,options", [("ar", {}), ("mdm", {"sft": True})])
def test_unrolled_train_step_matches_the_scanned_one(tiny_config, objective, options):
  """train.unroll_layers runs the same products without the layer scan: three steps on one
  batch give the scanned run's params, and the compiled step lost the layer loops."""
  import jax
  import numpy as np

  from dllm_jax.training import data as data_lib
  from dllm_jax.training import experiment as exp_lib
  from dllm_jax.training import state as state_lib

  runs = {}
  for unroll in (False, True):
    config = tiny_config(objective, **options)
    config.train.unroll_layers = unroll
    exp = exp_lib.build(config)
    step = trainer.compile_train_step(exp)
    it = data_lib.train_iterator(data_lib.make_sources(config.data)[0], exp.layout,
                                 int(config.train.batch_size), 0)
    batch = data_lib.to_global(next(it), exp.batch_shardings)
    state, _ = state_lib.init_state(exp.model_cfg, exp.tx, jax.random.PRNGKey(0), exp.mesh,
                                    exp.rules, config.opt.trainable, exp.shardings)
    for _ in range(3):
      state, metrics = step(state, batch)
    runs[unroll] = state.params, metrics, step.as_text()
  loops = {unroll: text.count(" while(") for unroll, (_, _, text) in runs.items()}
  assert loops[True] < loops[False]  # the layer scan (forward and backward) is gone
  np.testing.assert_allclose(runs[True][1]["loss"], runs[False][1]["loss"], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               runs[True][0], runs[False][0])
