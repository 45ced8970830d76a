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
