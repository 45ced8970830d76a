"""The train state and its sharded initialisation.

  TrainState(step [] int32, params, opt_state, rng [2] uint32)

`opt_state` covers only the trainable subtree (`optimizer.partition`). Sharded init follows
flax's lm1b: `jax.eval_shape` of the init gives shapes with logical axis names (the optimizer
moments inherit them from the params), the mesh rules turn those into `NamedSharding`s, and
`jax.jit(init, out_shardings=...)` creates every array directly in its shards: no device ever
holds the whole model.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer
from dllm_jax.parallel import mesh as mesh_lib
from dllm_jax.training import optimizer as opt_lib

_INIT_LEN = 8  # tokens in the dummy batch that traces the parameter shapes


@struct.dataclass
class TrainState:
  """Everything a step reads and writes. A pytree; donated to `train_step`."""
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array  # raw uint32 key data: checkpoints as a plain array


def _boxed_init(model_cfg: ModelConfig, tx: optax.GradientTransformation, trainable: str,
                rng: jax.Array) -> TrainState:
  """Fresh state with logically-partitioned (boxed) params and optimizer moments."""
  init_len = min(_INIT_LEN, model_cfg.max_seq_len)
  tokens = jnp.zeros((1, init_len), jnp.int32)
  params = Transformer(model_cfg).init(
      jax.random.fold_in(rng, 0), tokens, block_ids=jnp.zeros((1, init_len), jnp.int32)
  )["params"]
  train_params, _ = opt_lib.partition(params, trainable)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(train_params), rng=jax.random.fold_in(rng, 1))


def abstract_state(model_cfg: ModelConfig, tx: optax.GradientTransformation,
                   trainable: str = "all") -> TrainState:
  """Shapes, dtypes and logical axes of the state (boxed), allocating nothing."""
  return jax.eval_shape(lambda r: _boxed_init(model_cfg, tx, trainable, r),
                        jax.random.PRNGKey(0))


def state_shardings(boxed_abstract: TrainState, mesh: Mesh,
                    rules=mesh_lib.DEFAULT_RULES) -> TrainState:
  """NamedSharding for every leaf: logical axes through `rules`, scalars replicated."""
  is_box = lambda x: isinstance(x, nn.Partitioned)

  def leaf(x):
    if is_box(x):
      return mesh_lib.param_shardings(x, mesh, rules)
    return mesh_lib.replicated(mesh)

  return jax.tree.map(leaf, boxed_abstract, is_leaf=is_box)


def unboxed_abstract(boxed_abstract: TrainState, shardings: TrainState | None = None):
  """The abstract state as plain ShapeDtypeStructs (with shardings, for restoring)."""
  plain = nn.unbox(boxed_abstract)
  if shardings is None:
    return plain
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      plain, shardings)


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, rng: jax.Array,
               mesh: Mesh, rules=mesh_lib.DEFAULT_RULES, trainable: str = "all",
               shardings: TrainState | None = None) -> tuple[TrainState, TrainState]:
  """A fresh state created in its shards. Returns (state, shardings).

  Call it outside any mesh context: abstract shapes are unboxed here, and flax applies
  sharding constraints when it unboxes under an active mesh and rules.
  """
  if shardings is None:
    shardings = state_shardings(abstract_state(model_cfg, tx, trainable), mesh, rules)
  init = jax.jit(lambda r: nn.unbox(_boxed_init(model_cfg, tx, trainable, r)),
                 out_shardings=shardings)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    return init(rng), shardings
