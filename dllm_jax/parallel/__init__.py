"""Meshes, logical-axis sharding rules, and placing params on a mesh.

`axes` (mesh axis names, `DEFAULT_RULES`) imports no JAX; the rest loads on first use (PEP 562).
"""

from __future__ import annotations

import importlib

from dllm_jax.parallel.axes import DEFAULT_RULES

_LAZY = {"mesh": None, "sharding": None, "make_mesh": "mesh", "param_shardings": "mesh",
         "shard_params": "sharding"}

__all__ = ["DEFAULT_RULES", "make_mesh", "mesh", "param_shardings", "shard_params"]


def __getattr__(name: str):
  if name in _LAZY:
    module = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))
