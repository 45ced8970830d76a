"""Optimizer, trainable subsets and the train step, against NumPy re-statements."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from ml_collections import ConfigDict

from dllm_jax.models import abstract_params, get_preset
from dllm_jax.training import optimizer as opt_lib
from dllm_jax.training import state as state_lib
from dllm_jax.training import step as step_lib


def _opt(**kw):
  base = dict(lr=1e-2, schedule="cosine", warmup_steps=10, decay_steps=None, end_lr_frac=0.1,
              b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, decay_embeddings=False,
              clip_norm=1.0, grad_accum=1, trainable="all")
  base.update(kw)
  return ConfigDict(base)


def _reference_lr(kind, step, lr=1e-2, warmup=10, total=100, end_frac=0.1):
  if step < warmup:
    return lr * step / warmup
  if kind == "constant":
    return lr
  frac = (step - warmup) / (total - warmup)
  end = lr * end_frac
  if kind == "linear":
    return lr + (end - lr) * min(frac, 1.0)
  return end + (lr - end) * 0.5 * (1 + np.cos(np.pi * min(frac, 1.0)))


@pytest.mark.parametrize("kind", opt_lib.SCHEDULES)
def test_schedules_match_formula(kind):
  schedule = opt_lib.make_schedule(_opt(schedule=kind), total_steps=100)
  for step in (0, 1, 5, 10, 11, 40, 99, 100, 150):
    np.testing.assert_allclose(float(schedule(step)), _reference_lr(kind, step), rtol=1e-6,
                               atol=1e-9, err_msg=f"{kind} at step {step}")


def test_schedule_errors_name_the_key():
  with pytest.raises(ValueError, match="opt.schedule"):
    opt_lib.make_schedule(_opt(schedule="step"), 100)
  with pytest.raises(ValueError, match="warmup_steps=10 must be below"):
    opt_lib.make_schedule(_opt(), 10)


def _toy_params(lora: bool = False):
  """A params tree with the real model's leaf names (and optional LoRA adapters)."""
  rng = np.random.default_rng(0)
  leaf = lambda *shape: jnp.asarray(rng.normal(size=shape) + 1.0, jnp.float32)
  q = {"kernel": leaf(2, 4, 4), "bias": leaf(2, 4)}
  if lora:
    q.update(lora_a=leaf(2, 4, 2), lora_b=leaf(2, 2, 4))
  return {"embed": {"embedding": leaf(8, 4)},
          "layers": {"attn_norm": {"scale": leaf(2, 4)}, "attn": {"q": q}},
          "final_norm": {"scale": leaf(4)}, "lm_head": {"kernel": leaf(4, 8)}}


def test_weight_decay_skips_norms_biases_and_embeddings():
  """With a zero gradient AdamW's update is exactly -lr * wd * param on decayed leaves."""
  params = _toy_params()
  tx = opt_lib.make_optimizer(_opt(schedule="constant", warmup_steps=0, clip_norm=0.0), 100)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  flat_params = traverse_util.flatten_dict(params)
  for path, update in traverse_util.flatten_dict(updates).items():
    decayed = path[-1] not in ("scale", "bias", "embedding")
    expected = -1e-2 * 0.1 * np.asarray(flat_params[path]) if decayed else 0.0 * update
    np.testing.assert_allclose(np.asarray(update), expected, rtol=1e-6, atol=1e-12,
                               err_msg="/".join(path))
  assert opt_lib.decay_mask(params, decay_embeddings=True)["embed"]["embedding"] is True


def test_lora_partition_gives_the_base_no_optimizer_state():
  cfg = get_preset("tiny", lora_rank=4, lora_alpha=4.0)
  params = nn.unbox(abstract_params(cfg))
  train, frozen = opt_lib.partition(params, "lora")
  assert {p[-1] for p in traverse_util.flatten_dict(train)} == {"lora_a", "lora_b"}
  assert not any(p[-1].startswith("lora") for p in traverse_util.flatten_dict(frozen))
  assert jax.tree.structure(opt_lib.merge(train, frozen)) == jax.tree.structure(params)

  abstract = state_lib.abstract_state(cfg, opt_lib.make_optimizer(_opt(), 100), "lora")
  mu = abstract.opt_state[1][0].mu
  assert {p[-1] for p in traverse_util.flatten_dict(mu)} == {"lora_a", "lora_b"}

  with pytest.raises(ValueError, match="model.lora_rank > 0"):
    opt_lib.partition(nn.unbox(abstract_params(get_preset("tiny"))), "lora")
  with pytest.raises(ValueError, match="valid regex"):
    opt_lib.partition(params, "(")


def test_frozen_params_do_not_move():
  params = _toy_params(lora=True)
  tx = opt_lib.make_optimizer(_opt(schedule="constant", warmup_steps=0), 100)

  def loss_fn(p, batch, rng):
    q = p["layers"]["attn"]["q"]
    w = q["kernel"] + jnp.einsum("lir,lro->lio", q["lora_a"], q["lora_b"])
    return jnp.mean(jnp.einsum("bi,lio->blo", batch["x"], w) ** 2), {}

  train, _ = opt_lib.partition(params, "lora")
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=tx.init(train), rng=jax.random.PRNGKey(0))
  step = jax.jit(step_lib.make_train_step(loss_fn, tx, trainable="lora"))
  new, metrics = step(state, {"x": jnp.ones((3, 4), jnp.float32)})
  assert float(metrics["grad_norm"]) > 0
  flat_before = traverse_util.flatten_dict(params)
  for path, value in traverse_util.flatten_dict(new.params).items():
    moved = not np.array_equal(np.asarray(value), np.asarray(flat_before[path]))
    assert moved == (path[-1] in ("lora_a", "lora_b")), "/".join(path)


def _linear_loss(params, batch, rng):
  del rng
  pred = batch["x"] @ params["w"]["kernel"]
  loss = jnp.mean((pred - batch["y"]) ** 2)
  return loss, {"mse": loss}


def test_gradient_accumulation_equals_full_batch():
  rng = np.random.default_rng(0)
  batch = {"x": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)}
  params = {"w": {"kernel": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}}
  tx = opt_lib.make_optimizer(_opt(schedule="constant", warmup_steps=0), 100)
  results = []
  for accum in (1, 4):
    state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                 opt_state=tx.init(params), rng=jax.random.PRNGKey(0))
    step = jax.jit(step_lib.make_train_step(_linear_loss, tx, grad_accum=accum))
    results.append(step(state, batch))
  (s1, m1), (s4, m4) = results
  np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-6)
  np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-6)
  np.testing.assert_allclose(s4.params["w"]["kernel"], s1.params["w"]["kernel"], rtol=1e-6)
  assert int(s4.step) == 1


def test_micro_batches_take_every_ath_row():
  rows = {"x": jnp.arange(8)[:, None]}
  micro = step_lib.split_micro_batches(rows, 4)["x"][..., 0]
  np.testing.assert_array_equal(micro, [[0, 4], [1, 5], [2, 6], [3, 7]])
  with pytest.raises(ValueError, match="multiple of opt.grad_accum"):
    step_lib.split_micro_batches(rows, 3)
