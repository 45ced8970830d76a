"""The training loop: `train(config, workdir) -> final metrics`.

Shape legend: B global batch, L sequence length.

One call runs (or resumes) a whole experiment:

  1. `experiment.build(config)`: every config mistake raises here, before compiling.
  2. The workdir is checked: a workdir holding checkpoints of a different config (unless
     `train.allow_config_change`, and even then not one that changes the state's shapes), or
     whose checkpoints vanished, is refused. Nothing is written yet.
  3. State: restored from the newest intact checkpoint (params, optimizer, step, RNG, data
     position; a damaged newer step is moved to `damaged_checkpoints/` with a warning), or
     initialised in its shards (and overlaid with `train.init_from` params).
     `config.json` is written when this run saves its first checkpoint (at once in a fresh
     workdir), so a resume that fails before then leaves the workdir as it was.
  4. `train_step` is jitted with explicit in/out `NamedSharding`s, the state donated, and
     compiled ahead of time (its memory footprint is logged).
  5. Loop: the next batch is built on the host while the device runs the current step; each
     step's metrics are then checked: a non-finite loss, gradient or parameter norm stops the
     run with `NonFiniteError` before anything is saved. Metrics go to the console (tqdm,
     absl logging) and `workdir/metrics.jsonl`; eval and checkpoints run on their cadence and
     at the end.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import tqdm
from absl import logging
from etils import epath

from dllm_jax.diffusion.layout import BATCH_KEYS
from dllm_jax.training import accuracy
from dllm_jax.training import checkpoint as ckpt_lib
from dllm_jax.training import config as config_lib
from dllm_jax.training import data as data_lib
from dllm_jax.training import experiment as exp_lib
from dllm_jax.training import metrics as metrics_lib
from dllm_jax.training import optimizer as opt_lib
from dllm_jax.training import state as state_lib
from dllm_jax.training import step as step_lib

StepCallback = Callable[[int, Mapping[str, float]], None]
_WATCHED = ("loss", "grad_norm", "param_norm")  # must stay finite


class NonFiniteError(FloatingPointError):
  """The loss, gradients or parameters stopped being finite."""


def _abstract_batch(exp: exp_lib.Experiment, rows: int) -> dict:
  dtypes = {"int": jnp.int32, "bool": jnp.bool_}
  return {k: jax.ShapeDtypeStruct((rows, exp.layout.seq_len), dtypes[kind],
                                  sharding=exp.batch_shardings[k])
          for k, kind in BATCH_KEYS.items()}


def compile_train_step(exp: exp_lib.Experiment):
  """The jitted, sharded, donating train step, compiled ahead of time for the config."""
  constrain = lambda mb: {k: jax.lax.with_sharding_constraint(v, exp.batch_shardings[k])
                          for k, v in mb.items()}
  step_fn = step_lib.make_train_step(
      exp.loss_fn, exp.tx, trainable=exp.config.opt.trainable,
      grad_accum=int(exp.config.opt.grad_accum), schedule=exp.schedule, constrain=constrain)
  replicated = jax.sharding.NamedSharding(exp.mesh, jax.sharding.PartitionSpec())
  jitted = jax.jit(step_fn, in_shardings=(exp.shardings, exp.batch_shardings),
                   out_shardings=(exp.shardings, replicated), donate_argnums=0)
  start = time.perf_counter()
  abstract, batch = exp.abstract, _abstract_batch(exp, int(exp.config.train.batch_size))
  with mesh_context(exp):
    compiled = jitted.lower(abstract, batch).compile()
  memory = compiled.memory_analysis()
  note = f"train_step compiled in {time.perf_counter() - start:.1f}s"
  if memory is not None:
    note += (f"; per device: arguments {memory.argument_size_in_bytes / 2**20:.1f} MiB, "
             f"temporaries {memory.temp_size_in_bytes / 2**20:.1f} MiB")
  metrics_lib.console(note)
  return compiled


def compile_eval_step(exp: exp_lib.Experiment):
  """`eval_step(params, batch, rng) -> metrics`, jitted with shardings, compiled."""
  replicated = jax.sharding.NamedSharding(exp.mesh, jax.sharding.PartitionSpec())
  jitted = jax.jit(step_lib.make_eval_step(exp.eval_loss_fn),
                   in_shardings=(exp.shardings.params, exp.batch_shardings, replicated),
                   out_shardings=replicated)
  abstract = (exp.abstract.params, _abstract_batch(exp, exp.eval_batch_size),
              jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated))
  with mesh_context(exp):
    return jitted.lower(*abstract).compile()


@contextlib.contextmanager
def mesh_context(exp: exp_lib.Experiment):
  """The mesh and logical-axis rules the model's sharding constraints resolve against
  (active while tracing; enter it only around jit tracing, not around unboxing)."""
  with jax.set_mesh(exp.mesh), nn.logical_axis_rules(exp.rules):
    yield


def evaluate(exp: exp_lib.Experiment, eval_step, params, source,
             num_batches: int) -> dict[str, float]:
  """Mean eval metrics over the first `num_batches` batches of the eval split (0 = all),
  plus decoded exact-match accuracy when `decode.eval_examples` > 0.

  Batches and noise are the same at every call, so evals of one run are comparable.
  """
  it = data_lib.eval_iterator(source, exp.layout, exp.eval_batch_size)
  n = num_batches or max(1, it.shard_size // it.batch_size)
  key = jax.random.PRNGKey(int(exp.config.train.seed) + 1)
  totals = None
  for i in range(n):
    batch = data_lib.to_global(next(it), exp.batch_shardings)
    metrics = eval_step(params, batch, jax.random.fold_in(key, i))
    totals = metrics if totals is None else jax.tree.map(jnp.add, totals, metrics)
  results = {k: float(v) / n for k, v in jax.device_get(totals).items()}
  if int(exp.config.decode.eval_examples):
    results.update(accuracy.exact_match(exp, params, source,
                                        jax.random.PRNGKey(int(exp.config.train.seed) + 2)))
  return results


def _prepare_workdir(workdir: epath.Path, exp: exp_lib.Experiment,
                     ckpt: ckpt_lib.Checkpointer) -> bool:
  """Checks the workdir may be (re)used by this run; returns whether it holds checkpoints.

  Writes nothing: a refused run leaves the workdir as it was.
  """
  config = exp.config
  steps = ckpt.steps()
  saved = ckpt_lib.read_config(workdir)
  if steps and saved is None:
    raise ckpt_lib.CheckpointError(
        f"{ckpt.directory} holds checkpoints {steps} but {workdir} has no "
        f"{ckpt_lib.CONFIG_FILE}: it was not written by this trainer. Refusing to touch it; "
        "pick another workdir.")
  if saved is None:
    return False
  logged = [r["step"] for r in metrics_lib.read_metrics(workdir)]
  every = int(config.train.ckpt_every)
  if not steps and every and logged and max(logged) >= every:
    raise ckpt_lib.CheckpointError(
        f"{workdir} logged training up to step {max(logged)} but {ckpt.directory} holds no "
        "checkpoint (missing or deleted). Restore it, or start over in a new workdir.")
  diffs = config_lib.config_differences(saved, config)
  if diffs and steps:
    if not config.train.allow_config_change:
      raise ckpt_lib.CheckpointError(
          f"{workdir} belongs to a run with a different config:\n  " + "\n  ".join(diffs) +
          "\nUse a new workdir, or set train.allow_config_change=True to resume it anyway.")
    _check_same_layout(workdir, saved, exp, diffs)
  elif diffs:
    metrics_lib.console(f"{workdir} holds no checkpoint: its config.json (of a run that saved "
                        "nothing) will be replaced by this run's.")
  return bool(steps)


def _layout(state) -> dict[str, tuple]:
  flat = jax.tree_util.tree_flatten_with_path(nn.unbox(state))[0]
  name = lambda path: "/".join(
      str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)
  return {name(path): tuple(leaf.shape) for path, leaf in flat}


def _check_same_layout(workdir, saved: str, exp: exp_lib.Experiment, diffs) -> None:
  """`train.allow_config_change` may change hyperparameters, never the state's shapes."""
  old = ml_collections.ConfigDict(json.loads(saved))
  try:
    old_state = state_lib.abstract_state(
        config_lib.model_config(old), opt_lib.make_optimizer(old.opt, int(old.train.steps)),
        old.opt.trainable)
  except Exception as e:  # a config of an older version of the package
    raise ckpt_lib.CheckpointError(
        f"{workdir}/{ckpt_lib.CONFIG_FILE} cannot be read by this version ({e}); resume it "
        "with the version that wrote it, or use a new workdir.") from e
  before, after = _layout(old_state), _layout(exp.boxed_abstract)
  keys = list(after) + [k for k in before if k not in after]  # params first
  changed = [f"{k}: {before.get(k)} -> {after.get(k)}" for k in keys
             if before.get(k) != after.get(k)]
  if changed:
    more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
    raise ckpt_lib.CheckpointError(
        f"{workdir} cannot be resumed with this config even with "
        f"train.allow_config_change: it changes the shapes of the saved state "
        f"({'; '.join(changed[:3])}{more}) through {'; '.join(diffs)}. Use a new workdir "
        "(train.init_from can start it from this run's params where they fit).")


def _initial_state(exp: exp_lib.Experiment, ckpt: ckpt_lib.Checkpointer, resume: bool, it):
  """(state, restored step or None). A damaged newer step is moved aside, with a warning."""
  if resume:
    step, (state, data_state), damaged = ckpt_lib.newest_intact(
        ckpt, lambda s: ckpt.restore(s, exp.abstract))
    if damaged:
      moved = [str(ckpt.set_aside(e.step)) for e in damaged]
      logging.warning("%s", ckpt_lib.damaged_warning(
          ckpt, damaged, f"resuming from step {step}") + f" Moved to {', '.join(moved)}.")
    it.set_state(data_state)
    metrics_lib.console(f"resumed from {ckpt.step_dir(step)}")
    return state, step
  state, _ = state_lib.init_state(exp.model_cfg, exp.tx,
                                  jax.random.PRNGKey(int(exp.config.train.seed)), exp.mesh,
                                  exp.rules, exp.config.opt.trainable, exp.shardings)
  if exp.config.train.init_from:
    warning = exp_lib.canvas_mismatch(exp, exp.config.train.init_from)
    if warning:
      metrics_lib.console("WARNING: " + warning)
    params = exp_lib.initial_params(exp, state.params, exp.config.train.init_from)
    state = state.replace(params=params)
    metrics_lib.console(f"params initialised from {exp.config.train.init_from}")
  return state, None


def _check_finite(step: int, metrics: Mapping[str, float], ckpt: ckpt_lib.Checkpointer):
  bad = {k: metrics[k] for k in _WATCHED if k in metrics and not math.isfinite(metrics[k])}
  if bad:
    last = ckpt.latest_step()
    where = (f"the last checkpoint is step {last} in {ckpt.directory}" if last is not None
             else "no checkpoint was saved")
    raise NonFiniteError(
        f"training diverged at step {step}: {', '.join(f'{k}={v}' for k, v in bad.items())}. "
        f"Stopped without saving this state; {where}. Lower opt.lr, lengthen "
        "opt.warmup_steps or tighten opt.clip_norm, then resume or restart.")


def train(config, workdir: str | os.PathLike, *,
          step_callback: StepCallback | None = None) -> dict[str, float]:
  """Trains (or resumes) the experiment `config` in `workdir`; returns the final metrics.

  Returns {"start_step": the step this call began at (the resumed checkpoint's; 0 for a
  fresh run), "step": ..., "train/<metric>": mean over the last log window, "eval/<metric>":
  the final eval}. `step_callback(step, metrics)` runs after every step once its checkpoint
  (if any) is saved; an exception raised there stops the run like a crash would.
  Trained params load with `checkpoint.load_params(workdir)`.
  """
  exp = exp_lib.build(config)
  t = config.train
  workdir = epath.Path(os.path.abspath(workdir))  # orbax needs absolute paths
  ckpt = ckpt_lib.Checkpointer(workdir, keep=int(t.keep), async_save=bool(t.async_checkpoints))
  try:
    resume = _prepare_workdir(workdir, exp, ckpt)
    if not resume:  # a fresh workdir: nothing to protect
      ckpt_lib.write_config(workdir, config_lib.to_json(config))
    return _loop(exp, workdir, ckpt, resume, step_callback)
  finally:
    ckpt.close()


def _loop(exp, workdir, ckpt, resume, step_callback) -> dict[str, float]:
  config, t = exp.config, exp.config.train
  train_source, eval_source = data_lib.make_sources(config.data)
  it = data_lib.train_iterator(train_source, exp.layout, int(t.batch_size),
                               int(config.data.seed))
  state, resume_step = _initial_state(exp, ckpt, resume, it)
  config_written = not resume
  train_step, eval_step = compile_train_step(exp), compile_eval_step(exp)
  writer = metrics_lib.MetricWriter(workdir, resume_step)
  try:
    step, total = int(jax.device_get(state.step)), int(t.steps)
    final = {"start_step": float(step), "step": float(step)}
    window, window_n, window_seconds = {}, 0, 0.0  # window_seconds: steps only, not eval/save
    bar = tqdm.tqdm(total=total, initial=step, desc=f"train {config.objective.name}",
                    disable=jax.process_index() != 0, dynamic_ncols=True)
    batch = data_lib.to_global(next(it), exp.batch_shardings) if step < total else None
    while step < total:
      tic = time.perf_counter()
      state, device_metrics = train_step(state, batch)
      data_state = it.get_state()  # position after the batch this step consumed
      step += 1
      if step < total:  # overlaps with the device running this step
        batch = data_lib.to_global(next(it), exp.batch_shardings)
      metrics = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
      _check_finite(step, metrics, ckpt)
      window_seconds += time.perf_counter() - tic
      bar.update(1)
      window = {k: window.get(k, 0.0) + v for k, v in metrics.items()}
      window_n += 1
      if step == total or (t.log_every and step % int(t.log_every) == 0):
        means = {k: v / window_n for k, v in window.items()}
        means["steps_per_sec"] = window_n / window_seconds
        writer.write(step, "train", means)
        bar.set_postfix(loss=f"{means['loss']:.4f}", refresh=False)
        final.update({f"train/{k}": v for k, v in means.items()})
        window, window_n, window_seconds = {}, 0, 0.0
      if step == total or (t.eval_every and step % int(t.eval_every) == 0):
        results = evaluate(exp, eval_step, state.params, eval_source, int(t.eval_batches))
        writer.write(step, "eval", results)
        final.update({f"eval/{k}": v for k, v in results.items()})
      if step == total or (t.ckpt_every and step % int(t.ckpt_every) == 0):
        if not config_written:  # from now on the newest checkpoint is this config's
          ckpt_lib.write_config(workdir, config_lib.to_json(config))
          config_written = True
        ckpt.save(state, data_state)
      if step_callback is not None:
        step_callback(step, metrics)
    bar.close()
    if not any(k.startswith("eval/") for k in final):  # resumed a finished run: report it
      final.update({f"eval/{k}": v for k, v in evaluate(
          exp, eval_step, state.params, eval_source, int(t.eval_batches)).items()})
    final["step"] = float(step)
    return final
  finally:
    writer.close()
