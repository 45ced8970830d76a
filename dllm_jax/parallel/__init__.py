"""Meshes, logical-axis sharding rules, and placing params on a mesh.

`axes` (mesh axis names, `DEFAULT_RULES`) imports no JAX; the rest loads on first use (PEP 562).
"""

from __future__ import annotations

from dllm_jax import _lazy
from dllm_jax.parallel.axes import DEFAULT_RULES

_LAZY = {"mesh": None, "sharding": None, "make_mesh": "mesh", "param_shardings": "mesh",
         "shard_params": "sharding"}

__all__ = ["DEFAULT_RULES", "make_mesh", "mesh", "param_shardings", "shard_params"]

__getattr__, __dir__ = _lazy.attach(__name__, _LAZY)
