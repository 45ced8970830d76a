"""Data-parallel decoding with `jax.shard_map`: every data shard runs its own while_loop.

Shape legend: B batch (a multiple of D), D data shards (the product of the mesh's data axes),
b = B / D rows per shard, P padded prompt length, G gen_length.

    out, stats = decode(params, cfg, tokens, valid, rng, mesh=mesh, method="d2f", gen_length=64)
    stats.steps  # [D] loop iterations each shard ran before its own rows were done

The SPMD path (`api.generate(..., data_parallel="spmd")`) runs one program over the whole
batch, so every device steps until the slowest row of the batch is done. Here the batch is
split over the mesh's data axes (`parallel.mesh.data_axes`: the `batch` rule's axes of size
> 1) by a `shard_map` that is manual over those axes only: each shard loops until its own
rows are done, while tensor parallelism inside a shard stays automatic (the decoder's
activations follow the rules with the data axes removed, `mesh.without_axes`). Parameters
are replicated over the data axes (an FSDP-sharded tree is gathered once per call at the
shard_map boundary; host parameters are placed that way directly).

Rows never interact and every decoder draws row r's random keys as global row
`row_offset + r` (`sampling.row_keys`; each shard passes its first row's global index), so
the tokens equal single-device decoding of the whole batch, greedy or sampled. Step counts
differ: `DecodeOutput.steps` / `nfe` are the largest over shards (the critical path), and
`ShardStats` holds them per shard.

Works across processes (`jax.distributed.initialize`): every process passes the same
prompts; inputs become global arrays and the outputs are gathered to every process.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from dllm_jax.decoding import ar, base, d2f, fast_dllm, llada
from dllm_jax.models.config import ModelConfig
from dllm_jax.parallel import mesh as mesh_lib

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


# ----------------------------------------------------------------------------- per method

def _loop_runner(module):
  """A traced decode built from a loop module's step interface (ar, llada, fast_dllm)."""
  def run(params, tokens, valid, rng, knobs, offset, *, cfg, static):
    knobs = dict(knobs, row_offset=offset)
    state = module.init_state(params, cfg, static, tokens, valid, rng, knobs)
    state = jax.lax.while_loop(functools.partial(module.running, static),
                               functools.partial(module.step, params, cfg, static), state)
    return module.finish(cfg, static, state)
  run.__name__ = f"run_{module.__name__.rsplit('.', 1)[-1]}"
  return run


_run_ar, _run_llada, _run_fast = (_loop_runner(m) for m in (ar, llada, fast_dllm))


def _run_d2f(params, tokens, valid, rng, limits, offset, *, cfg, static):
  out, _ = d2f.decode(params, tokens, valid, rng, limits.replace(row_offset=offset),
                      cfg=cfg, spec=static)
  return out


@dataclasses.dataclass(frozen=True)
class _Plan:
  """A checked decode: a traced runner, its static (hashable) options, its traced knobs."""
  runner: Callable
  static: Any
  traced: Any


def _loop_plan(runner, module, cls, defaults=None):
  def plan(cfg, tokens, valid, options):
    opts = base.make_options(cls, {**(defaults or {}), **options})
    module.check(cfg, tokens, valid, opts)
    static, knobs = opts.split()
    return _Plan(runner, static, knobs)
  return plan


def _d2f_plan(make):
  def plan(cfg, tokens, valid, options):
    opts = make(cfg, **options)
    d2f.check(cfg, tokens, valid, opts)
    return _Plan(_run_d2f, opts.spec, opts.limits)
  return plan


PLANS = {
    "ar": _loop_plan(_run_ar, ar, ar.AROptions),
    "llada": _loop_plan(_run_llada, llada, llada.LLaDAOptions),
    "dream": _loop_plan(_run_llada, llada, llada.LLaDAOptions, llada.DREAM_DEFAULTS),
    "fast_dllm": _loop_plan(_run_fast, fast_dllm, fast_dllm.FastDLLMOptions),
    "d2f": _d2f_plan(d2f.d2f_options),
    "block_diffusion": _d2f_plan(d2f.block_diffusion_options),
}


# ----------------------------------------------------------------------------- placement

def _global(x, sharding: NamedSharding):
  """A host value (the same on every process) as a global array with `sharding`."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def place_params(params, cfg: ModelConfig, mesh, rules):
  """Params for the shard_map decode: arrays already on exactly the mesh's devices stay
  (jit regathers them over the data axes if they are sharded there); anything else is
  placed replicated over the data axes and sharded over the rest as `rules` say."""
  devices = set(mesh.devices.flat)
  leaves = jax.tree_util.tree_leaves(params)
  if leaves and all(isinstance(x, jax.Array) and x.sharding.device_set == devices
                    for x in leaves):
    return params
  from dllm_jax.models.transformer import abstract_params  # model import on the slow path
  inner = mesh_lib.without_axes(rules, mesh_lib.data_axes(mesh, rules))
  shardings = mesh_lib.param_shardings(abstract_params(cfg), mesh, inner)
  if jax.process_count() == 1:
    return jax.device_put(params, shardings)
  return jax.tree.map(_global, params, shardings)


# ----------------------------------------------------------------------------- the decode

@functools.partial(jax.jit, static_argnames=("runner", "cfg", "static", "mesh", "axes",
                                             "inner_rules", "impl"))
def _sharded(params, tokens, valid, key_data, traced, *, runner, cfg, static, mesh, axes,
             inner_rules, impl):
  rows = P(axes)

  def local(params, tokens, valid, key_data, traced):
    offset = jax.lax.axis_index(axes) * tokens.shape[0]
    rng = jax.random.wrap_key_data(key_data, impl=impl)
    with nn.logical_axis_rules(inner_rules):
      out = runner(params, tokens, valid, rng, traced, offset, cfg=cfg, static=static)
    return out.replace(nfe=out.nfe[None], steps=out.steps[None])

  out_specs = base.DecodeOutput(tokens=rows, lengths=rows, nfe=rows, steps=rows,
                                committed=rows, done=rows, finite=rows)
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), rows, rows, P(), P()),
                       out_specs=out_specs, axis_names=set(axes), check_vma=False)(
                           params, tokens, valid, key_data, traced)


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
    method: a decoding method (api.METHODS).
    rules: logical-axis rules (default parallel.mesh.DEFAULT_RULES).
    **options: the method's options, and on_nonfinite ("raise" or "flag").
  Returns:
    (DecodeOutput with steps / nfe the largest over shards, on every process;
     ShardStats with the per-shard counts).
  """
  if method not in PLANS:
    raise ValueError(f"Unknown decoding method {method!r}; use one of {sorted(PLANS)}.")
  options = dict(options)
  on_nonfinite = options.pop("on_nonfinite", "raise")
  base.check_on_nonfinite(on_nonfinite)
  rules = mesh_lib.rules_from_config(rules)
  tokens, valid = np.asarray(tokens, np.int32), np.asarray(valid, bool)
  axes = mesh_lib.data_axes(mesh, rules)
  shards = int(np.prod([mesh.shape[a] for a in axes]))
  if tokens.shape[0] % shards:
    raise ValueError(f"batch {tokens.shape[0]} is not a multiple of the mesh's data-parallel "
                     f"size {shards} (axes {axes}); pad the batch (api.generate does).")
  plan = PLANS[method](cfg, tokens, valid, options)
  inner = mesh_lib.without_axes(rules, axes)
  params = place_params(params, cfg, mesh, rules)
  rows, replicated = NamedSharding(mesh, P(axes)), mesh_lib.replicated(mesh)
  key_data = np.asarray(jax.random.key_data(rng))
  traced = jax.tree.map(lambda x: _global(x, replicated), plan.traced)
  out = _sharded(params, _global(tokens, rows), _global(valid, rows),
                 _global(key_data, replicated), traced, runner=plan.runner, cfg=cfg,
                 static=plan.static, mesh=mesh, axes=axes, inner_rules=inner,
                 impl=jax.random.key_impl(rng))
  if jax.process_count() > 1:  # every process gets the whole output
    out = jax.tree.map(jnp.asarray, multihost_utils.process_allgather(out, tiled=True))
  steps, nfe = np.asarray(out.steps), np.asarray(out.nfe)
  stats = ShardStats(steps=steps, nfe=nfe,
                     rows=np.full(shards, tokens.shape[0] // shards, np.int32))
  out = out.replace(steps=jnp.max(out.steps), nfe=jnp.max(out.nfe))
  return base.raise_if_nonfinite(out, on_nonfinite), stats
