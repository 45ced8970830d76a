"""Put host tensors straight onto their (sharded) devices, one tensor at a time.

Placement is decided before any data is read: `target_shardings` gives the shape, dtype and
`Sharding` of every leaf (`abstract_params` + `param_shardings` on a mesh, or one device).

  put(host, sharding)             each device receives only its own slice of `host`
                                  (`jax.make_array_from_callback`)
  stack_layers(shape, ...)        builds a stacked [L, ...] leaf on its sharding from per-layer
                                  host slices: a sharded zero buffer is allocated on device,
                                  then layer i is placed and written into it by a jitted,
                                  buffer-donating `dynamic_update_index_in_dim`

So host memory holds at most one layer slice (plus its read / converted copies) at a time, and
device memory holds the stacked leaf plus one layer slice; no [L, ...] host copy ever exists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import abstract_params
from dllm_jax.parallel import mesh as mesh_lib

LeafPath = tuple[str, ...]


def flatten(tree) -> dict[LeafPath, object]:
  """Nested dict -> {("layers", "attn", "q", "kernel"): leaf}."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    out[tuple(k.key for k in path)] = leaf
  return out


def unflatten(flat: dict[LeafPath, object]) -> dict:
  tree: dict = {}
  for path, leaf in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return tree


@functools.lru_cache(maxsize=16)
def _abstract(cfg: ModelConfig):
  return abstract_params(cfg)


def target_shardings(cfg: ModelConfig, mesh=None, rules=None):
  """({path: ShapeDtypeStruct}, {path: Sharding}) for every leaf of the params tree."""
  boxed = _abstract(cfg)
  shapes = flatten(nn.unbox(boxed))
  if mesh is None:
    device = SingleDeviceSharding(jax.devices()[0])
    return shapes, {path: device for path in shapes}
  shardings = mesh_lib.param_shardings(boxed, mesh, mesh_lib.rules_from_config(rules))
  return shapes, flatten(shardings)


def put(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """Places `host` on `sharding`; each device copies only the slice it holds."""
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def layer_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """The sharding of one [...] slice of a stacked [L, ...] leaf (leading axis dropped)."""
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
  return sharding


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape: tuple[int, ...], dtype: str, sharding):
  return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _update_fn(sharding):
  def update(buffer, layer, index):
    return jax.lax.dynamic_update_index_in_dim(buffer, layer, index, 0)
  return jax.jit(update, donate_argnums=0, out_shardings=sharding)


def stack_layers(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding,
                 read_layer: Callable[[int], np.ndarray]) -> jax.Array:
  """A stacked [L, ...] leaf on `sharding`, from `read_layer(i)` -> host array [...]."""
  dtype = np.dtype(dtype)
  buffer = _zeros_fn(tuple(shape), dtype.name, sharding)()
  slice_sharding = layer_sharding(sharding)
  update = _update_fn(sharding)
  for i in range(shape[0]):
    host = read_layer(i)
    if host.shape != tuple(shape[1:]) or host.dtype != dtype:
      raise ValueError(f"layer {i} slice is {host.shape} {host.dtype}, expected "
                       f"{tuple(shape[1:])} {dtype}.")
    buffer = update(buffer, put(host, slice_sharding), np.int32(i))
    # Wait for this layer before reading the next: with asynchronous dispatch the loop would
    # run ahead, and the slices and update buffers of several layers would be alive at once
    # (a load's peak then varied by up to a stacked leaf from run to run).
    buffer.block_until_ready()
    del host
  return buffer
