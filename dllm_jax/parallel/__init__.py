"""Meshes, logical-axis sharding rules, and placing params on a mesh."""

from dllm_jax.parallel import mesh
from dllm_jax.parallel.mesh import DEFAULT_RULES, make_mesh, param_shardings
from dllm_jax.parallel.sharding import shard_params

__all__ = ["DEFAULT_RULES", "make_mesh", "mesh", "param_shardings", "shard_params"]
