"""Training objectives: `(params, batch, rng, *, cfg, ...) -> (loss, metrics)`.

Each objective corrupts the batch (corruption.py), runs `Transformer(cfg)` with the attention
pattern it needs (as block ids, see models/masks.py) and hands the logits to a pure loss
(losses.py). All are pure and jit-able (`cfg` and options static, e.g. through
`make_objective`); `rng` is split into noise, masking and dropout keys. Metrics are float32
scalars.

  ar               causal attention, next-token CE on tokens whose target has loss_mask
  mdm              LLaDA / MDLM: one t per sequence, bidirectional attention, ELBO weight
  block_diffusion  one t per answer block, block-causal attention over the noisy canvas
  d2f              D2F: block-causal student distils the bidirectional teacher on the same
                   noisy canvas, per-block monotone mask ratios
  selfspec         TiDAR-style: causal AR loss + a fully masked block that sees a clean causal
                   prefix (one network drafts and verifies, decoding/selfspec.py)

Batch: see layout.py (tokens, valid, prompt_mask, loss_mask, positions; all [B, L]).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from dllm_jax.diffusion import corruption, layout, losses, schedules
from dllm_jax.models import lora
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer


def model_logits(params, cfg: ModelConfig, tokens, batch: Mapping, block_ids, rng, *,
                 train: bool = True):
  """Logits [B, L, V] of `tokens` under `block_ids`, with the batch's positions and padding.

  LoRA dropout is active when `train` and cfg.lora_dropout > 0 (keyed by `rng`).
  """
  dropout = bool(train and cfg.lora_rank and cfg.lora_dropout > 0)
  extra = {"rngs": {"dropout": rng}} if dropout else {}
  return Transformer(cfg).apply(
      {"params": params}, tokens, block_ids=block_ids,
      positions=jnp.asarray(batch["positions"]), valid=jnp.asarray(batch["valid"]),
      deterministic=not dropout, **extra)


def _mask_id(cfg: ModelConfig) -> int:
  if cfg.mask_token_id is None:
    raise ValueError(f"Model config {cfg.name!r} has no mask_token_id; diffusion objectives "
                     "need one (cfg.replace(mask_token_id=...)).")
  return cfg.mask_token_id


def _normalization(normalization: str | None, sft: bool) -> str:
  norm = normalization or ("answer_length" if sft else "batch_length")
  if norm not in losses.NORMALIZATIONS:
    raise ValueError(f"Unknown normalization {norm!r}; use one of {losses.NORMALIZATIONS}.")
  return norm


def _check_eps(eps: float):
  if not 0.0 < eps < 1.0:
    raise ValueError(f"eps (smallest diffusion time) must be in (0, 1), got {eps}.")


def _check_block_size(block_size, cfg: ModelConfig):
  if not isinstance(block_size, int) or not 0 < block_size <= cfg.max_seq_len:
    raise ValueError(f"block_size must be an int in [1, max_seq_len={cfg.max_seq_len}], "
                     f"got {block_size!r}.")


def _diffusion_metrics(logits, tokens, masked, maskable, t_tok):
  ce = losses.token_ce(logits, tokens)
  hit = (jnp.argmax(logits, axis=-1) == tokens).astype(jnp.float32)
  n_masked = jnp.sum(masked.astype(jnp.float32))
  return {"ce": losses.masked_mean(ce, masked),
          "accuracy": losses.masked_mean(hit, masked),
          "masked_frac": n_masked / jnp.maximum(jnp.sum(maskable.astype(jnp.float32)), 1.0),
          "t_mean": losses.masked_mean(t_tok, maskable)}


def ar_loss(params, batch: Mapping, rng: jax.Array, *, cfg: ModelConfig, train: bool = True):
  """Next-token cross-entropy under causal attention, mean over trained tokens.

  Token i + 1 is trained iff it has loss_mask and tokens i, i + 1 are valid. With
  cfg.shift_logits (Dream) the model already returns the prediction for token i at i.
  """
  layout.check_batch(batch)
  tokens = jnp.asarray(batch["tokens"])
  valid, loss_mask = jnp.asarray(batch["valid"]), jnp.asarray(batch["loss_mask"])
  ids = jnp.asarray(batch["positions"]).astype(jnp.int32)  # causal: id = position
  logits = model_logits(params, cfg, tokens, batch, ids, rng, train=train)
  pred = logits[:, 1:] if cfg.shift_logits else logits[:, :-1]
  targets = tokens[:, 1:]
  trained = loss_mask[:, 1:] & valid[:, 1:] & valid[:, :-1]
  loss = losses.ar_loss_from_logits(pred, targets, trained)
  hit = (jnp.argmax(pred, axis=-1) == targets).astype(jnp.float32)
  return loss, {"ce": loss, "accuracy": losses.masked_mean(hit, trained),
                "num_tokens": jnp.sum(trained.astype(jnp.float32))}


def mdm_loss(params, batch: Mapping, rng: jax.Array, *, cfg: ModelConfig,
             schedule: str | schedules.Schedule = "linear", eps: float = 1e-3,
             sft: bool = False, antithetic: bool = False, normalization: str | None = None,
             train: bool = True):
  """Masked-diffusion ELBO (LLaDA / MDLM) with one diffusion time per sequence.

  t = eps + (1 - eps) u, u ~ U(0, 1) (stratified over the batch if `antithetic`); each
  maskable token is masked with prob `schedule.mask_prob(t)`; bidirectional attention;
  CE on masked tokens times `schedule.weight(t)`. The default (linear, eps = 1e-3) is
  LLaDA's `p_mask = (1 - eps) t + eps`, weight `1 / p_mask`. `sft=True` never masks the
  prompt and normalises per sequence by its answer length; otherwise sum / (B * L)
  (losses.diffusion_loss_from_logits; `normalization` overrides).
  """
  b, _ = layout.check_batch(batch)
  sched, mask_id = schedules.get_schedule(schedule), _mask_id(cfg)
  _check_eps(eps)
  norm = _normalization(normalization, sft)
  k_t, k_mask, k_drop = jax.random.split(rng, 3)
  tokens = jnp.asarray(batch["tokens"])
  maskable = corruption.trainable_positions(batch, sft=sft)
  t = corruption.sample_times(k_t, (b,), t_min=eps, antithetic=antithetic)
  x_t, masked = corruption.mask_bernoulli(k_mask, tokens, maskable,
                                          sched.mask_prob(t)[:, None], mask_id)
  logits = model_logits(params, cfg, x_t, batch, jnp.zeros_like(tokens, jnp.int32), k_drop,
                        train=train)
  loss = losses.diffusion_loss_from_logits(logits, tokens, masked, sched.weight(t)[:, None],
                                           normalization=norm, loss_mask=maskable)
  t_tok = jnp.broadcast_to(t[:, None], tokens.shape)
  return loss, _diffusion_metrics(logits, tokens, masked, maskable, t_tok)


def block_diffusion_loss(params, batch: Mapping, rng: jax.Array, *, cfg: ModelConfig,
                         block_size: int, schedule: str | schedules.Schedule = "linear",
                         eps: float = 1e-3, sft: bool = False, antithetic: bool = False,
                         normalization: str | None = None, train: bool = True):
  """Block diffusion: one diffusion time per answer block of `block_size` tokens.

  Answer blocks (layout.py) each draw their own t; the prompt is never noised. Attention is
  block-causal over the noisy canvas (prompt id 0, block j id j + 1), the layout a
  block-causal decoder with an exact K/V cache runs. (BD3-LM's two-stream training, where
  block j attends to *clean* blocks < j, needs a mask the single-id rule of masks.py cannot
  express.) Weighting and normalisation as in mdm_loss, per token with its block's t.
  """
  b, l = layout.check_batch(batch)
  _check_block_size(block_size, cfg)
  sched, mask_id = schedules.get_schedule(schedule), _mask_id(cfg)
  _check_eps(eps)
  norm = _normalization(normalization, sft)
  k_t, k_mask, k_drop = jax.random.split(rng, 3)
  tokens = jnp.asarray(batch["tokens"])
  blk = layout.block_index(batch, block_size)
  maskable = corruption.trainable_positions(batch, sft=True) & (blk >= 0)
  t_blocks = corruption.sample_times(k_t, (b, layout.num_blocks(l, block_size)), t_min=eps,
                                     antithetic=antithetic)
  t_tok = corruption.per_token(t_blocks, blk, fill=1.0)
  x_t, masked = corruption.mask_bernoulli(k_mask, tokens, maskable, sched.mask_prob(t_tok),
                                          mask_id)
  logits = model_logits(params, cfg, x_t, batch, blk + 1, k_drop, train=train)
  loss = losses.diffusion_loss_from_logits(logits, tokens, masked, sched.weight(t_tok),
                                           normalization=norm, loss_mask=maskable)
  return loss, _diffusion_metrics(logits, tokens, masked, maskable, t_tok)


def d2f_loss(params, batch: Mapping, rng: jax.Array, *, cfg: ModelConfig, teacher_params=None,
             block_size: int = 16, exact_ratio: bool = False,
             first_low: float = corruption.D2F_FIRST_LOW,
             first_high: float = corruption.D2F_FIRST_HIGH,
             max_ratio: float = corruption.D2F_MAX_RATIO, train: bool = True):
  """Discrete diffusion forcing: asymmetric distillation into a block-causal student.

  The answer is split into blocks of `block_size` after the prompt; block j gets mask
  ratio r_j, non-decreasing in j (corruption.d2f_block_ratios), and its tokens are masked
  independently with prob r_j (or exactly round(r_j * m_j) of them if `exact_ratio`).
  Teacher: `teacher_params` (default: `params` with the LoRA adapters removed, the
  reference's `disable_adapter()`), adapters off, *bidirectional*, no gradient. Student:
  `params` under cfg (LoRA on when cfg.lora_rank > 0), *block-causal*: the prompt sees the
  prompt, block j the prompt, noisy blocks < j and itself. Loss: soft-target CE against
  softmax(teacher) on masked tokens, divided by the block's ratio, mean over masked tokens
  (losses.d2f_loss_from_logits).

  To train only the adapters, differentiate `lambda lo: d2f_loss(lora.merge_trees(base, lo),
  ...)` with `base, lo = lora.split_lora(params)`.
  """
  b, l = layout.check_batch(batch)
  _check_block_size(block_size, cfg)
  mask_id = _mask_id(cfg)
  if teacher_params is None:
    if not cfg.lora_rank:
      raise ValueError("d2f_loss with a full-weight student (cfg.lora_rank=0) needs "
                       "teacher_params= (the frozen base model); or add adapters with "
                       "models.lora.add_lora so the teacher is the adapters-off model.")
    teacher_params = params
  teacher_params = jax.lax.stop_gradient(lora.strip_lora(teacher_params))
  teacher_cfg = cfg.replace(lora_rank=0, lora_alpha=0.0, lora_dropout=0.0)
  k_noise, k_drop = jax.random.split(rng)
  tokens = jnp.asarray(batch["tokens"])
  x_t, masked, token_ratio, ratios = corruption.d2f_corrupt(
      k_noise, batch, block_size, mask_id, exact=exact_ratio, first_low=first_low,
      first_high=first_high, max_ratio=max_ratio)
  teacher_logits = model_logits(teacher_params, teacher_cfg, x_t, batch,
                                jnp.zeros_like(tokens, jnp.int32), None, train=False)
  student_ids = layout.block_causal_ids(batch, block_size)
  student_logits = model_logits(params, cfg, x_t, batch, student_ids, k_drop, train=train)
  loss, kl = losses.d2f_loss_from_logits(student_logits, teacher_logits, masked, token_ratio)

  maskable = corruption.trainable_positions(batch, sft=True)
  n_blocks = layout.row_num_blocks(batch, block_size)
  last = jnp.take_along_axis(ratios, jnp.clip(n_blocks - 1, 0)[:, None], axis=1)[:, 0]
  used = jnp.arange(ratios.shape[1])[None, :] < n_blocks[:, None]
  hit = (jnp.argmax(student_logits, -1) == jnp.argmax(teacher_logits, -1)).astype(jnp.float32)
  metrics = {
      "kl": kl,
      "soft_ce": losses.masked_mean(losses.soft_ce(student_logits, teacher_logits), masked),
      "teacher_agreement": losses.masked_mean(hit, masked),
      "masked_frac": (jnp.sum(masked.astype(jnp.float32)) /
                      jnp.maximum(jnp.sum(maskable.astype(jnp.float32)), 1.0)),
      "ratio_first_block": jnp.mean(ratios[:, 0]),
      "ratio_last_block": jnp.mean(last),
      "ratio_mean": losses.masked_mean(ratios, used),
  }
  return loss, metrics


def selfspec_loss(params, batch: Mapping, rng: jax.Array, *, cfg: ModelConfig,
                  block_size: int = 4, draft_weight: float = 1.0, train: bool = True):
  """Self-speculative (TiDAR-style) joint objective: AR loss + drafting a masked block.

  Two forwards of the same network:
    1. `ar_loss` on the clean sequence (causal, ids = positions).
    2. Per row a cut s is drawn uniformly in [max(answer start, 1), L): the clean tokens
       before s (causal ids = positions; tokens from s on are hidden as padding) followed by
       `block_size` [MASK] slots at positions pos(s - 1) + 1 + i, all with one shared id
       above every clean id. The block sees the clean prefix and itself, nothing sees it:
       exactly the mask block `selfspec_generate` appends after the verified prefix. CE of
       slot i against token s + i, on tokens that are trainable (SFT: answer + its EOS
       padding; past L: none), mean over those.
  The block is fully masked, as at decoding time (TiDAR trains its draft block this way).
  (One forward cannot hold both: with the key_id <= query_id rule, a block that sees only
  the prefix before s is seen by every clean token after s.)

  loss = ar + draft_weight * draft. Metrics: ar_ce, ar_accuracy, draft_ce, draft_accuracy
  (block slot 0, the bonus position, included), draft_tokens.
  """
  b, l = layout.check_batch(batch)
  _check_block_size(block_size, cfg)
  mask_id = _mask_id(cfg)
  if cfg.shift_logits:
    raise ValueError("selfspec_loss trains an unshifted model (output i predicts token "
                     "i + 1 on clean slots); got shift_logits=True.")
  if l + block_size > cfg.max_seq_len:
    raise ValueError(f"selfspec_loss forwards L + block_size = {l + block_size} tokens, more "
                     f"than max_seq_len={cfg.max_seq_len}; lower block_size or the canvas.")
  k_ar, k_cut, k_drop = jax.random.split(rng, 3)
  ar, ar_metrics = ar_loss(params, batch, k_ar, cfg=cfg, train=train)
  tokens = jnp.asarray(batch["tokens"])
  valid = jnp.asarray(batch["valid"])
  positions = jnp.asarray(batch["positions"]).astype(jnp.int32)
  first_valid = jnp.argmax(valid, axis=1).astype(jnp.int32)
  lo = jnp.maximum(layout.answer_start(batch), first_valid + 1)  # a non-empty clean prefix
  cut = lo + jnp.floor(jax.random.uniform(k_cut, (b,)) * (l - lo)).astype(jnp.int32)
  cut = jnp.minimum(cut, l - 1)                                                 # [B]
  idx = jnp.arange(l, dtype=jnp.int32)[None]
  prefix_valid = valid & (idx < cut[:, None])
  slot = cut[:, None] + jnp.arange(block_size, dtype=jnp.int32)[None]         # [B, K]
  inside = slot < l
  at = jnp.minimum(slot, l - 1)
  targets = jnp.take_along_axis(tokens, at, axis=1)
  trained = inside & jnp.take_along_axis(corruption.trainable_positions(batch, sft=False),
                                         at, axis=1)
  start = jnp.take_along_axis(positions, (cut - 1)[:, None], axis=1) + 1          # [B, 1]
  block_pos = start + jnp.arange(block_size, dtype=jnp.int32)[None]
  block_id = jnp.max(positions, axis=1, keepdims=True) + 1
  all_tokens = jnp.concatenate([tokens, jnp.full((b, block_size), mask_id, tokens.dtype)], 1)
  forward_batch = {"positions": jnp.concatenate([positions, block_pos], 1),
                   "valid": jnp.concatenate([prefix_valid, jnp.ones((b, block_size), bool)], 1)}
  ids = jnp.concatenate([positions, jnp.broadcast_to(block_id, (b, block_size))], 1)
  logits = model_logits(params, cfg, all_tokens, forward_batch, ids, k_drop,
                        train=train)[:, l:]
  draft = losses.masked_mean(losses.token_ce(logits, targets), trained)
  hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  metrics = {"ar_ce": ar, "ar_accuracy": ar_metrics["accuracy"], "draft_ce": draft,
             "draft_accuracy": losses.masked_mean(hit, trained),
             "draft_tokens": jnp.sum(trained.astype(jnp.float32))}
  return ar + draft_weight * draft, metrics


OBJECTIVES: dict[str, Callable] = {
    "ar": ar_loss,
    "mdm": mdm_loss,
    "block_diffusion": block_diffusion_loss,
    "d2f": d2f_loss,
    "selfspec": selfspec_loss,
}


def objective_options(name: str) -> dict[str, object]:
  """The options an objective accepts, with their defaults (inspect.Parameter.empty if none)."""
  if name not in OBJECTIVES:
    raise ValueError(f"Unknown objective {name!r}; available: {sorted(OBJECTIVES)}.")
  sig = inspect.signature(OBJECTIVES[name])
  return {p.name: p.default for p in sig.parameters.values()
          if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "cfg"}


def make_objective(name: str, model_cfg: ModelConfig, **options) -> Callable:
  """Returns `fn(params, batch, rng) -> (loss, metrics)` for a named objective.

  Names: "ar", "mdm", "block_diffusion" (needs block_size), "d2f" (needs teacher_params
  unless model_cfg has LoRA adapters, whose adapters-off model is then the teacher),
  "selfspec" (block_size: mask slots drafted, draft_weight). Option
  names and values are checked here, before anything is traced. A teacher tree passed here
  is closed over (a constant under jit); for large teachers call d2f_loss inside your own
  jitted step with the teacher as an argument.
  """
  allowed = objective_options(name)
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    raise ValueError(f"Objective {name!r} does not take option(s) {unknown}; it takes "
                     f"{sorted(allowed)}.")
  missing = sorted(k for k, v in allowed.items()
                   if v is inspect.Parameter.empty and k not in options)
  if missing:
    raise ValueError(f"Objective {name!r} needs option(s) {missing}.")
  if name != "ar":
    _mask_id(model_cfg)
  if "schedule" in options:
    schedules.get_schedule(options["schedule"])
  if "eps" in options:
    _check_eps(options["eps"])
  if "block_size" in options:
    _check_block_size(options["block_size"], model_cfg)
  if name == "selfspec":
    if model_cfg.shift_logits:
      raise ValueError("Objective 'selfspec' trains an unshifted model; got shift_logits=True.")
    if not float(options.get("draft_weight", 1.0)) >= 0.0:
      raise ValueError(f"draft_weight must be >= 0, got {options['draft_weight']}.")
  if "normalization" in options:
    _normalization(options["normalization"], options.get("sft", False))
  if name == "d2f":
    corruption.check_d2f_bounds(options.get("first_low", corruption.D2F_FIRST_LOW),
                                options.get("first_high", corruption.D2F_FIRST_HIGH),
                                options.get("max_ratio", corruption.D2F_MAX_RATIO))
    if options.get("teacher_params") is None and not model_cfg.lora_rank:
      raise ValueError("Objective 'd2f' with a full-weight student needs teacher_params= "
                       "(the frozen base params), or a config with LoRA adapters "
                       "(models.lora.add_lora), whose adapters-off model is the teacher.")
  fn = functools.partial(OBJECTIVES[name], cfg=model_cfg, **options)

  def objective(params, batch, rng):
    return fn(params, batch, rng)

  objective.__name__ = f"{name}_objective"
  objective.__doc__ = f"{name} objective with options {sorted(options)}."
  return objective
