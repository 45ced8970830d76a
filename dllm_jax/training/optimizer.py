"""The optimizer from a config: global-norm clipping, then AdamW on a learning-rate schedule.

  clip_by_global_norm(opt.clip_norm)          (skipped when clip_norm is 0)
  adamw(schedule, b1, b2, eps, weight_decay, mask=decay_mask)

Weight decay skips RMSNorm scales and biases, and the token embedding unless
`opt.decay_embeddings`. The optimizer acts on the *trainable* part of the params only:
`partition(params, opt.trainable)` splits the tree into (trainable, frozen) subtrees, so frozen
weights (the base model under LoRA, D2F's setting) get neither gradients nor optimizer state.

Gradient accumulation is not an optax wrapper here: `training/step.py` scans over micro-batches
inside one jitted step and applies this optimizer once. Unlike `optax.MultiSteps` that keeps no
gradient accumulator in the checkpointed state, and a step always means one optimizer update
and one global batch (so the step count, the schedule and the data position agree).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import optax
from flax import traverse_util

SCHEDULES = ("cosine", "constant", "linear")
# Named trainable selections; any other value is a regex matched against 'a/b/c' param paths.
TRAINABLE_PRESETS = {"all": r".*", "lora": r"(.*/)?lora_[ab]"}


def make_schedule(opt_cfg, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `opt.lr`, then cosine / constant / linear to `lr * end_lr_frac`.

  The decay runs over `opt.decay_steps` updates (default: `total_steps`), counted from step 0.
  """
  lr, warmup = float(opt_cfg.lr), int(opt_cfg.warmup_steps)
  decay_steps = int(opt_cfg.decay_steps or total_steps)
  end = lr * float(opt_cfg.end_lr_frac)
  if opt_cfg.schedule not in SCHEDULES:
    raise ValueError(f"opt.schedule={opt_cfg.schedule!r} is unknown; use one of {SCHEDULES}.")
  if warmup < 0 or decay_steps <= 0:
    raise ValueError(f"need opt.warmup_steps >= 0 and decay steps > 0, got {warmup} and "
                     f"{decay_steps}; set opt.decay_steps or train.steps.")
  if opt_cfg.schedule != "constant" and warmup >= decay_steps:
    raise ValueError(f"opt.warmup_steps={warmup} must be below the decay length {decay_steps} "
                     "(opt.decay_steps, default train.steps).")
  if opt_cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, decay_steps, end)
  warm = optax.linear_schedule(0.0, lr, warmup) if warmup else optax.constant_schedule(lr)
  if opt_cfg.schedule == "constant":
    rest = optax.constant_schedule(lr)
  else:
    rest = optax.linear_schedule(lr, end, decay_steps - warmup)
  return optax.join_schedules([warm, rest], [warmup])


def decay_mask(params: Mapping[str, Any], decay_embeddings: bool = False):
  """True where AdamW applies weight decay: matrices, not norm scales, biases (or embeddings)."""
  flat = traverse_util.flatten_dict(params)

  def decays(path) -> bool:
    name = path[-1]
    if name in ("scale", "bias"):
      return False
    if name == "embedding":
      return decay_embeddings
    return True

  return traverse_util.unflatten_dict({k: decays(k) for k in flat})


def make_optimizer(opt_cfg, total_steps: int) -> optax.GradientTransformation:
  """The optax chain described in the module docstring (for the trainable subtree)."""
  for name in ("b1", "b2"):
    if not 0.0 <= float(opt_cfg[name]) < 1.0:
      raise ValueError(f"opt.{name} must be in [0, 1), got {opt_cfg[name]}.")
  if float(opt_cfg.clip_norm) < 0 or float(opt_cfg.weight_decay) < 0:
    raise ValueError("opt.clip_norm and opt.weight_decay must be >= 0 (0 disables them).")
  parts = []
  if float(opt_cfg.clip_norm) > 0:
    parts.append(optax.clip_by_global_norm(float(opt_cfg.clip_norm)))
  parts.append(optax.adamw(
      make_schedule(opt_cfg, total_steps), b1=float(opt_cfg.b1), b2=float(opt_cfg.b2),
      eps=float(opt_cfg.eps), weight_decay=float(opt_cfg.weight_decay),
      mask=lambda p: decay_mask(p, bool(opt_cfg.decay_embeddings))))
  return optax.chain(*parts)


def _pattern(trainable: str) -> re.Pattern:
  source = TRAINABLE_PRESETS.get(trainable, trainable)
  try:
    return re.compile(source)
  except re.error as e:
    raise ValueError(f"opt.trainable={trainable!r} is neither one of "
                     f"{sorted(TRAINABLE_PRESETS)} nor a valid regex ({e}).") from None


def partition(params: Mapping[str, Any], trainable: str = "all"):
  """Splits params into (trainable, frozen) nested dicts by `trainable` (preset or regex).

  A leaf is trainable iff the regex fully matches its '/'-joined path (e.g.
  'layers/attn/q/lora_a'). Raises if nothing is trainable, which is always a config mistake.
  """
  pattern = _pattern(trainable)
  flat = traverse_util.flatten_dict(params)
  train = {k: v for k, v in flat.items() if pattern.fullmatch("/".join(map(str, k)))}
  if not train:
    hint = (" The model has no LoRA adapters: set model.lora_rank > 0."
            if trainable == "lora" else "")
    raise ValueError(f"opt.trainable={trainable!r} selects no parameter; paths look like "
                     f"{'/'.join(map(str, next(iter(flat))))!r}.{hint}")
  frozen = {k: v for k, v in flat.items() if k not in train}
  return (traverse_util.unflatten_dict(train),
          traverse_util.unflatten_dict(frozen) if frozen else {})


def merge(trainable: Mapping[str, Any], frozen: Mapping[str, Any]):
  """Inverse of `partition`."""
  flat = traverse_util.flatten_dict(frozen) if frozen else {}
  flat.update(traverse_util.flatten_dict(trainable))
  return traverse_util.unflatten_dict(flat)
