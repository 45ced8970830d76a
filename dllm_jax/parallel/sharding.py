"""Placing a params tree on a mesh: `shard_params(params, cfg, mesh, rules=None)`.

Each leaf goes to the `NamedSharding` that `mesh.param_shardings` gives its logical axes (the
placement `models.init_params(..., mesh=mesh)` creates directly). A leaf already placed
that way is returned as it is: no copy, no transfer.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.sharding import Mesh

from dllm_jax.parallel import mesh as mesh_lib


def _name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def shard_params(params, cfg, mesh: Mesh, rules=None):
  """`params` (NumPy or jax arrays, any placement) placed on `mesh` under `rules`
  (default `mesh.DEFAULT_RULES`); raises ValueError naming a leaf the model `cfg` lacks,
  is missing or has another shape."""
  # Imported here: models.transformer itself imports parallel.mesh.
  from dllm_jax.models.transformer import abstract_params

  boxed = abstract_params(cfg)
  targets = mesh_lib.param_shardings(boxed, mesh, mesh_lib.rules_from_config(rules))
  expected = {_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(nn.unbox(boxed))}
  given = {_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
  extra, missing = sorted(set(given) - set(expected)), sorted(set(expected) - set(given))
  if extra or missing:
    raise ValueError(f"params do not match the model config {cfg.name!r}: extra leaves "
                     f"{extra[:5]}, missing leaves {missing[:5]}; pass the config the params "
                     "were made for.")
  for name, leaf in given.items():
    if tuple(leaf.shape) != tuple(expected[name].shape):
      raise ValueError(f"param {name!r} is {tuple(leaf.shape)} but the model config "
                       f"{cfg.name!r} makes it {tuple(expected[name].shape)}.")

  def place(leaf, sharding):
    if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
      return leaf
    return jax.device_put(leaf, sharding)

  return jax.tree.map(place, params, targets)
