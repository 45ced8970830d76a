"""Training: `train(config, workdir)` and `load_params(workdir)`, plus the modules behind them
(config, experiment, trainer, step, state, optimizer, checkpoint, metrics, data, accuracy).

Modules and the two functions load on first use, so importing the package is cheap.
"""

from __future__ import annotations

from dllm_jax import _lazy

MODULES = ("accuracy", "checkpoint", "config", "data", "experiment", "metrics", "optimizer",
           "quiet", "state", "step", "trainer")
_FUNCTIONS = {"train": "trainer", "load_params": "checkpoint"}

__all__ = [*MODULES, *_FUNCTIONS]

__getattr__, __dir__ = _lazy.attach(__name__, {**dict.fromkeys(MODULES), **_FUNCTIONS})
