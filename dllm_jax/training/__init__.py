"""Training: `train(config, workdir)` and `load_params(workdir)`, plus the modules behind them
(config, experiment, trainer, step, state, optimizer, checkpoint, metrics, data, accuracy).

Modules and the two functions load on first use, so importing the package is cheap.
"""

from __future__ import annotations

import importlib

MODULES = ("accuracy", "checkpoint", "config", "data", "experiment", "metrics", "optimizer",
           "quiet", "state", "step", "trainer")
_FUNCTIONS = {"train": "trainer", "load_params": "checkpoint"}

__all__ = [*MODULES, *_FUNCTIONS]


def __getattr__(name: str):
  if name in MODULES:
    return importlib.import_module(f"{__name__}.{name}")
  if name in _FUNCTIONS:
    return getattr(importlib.import_module(f"{__name__}.{_FUNCTIONS[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
