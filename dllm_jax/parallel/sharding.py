"""Placing a params tree on a mesh: `place_params(params, mesh, rules, abstract=...)`.

Each leaf goes to the `NamedSharding` that `mesh.param_shardings` gives its logical axes (the
placement `models.init_params(..., mesh=mesh)` creates directly). The logical axes come from
the caller's abstract params (`models.abstract_params(cfg)`): this layer sits below the
models and imports none of them.

A tree whose arrays all lie on exactly the mesh's devices is returned as it is, whatever its
layout (jit reshards inside the program if it must); otherwise every leaf not already placed
as the rules say is moved (a leaf already placed that way is kept: no copy, no transfer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dllm_jax.parallel import mesh as mesh_lib


def _name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def on_mesh(params, mesh: Mesh) -> bool:
  """True when every leaf is a jax.Array on exactly the mesh's devices (any layout)."""
  devices = set(mesh.devices.flat)
  leaves = jax.tree_util.tree_leaves(params)
  return bool(leaves) and all(isinstance(x, jax.Array) and x.sharding.device_set == devices
                              for x in leaves)


def _check_against(params, abstract) -> None:
  expected = {_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(nn.unbox(abstract))}
  given = {_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
  extra, missing = sorted(set(given) - set(expected)), sorted(set(expected) - set(given))
  if extra or missing:
    raise ValueError(f"params do not match the abstract params (the model config's): extra "
                     f"leaves {extra[:5]}, missing leaves {missing[:5]}; pass the abstract "
                     "params of the config the params were made for.")
  for name, leaf in given.items():
    if tuple(np.shape(leaf)) != tuple(expected[name].shape):
      raise ValueError(f"param {name!r} is {tuple(np.shape(leaf))} but the model config's "
                       f"abstract params make it {tuple(expected[name].shape)}; pass the "
                       "abstract params of the config the params were made for.")


def _global(x, sharding: NamedSharding) -> jax.Array:
  """A host value (the same on every process) as a global array with `sharding`."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def place_params(params, mesh: Mesh, rules=None, *,
                 abstract: Any | Callable[[], Any] | None = None,
                 replicate_axes: Sequence[str] = ()):
  """`params` (NumPy or jax arrays, any placement) on `mesh`.

  Args:
    params: the params tree.
    mesh: a `mesh.make_mesh` mesh.
    rules: logical-axis rules (default `mesh.DEFAULT_RULES`; a config's list of pairs works).
    abstract: the params' boxed abstract tree, with logical axis names (what
      `models.abstract_params(cfg)` gives), or a function of no arguments returning it,
      called only when something must move. Needed unless `params` is already on the mesh.
    replicate_axes: mesh axes the params are replicated over instead of sharded: a
      `shard_map` that is manual over the data axes passes `mesh.data_axes(mesh, rules)`,
      so every data shard holds the whole (otherwise sharded) model.
  Returns:
    `params` itself when every leaf already lies on exactly the mesh's devices (any layout);
    else the tree with each leaf on its `mesh.param_shardings` sharding (leaves already
    placed so are kept). On several processes the values must be the same on all of them.
  Raises:
    ValueError: a leaf the abstract tree lacks, is missing or has another shape; an unknown
      replicate axis; `abstract` missing when something must move.
  """
  if on_mesh(params, mesh):
    return params
  unknown = sorted(set(replicate_axes) - set(mesh.axis_names))
  if unknown:
    raise ValueError(f"replicate_axes {unknown} are not axes of the mesh {mesh.axis_names}.")
  if abstract is None:
    raise ValueError("params are not on the mesh's devices, so they must be placed: pass "
                     "abstract= (models.abstract_params(cfg), or a function returning it).")
  if callable(abstract):
    abstract = abstract()
  _check_against(params, abstract)
  rules = mesh_lib.rules_from_config(rules)
  if replicate_axes:
    rules = mesh_lib.without_axes(rules, replicate_axes)
  targets = mesh_lib.param_shardings(abstract, mesh, rules)

  leaves, treedef = jax.tree_util.tree_flatten(params)
  shardings = treedef.flatten_up_to(targets)
  move = [i for i, (x, s) in enumerate(zip(leaves, shardings))
          if not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim))]
  if jax.process_count() == 1:
    moved = jax.device_put([leaves[i] for i in move], [shardings[i] for i in move])
  else:  # a global array from every process's (identical) host copy
    moved = [_global(leaves[i], shardings[i]) for i in move]
  for i, x in zip(move, moved):
    leaves[i] = x
  return jax.tree_util.tree_unflatten(treedef, leaves)
