"""Device mesh and logical-axis sharding rules.

Parameters carry logical axis names (`embed`, `heads`, `kv_heads`, `mlp`, `vocab`, `layers`,
`norm`, `lora`); activations and decode state use `batch`, `length`, `cache_len`, `head_dim`.
A config maps them onto mesh axes (`data`, `fsdp`, `tensor`). The same code then runs on one
CPU, 8 fake CPU devices, a GPU or a TPU slice: only the mesh shape changes.

An attention kernel's `heads` / `kv_heads` dim is flat (H * Dh), so its box (`UnitPartitioned`)
names the unit, one head of Dh: the dim is split only when the mesh axes divide H, never
inside a head (RoPE's half swap would then move data between devices in every forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from flax import struct
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


class UnitPartitioned(nn.LogicallyPartitioned):
  """A logically partitioned param whose dims named in `units` are flat runs of indivisible
  units: `units=(("heads", Dh),)` on a [D, H*Dh] kernel lets `heads` split the dim over
  mesh axes only at head boundaries (when their size divides H). Flax's own unboxing under
  a mesh and rules (a sharded init) constrains the value by the same rule."""
  units: tuple[tuple[str, int], ...] = struct.field(default=(), pytree_node=False)

  def unbox(self, apply_constraint=True):
    mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
    rules = self.rules if self.rules is not None else nn.get_logical_axis_rules()
    if not apply_constraint or mesh.empty or not rules:
      return self.value
    spec = _mesh_spec(self.names, self.value.shape, dict(self.units), mesh, rules)
    return jax.lax.with_sharding_constraint(
        self.value, spec if self.mesh is None else NamedSharding(mesh, spec))


def with_unit_partitioning(init, names: tuple[str, ...], units=()):
  """`nn.with_logical_partitioning(init, names)`, boxed as `UnitPartitioned` when `units`
  (logical name -> unit size pairs) name a dim of `names`."""
  units = tuple((name, int(size)) for name, size in units if name in names)
  if not units:
    return nn.with_logical_partitioning(init, names)
  return lambda *args, **kwargs: UnitPartitioned(init(*args, **kwargs), names, units=units)


def _mesh_spec(names, shape, units: dict[str, int], mesh, rules) -> P:
  """The mesh axes of each dim of a param with logical axes `names`: a dim is split over its
  rule's mesh axes when their size divides it, counted in units for names in `units`."""
  mesh_spec = tuple(nn.logical_to_mesh_axes(tuple(names), rules))
  mesh_spec += (None,) * (len(shape) - len(mesh_spec))
  fixed = []
  for dim, name, axes in zip(shape, tuple(names) + (None,) * len(shape), mesh_spec):
    axis_names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    size = int(np.prod([mesh.shape[a] for a in axis_names])) if axis_names else 1
    unit = units.get(name, 1)
    if dim % unit:
      raise ValueError(f"a {name!r} dim of {dim} is not a whole number of {unit}-wide units; "
                       "check the param's declared units (the model config's head_dim).")
    fixed.append(axes if size > 1 and (dim // unit) % size == 0 else None)
  return P(*fixed)


def param_shardings(abstract_boxed_params, mesh: Mesh, rules=DEFAULT_RULES):
  """Shardings for a params tree from `jax.eval_shape(init)` (boxed with logical names).

  Dimensions that a mesh axis does not divide stay replicated on that axis; a flat per-head
  dim (a `UnitPartitioned` box) is split only when the axis divides its number of heads.
  Leaves without a box are replicated.
  """
  def to_sharding(leaf):
    if not isinstance(leaf, nn.Partitioned):
      return NamedSharding(mesh, P())
    units = dict(leaf.units) if isinstance(leaf, UnitPartitioned) else {}
    return NamedSharding(mesh, _mesh_spec(leaf.names, leaf.value.shape, units, mesh, rules))

  return jax.tree.map(to_sharding, abstract_boxed_params,
                      is_leaf=lambda x: isinstance(x, nn.Partitioned))


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

