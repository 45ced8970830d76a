"""One optimizer update and one eval batch, as pure functions of (state, batch).

Shape legend: B global batch, A micro-batches (opt.grad_accum), L sequence length.

`loss_fn(params, batch, rng) -> (loss, metrics)` is an objective from
`dllm_jax.diffusion.objectives`. The step differentiates only the trainable subtree
(`optimizer.partition`), so frozen weights get no gradient buffers. With A > 1 the batch
[B, L] is viewed as A micro-batches of B / A rows, taking every A-th row
(`[B/A, A, L] -> [A, B/A, L]`): each device's contiguous shard then holds an equal share of
every micro-batch and the split moves no data. Gradients, loss and metrics are averaged over
the micro-batches by a `lax.scan`; micro-batch i draws its noise from `fold_in(step_rng, i)`.

Step noise is `fold_in(state.rng, state.step)`: a pure function of the step, so a resumed run
draws exactly the noise the uninterrupted run drew.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dllm_jax.training import optimizer as opt_lib
from dllm_jax.training.state import TrainState

LossFn = Callable[[Any, Mapping[str, jax.Array], jax.Array], tuple[jax.Array, dict]]
Constrain = Callable[[Mapping[str, jax.Array]], Mapping[str, jax.Array]]


def split_micro_batches(batch: Mapping[str, jax.Array], num: int) -> dict[str, jax.Array]:
  """[B, ...] -> [A, B/A, ...] where micro-batch i holds rows i, i + A, i + 2A, ..."""
  def split(x):
    if x.shape[0] % num:
      raise ValueError(f"batch of {x.shape[0]} rows cannot be split into {num} micro-batches; "
                       "make train.batch_size a multiple of opt.grad_accum.")
    return jnp.swapaxes(x.reshape(x.shape[0] // num, num, *x.shape[1:]), 0, 1)
  return {k: split(v) for k, v in batch.items()}


def _grads_and_metrics(loss_fn: LossFn, train_params, frozen, batch, rng, grad_accum: int,
                       constrain: Constrain | None):
  def loss_of(trainable, micro, key):
    loss, metrics = loss_fn(opt_lib.merge(trainable, frozen), micro, key)
    return loss, dict(metrics, loss=loss)

  grad_fn = jax.grad(loss_of, has_aux=True)
  if grad_accum == 1:
    return grad_fn(train_params, batch, rng)

  micro = split_micro_batches(batch, grad_accum)

  def body(carry, xs):
    index, mb = xs
    if constrain is not None:
      mb = constrain(mb)
    grads, metrics = grad_fn(train_params, mb, jax.random.fold_in(rng, index))
    return jax.tree.map(jnp.add, carry, (grads, metrics)), None

  first = jax.tree.map(lambda x: x[0], micro)
  shapes = jax.eval_shape(grad_fn, train_params, first, rng)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32 if
                                           jnp.issubdtype(s.dtype, jnp.floating) else s.dtype),
                       shapes)
  total, _ = jax.lax.scan(body, zeros, (jnp.arange(grad_accum), micro))
  grads, metrics = jax.tree.map(lambda x: x / grad_accum, total)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, train_params)
  return grads, metrics


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, *,
                    trainable: str = "all", grad_accum: int = 1,
                    schedule: optax.Schedule | None = None,
                    constrain: Constrain | None = None):
  """Returns `train_step(state, batch) -> (state, metrics)` (not jitted).

  Metrics: the objective's, plus `loss`, `grad_norm` (before clipping), `param_norm` and
  `lr` (when `schedule` is given), all float32 scalars.
  """
  def train_step(state: TrainState, batch: Mapping[str, jax.Array]):
    rng = jax.random.fold_in(state.rng, state.step)
    train_params, frozen = opt_lib.partition(state.params, trainable)
    grads, metrics = _grads_and_metrics(loss_fn, train_params, frozen, batch, rng,
                                        grad_accum, constrain)
    updates, opt_state = tx.update(grads, state.opt_state, train_params)
    new_params = optax.apply_updates(train_params, updates)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads),
                   param_norm=optax.tree.norm(new_params))
    if schedule is not None:
      metrics["lr"] = schedule(state.step)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    new_state = state.replace(step=state.step + 1, params=opt_lib.merge(new_params, frozen),
                              opt_state=opt_state)
    return new_state, metrics

  return train_step


def make_eval_step(loss_fn: LossFn):
  """Returns `eval_step(params, batch, rng) -> metrics` (the objective's, plus `loss`)."""
  def eval_step(params, batch: Mapping[str, jax.Array], rng: jax.Array):
    loss, metrics = loss_fn(params, batch, rng)
    return {k: jnp.asarray(v, jnp.float32) for k, v in dict(metrics, loss=loss).items()}

  return eval_step
