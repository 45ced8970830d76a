"""Meshes, logical-axis sharding rules, and placing params on a mesh.

The lowest layer: it imports nothing from `models` or above (the models build on it), so
`place_params` takes the abstract params from its caller.

`axes` (mesh axis names, `DEFAULT_RULES`) imports no JAX; the rest loads on first use (PEP 562).
"""

from __future__ import annotations

from dllm_jax import _lazy
from dllm_jax.parallel.axes import DEFAULT_RULES

_LAZY = {"mesh": None, "sharding": None, "make_mesh": "mesh", "param_shardings": "mesh",
         "place_params": "sharding"}

__all__ = ["DEFAULT_RULES", "make_mesh", "mesh", "param_shardings", "place_params"]

__getattr__, __dir__ = _lazy.attach(__name__, _LAZY)
