"""Data-parallel decoding with `jax.shard_map`: every data shard runs its own while_loop.

Shape legend: B batch (a multiple of D), D data shards (the product of the mesh's data axes),
b = B / D rows per shard, P padded prompt length, G gen_length.

How it works, in full: docs/decoders.md, `decoding.data_parallel`.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from dllm_jax.decoding import base, protocol
from dllm_jax.models.config import ModelConfig
from dllm_jax.parallel import mesh as mesh_lib
from dllm_jax.parallel import sharding

Array = jnp.ndarray
MODES = ("shard_map", "spmd")


@dataclasses.dataclass(frozen=True)
class ShardStats:
  """Per data shard counts of one decode (NumPy, on every process).

  Attributes:
    steps: [D] loop iterations each shard ran.
    nfe: [D] batched forwards each shard ran.
    rows: [D] rows each shard decoded (padding rows included).
  """
  steps: np.ndarray
  nfe: np.ndarray
  rows: np.ndarray


def _global(x, sharding: NamedSharding):
  """A host value (the same on every process) as a global array with `sharding`."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


# ----------------------------------------------------------------------------- the decode

@functools.partial(jax.jit, static_argnames=("decoder", "mesh", "axes", "inner_rules", "impl"))
def _sharded(params, tokens, valid, key_data, traced, row_inputs, *, decoder, mesh, axes,
             inner_rules, impl):
  rows = P(axes)

  def local(params, tokens, valid, key_data, traced, row_inputs):
    offset = jax.lax.axis_index(axes) * tokens.shape[0]
    rng = jax.random.wrap_key_data(key_data, impl=impl)
    with nn.logical_axis_rules(inner_rules):
      out = decoder.decode(params, tokens, valid, rng, decoder.with_offset(traced, offset),
                           row_inputs)
    return out.replace(nfe=out.nfe[None], steps=out.steps[None])

  row_spec = None if row_inputs is None else rows
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), rows, rows, P(), P(), row_spec),
                       out_specs=rows, axis_names=set(axes), check_vma=False)(
                           params, tokens, valid, key_data, traced, row_inputs)


def decode(params, cfg: ModelConfig, tokens, valid, rng, *, mesh, method: str,
           rules=None, **options) -> tuple[base.DecodeOutput, ShardStats]:
  """Decodes a left-padded batch with one while_loop per data shard of `mesh`.

  Args:
    params: model parameters (host, one device, or already on `mesh`).
    cfg: the model config.
    tokens, valid: [B, P] left-padded prompts (NumPy; the same on every process); B must be
      a multiple of the data-parallel size D (`api.generate` pads it).
    rng: PRNG key.
    mesh: a `parallel.mesh` mesh; its data axes (see `parallel.mesh.data_axes`) split the
      batch, the other axes shard the parameters as `rules` say.
    method: a registered decoding method (`registry.names()`).
    rules: logical-axis rules (default parallel.mesh.DEFAULT_RULES).
    **options: the method's options, and on_nonfinite ("raise" or "flag").
  Returns:
    (DecodeOutput with steps / nfe the largest over shards, on every process;
     ShardStats with the per-shard counts).
  """
  on_nonfinite = options.get("on_nonfinite", "raise")
  base.check_on_nonfinite(on_nonfinite)
  tokens, valid = np.asarray(tokens, np.int32), np.asarray(valid, bool)
  plan = protocol.plan(method, cfg, options)
  plan.decoder.check(tokens, valid)
  protocol.check_row_inputs(plan, tokens.shape[0])
  out, stats = run_plan(params, plan, tokens, valid, rng, mesh=mesh, rules=rules)
  return base.raise_if_nonfinite(out, on_nonfinite), stats


def run_plan(params, plan: protocol.Plan, tokens, valid, rng, *, mesh,
             rules=None) -> tuple[base.DecodeOutput, ShardStats]:
  """`decode` of a checked plan (non-finite rows flagged, never raised)."""
  rules = mesh_lib.rules_from_config(rules)
  tokens, valid = np.asarray(tokens, np.int32), np.asarray(valid, bool)
  axes = mesh_lib.data_axes(mesh, rules)
  shards = int(np.prod([mesh.shape[a] for a in axes]))
  if tokens.shape[0] % shards:
    raise ValueError(f"batch {tokens.shape[0]} is not a multiple of the mesh's data-parallel "
                     f"size {shards} (axes {axes}); pad the batch (api.generate does).")
  decoder = plan.decoder
  params = sharding.place_params(plan.params(params), mesh, rules,
                                 abstract=decoder.abstract_params, replicate_axes=axes)
  rows, replicated = NamedSharding(mesh, P(axes)), mesh_lib.replicated(mesh)
  key_data = np.asarray(jax.random.key_data(rng))
  traced = jax.tree.map(lambda x: _global(x, replicated), plan.traced)
  row_inputs = None if plan.row_inputs is None else _global(plan.row_inputs, rows)
  out = _sharded(params, _global(tokens, rows), _global(valid, rows),
                 _global(key_data, replicated), traced, row_inputs, decoder=decoder,
                 mesh=mesh, axes=axes, inner_rules=mesh_lib.without_axes(rules, axes),
                 impl=jax.random.key_impl(rng))
  if jax.process_count() > 1:  # every process gets the whole output
    out = jax.tree.map(jnp.asarray, multihost_utils.process_allgather(out, tiled=True))
  steps, nfe = np.asarray(out.steps), np.asarray(out.nfe)
  stats = ShardStats(steps=steps, nfe=nfe,
                     rows=np.full(shards, tokens.shape[0] // shards, np.int32))
  return out.replace(steps=jnp.max(out.steps), nfe=jnp.max(out.nfe)), stats
