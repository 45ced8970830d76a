"""Device mesh and logical-axis sharding rules.

Parameters carry logical axis names (`embed`, `heads`, `kv_heads`, `mlp`, `vocab`, `layers`,
`norm`, `lora`); activations and decode state use `batch`, `length`, `cache_len`, `head_dim`.
A config maps them onto mesh axes (`data`, `fsdp`, `tensor`). The same code then runs on one
CPU, 8 fake CPU devices, a GPU or a TPU slice: only the mesh shape changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Re-exported: mesh.MESH_AXES, mesh.DEFAULT_RULES and mesh.rules_from_config are these.
from dllm_jax.parallel.axes import DEFAULT_RULES, MESH_AXES, rules_from_config


def make_mesh(shape: dict[str, int] | Sequence[int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a (data, fsdp, tensor) mesh.

  `shape` is a dict such as {"data": 2, "fsdp": 2, "tensor": 2}; axes left out are 1, and
  one axis may be -1 to take the remaining devices. Default: all devices on `data`.
  """
  devices = list(jax.devices() if devices is None else devices)
  if shape is None:
    shape = {"data": -1}
  if not isinstance(shape, dict):
    shape = dict(zip(MESH_AXES, shape))
  unknown = sorted(set(shape) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"Unknown mesh axes {unknown}; valid axes are {MESH_AXES}.")
  sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError("At most one mesh axis may be -1.")
  if -1 in sizes:
    rest = int(np.prod([s for s in sizes if s != -1]))
    if len(devices) % rest:
      raise ValueError(f"{len(devices)} devices cannot be split by fixed axes of size {rest}.")
    sizes[sizes.index(-1)] = len(devices) // rest
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(
        f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices but "
        f"{len(devices)} are available; change the mesh shape in the config.")
  return jax.make_mesh(tuple(sizes), MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def logical_to_sharding(logical_tree, mesh: Mesh, rules=DEFAULT_RULES):
  """Tree of logical axis tuples (or nn.Partitioned leaves) -> tree of NamedSharding.

  Axes whose mesh size does not divide the dimension are replicated rather than failing.
  """
  return nn.logical_to_mesh_sharding(logical_tree, mesh, rules)


def param_shardings(abstract_boxed_params, mesh: Mesh, rules=DEFAULT_RULES):
  """Shardings for a params tree from `jax.eval_shape(init)` (boxed with logical names).

  Dimensions that a mesh axis does not divide stay replicated on that axis.
  """
  specs = nn.get_partition_spec(abstract_boxed_params)
  shapes = nn.unbox(abstract_boxed_params)

  def to_sharding(spec, shape):
    mesh_spec = nn.logical_to_mesh_axes(tuple(spec), rules)
    fixed = []
    for dim, axes in zip(shape.shape, tuple(mesh_spec) + (None,) * (len(shape.shape) - len(mesh_spec))):
      names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
      size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
      fixed.append(axes if size > 1 and dim % size == 0 else None)
    return NamedSharding(mesh, P(*fixed))

  return jax.tree.map(to_sharding, specs, shapes, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh, ndim: int = 2, rules=DEFAULT_RULES) -> NamedSharding:
  """Sharding of a [B, ...] array: batch over the rule's axes, the rest replicated."""
  batch_axes = nn.logical_to_mesh_axes(("batch",), rules)[0]
  return NamedSharding(mesh, P(batch_axes, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def data_parallel_size(mesh: Mesh, rules=DEFAULT_RULES) -> int:
  axes = nn.logical_to_mesh_axes(("batch",), rules)[0]
  names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
  return int(np.prod([mesh.shape[a] for a in names])) if names else 1


def data_axes(mesh: Mesh, rules=DEFAULT_RULES) -> tuple[str, ...]:
  """The mesh axes the batch is split over (the `batch` rule's axes of size > 1)."""
  axes = nn.logical_to_mesh_axes(("batch",), rules)[0]
  names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
  return tuple(a for a in names if mesh.shape[a] > 1)


# Logical axes of activations and state, not of parameters (for `default_data_parallel`).
_NON_PARAM_AXES = ("batch", "length", "cache_len")


def default_data_parallel(mesh: Mesh, rules=DEFAULT_RULES) -> str:
  """The decoding drivers' default data-parallel mode on `mesh`: "shard_map" (one loop per
  data shard, each to its own exit) when the mesh splits the batch and no parameter is
  sharded over the batch's axes; "spmd" otherwise. A parameter sharded over a batch axis (the
  `embed` rule on fsdp) would be gathered whole onto every device of a shard_map loop, so an
  {fsdp: 8} mesh keeps 1/8 of the weights per device only as one SPMD program."""
  split = set(data_axes(mesh, rules))
  if not split:
    return "spmd"
  for logical, physical in rules:
    if logical in _NON_PARAM_AXES or physical is None:
      continue
    if split & set(physical if isinstance(physical, tuple) else (physical,)):
      return "spmd"
  return "shard_map"


def without_axes(rules, axes: Sequence[str]) -> tuple:
  """`rules` with the mesh axes `axes` removed from every mapping (a logical axis left with
  none is replicated). Inside a `shard_map` that is manual over `axes`, these rules shard
  parameters and activations over the remaining (automatic) axes only."""
  drop = set(axes)
  out = []
  for logical, physical in rules:
    names = () if physical is None else (physical if isinstance(physical, tuple) else
                                         (physical,))
    kept = tuple(a for a in names if a not in drop)
    out.append((logical, None if not kept else kept[0] if len(kept) == 1 else kept))
  return tuple(out)

