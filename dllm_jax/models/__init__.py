"""Model family: config, attention patterns, K/V cache and the transformer.

The config (`ModelConfig`, `get_preset`, `PRESETS`) imports no JAX, so a config file loads
without it; the JAX-side names load on first use (PEP 562).
"""

from __future__ import annotations

import importlib

from dllm_jax.models.config import PRESETS, ModelConfig, get_preset

_LAZY = {"KVCache": "kv_cache", "init_cache": "kv_cache", "ATTENTION_KINDS": "masks",
         "NO_KEY": "masks", "Transformer": "transformer", "abstract_params": "transformer",
         "forward": "transformer", "init_params": "transformer"}

__all__ = ["PRESETS", "ModelConfig", "get_preset", *_LAZY]


def __getattr__(name: str):
  if name in _LAZY:
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))
