"""LLaDA / Dream masked-diffusion sampling: full-canvas forwards, semi-autoregressive blocks.

Shape legend: B batch, P padded prompt length, G gen_length, T = P + G canvas, V vocab,
N = G // block_length blocks, S = steps.

How it works, in full: docs/decoders.md, `decoding.llada`.
"""

from __future__ import annotations

import dataclasses
import sys

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, protocol, sampling, unmasking as unmasking_lib
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer, project

Array = jnp.ndarray

# remasking name -> sampling.confidence kind.
REMASKING = {
    "low_confidence": "probability", "random": "random",                  # LLaDA
    "maskgit_plus": "probability", "topk_margin": "margin",               # Dream
    "entropy": "entropy", "origin": "random",
    "probability": "probability", "margin": "margin",                     # D2F's names
}


@dataclasses.dataclass(frozen=True)
class LLaDAOptions:
  """Decoding options; `split()` gives the static part (a jit argument) and the traced options.

  Attributes:
    gen_length: G response slots.
    block_length: slots per semi-autoregressive block (default 32, capped at G).
    steps: forward passes in total, split evenly over blocks (default G: one token per step).
    remasking: one of REMASKING.
    temperature: Gumbel-max temperature of the token proposal (0 = argmax).
    alg_temp: Dream's order temperature (0 = commit the most confident).
    cfg_scale: classifier-free guidance, `un + (scale + 1) * (cond - un)` (0 = off).
    logits_eos_inf: EOS is never proposed (its logit is -inf).
    confidence_eos_eot_inf: slots proposing EOS/EoT are committed after every other
      candidate of the block (their confidence ranks below all others), at any temperature.
    early_stop: freeze rows whose answer is final and exit when all rows are (see module doc).
    unmasking: tokens committed per step: "even" (LLaDA), "cosine" (MaskGIT) or
      "entropy_bound" (adaptive; `unmasking.py` states each rule exactly).
    entropy_bound: the entropy-bound rule's bound in nats (>= 0; inf commits whole blocks);
      read only with unmasking="entropy_bound".
    batch_invariant: rank confidences on `sampling.RANK_GRID` so a row gives the same tokens
      alone, in a batch and on a mesh; False (default) ranks the exact float32 scores, ties
      to the lowest slot, as LLaDA's `generate` (torch.topk) does (`sampling` module doc).
  """
  gen_length: int = base.GEN_LENGTH
  block_length: int | None = None
  steps: int | None = None
  remasking: str = "low_confidence"
  temperature: float = 0.0
  alg_temp: float = 0.0
  cfg_scale: float = 0.0
  logits_eos_inf: bool = False
  confidence_eos_eot_inf: bool = False
  early_stop: bool = True
  unmasking: str = "even"
  entropy_bound: float = unmasking_lib.DEFAULT_ENTROPY_BOUND
  batch_invariant: bool = False

  def __post_init__(self):
    object.__setattr__(self, "early_stop", base.check_flag("early_stop", self.early_stop))
    g = self.gen_length
    if not isinstance(g, (int, np.integer)) or g <= 0:
      raise ValueError(f"gen_length must be a positive int, got {g!r}.")
    object.__setattr__(self, "block_length", base.resolve_block_length(self.block_length, g))
    if self.steps is None:
      object.__setattr__(self, "steps", g)
    bl, s = self.block_length, self.steps
    if bl <= 0 or g % bl:
      raise ValueError(f"gen_length={g} must be a positive multiple of block_length={bl}; "
                       "pick a block_length that divides gen_length.")
    n = g // bl
    if not (n <= s <= g and s % n == 0):
      raise ValueError(
          f"steps={s} must be a multiple of the number of blocks ({n} = gen_length / "
          f"block_length) between {n} and gen_length={g}.")
    unmasking_lib.check(self.unmasking, self.entropy_bound)
    if self.adaptive and s != g:
      raise ValueError(
          f"steps={s}: unmasking='entropy_bound' chooses how many tokens each step commits, so "
          f"the number of steps is dynamic (at most gen_length={g}); leave steps unset.")
    if self.remasking not in REMASKING:
      raise ValueError(f"Unknown remasking {self.remasking!r}; use one of {tuple(REMASKING)}.")
    for name in ("temperature", "alg_temp", "cfg_scale"):
      base.check_number(name, getattr(self, name), low=0.0)
    object.__setattr__(self, "batch_invariant",
                       base.check_flag("batch_invariant", self.batch_invariant))

  def split(self):
    """(static options, traced options). The static part keeps only whether CFG is on; the
    traced options hold temperature, alg_temp, entropy_bound and the CFG weight `cfg_scale + 1`
    (computed here in float64, as the untraced formula did)."""
    static, traced = base.split_options(
        self, {"temperature": 0.0, "alg_temp": 0.0,
               "cfg_scale": 0.0 if self.cfg_scale == 0 else 1.0,
               "entropy_bound": unmasking_lib.DEFAULT_ENTROPY_BOUND}, {})
    traced["cfg_scale"] = np.asarray(self.cfg_scale + 1.0, np.float32)
    return static, traced

  @property
  def num_blocks(self) -> int:
    return self.gen_length // self.block_length

  @property
  def steps_per_block(self) -> int:
    return self.steps // self.num_blocks

  @property
  def adaptive(self) -> bool:
    """The count per step depends on the step's logits (entropy_bound), not on a schedule."""
    return self.unmasking not in unmasking_lib.FIXED


def schedule(opts: LLaDAOptions) -> np.ndarray:
  """[S] tokens committed per step by a fixed schedule (even / cosine), block after block."""
  per_block = unmasking_lib.counts(opts.unmasking, opts.block_length, opts.steps_per_block)
  return np.tile(per_block, opts.num_blocks)


def transfer_schedule(block_length: int, steps_per_block: int, num_blocks: int) -> np.ndarray:
  """[S] tokens committed per step: m // s, plus one for the first m % s steps of a block."""
  base_count, extra = divmod(block_length, steps_per_block)
  per_block = base_count + (np.arange(steps_per_block) < extra)
  return np.tile(per_block, num_blocks).astype(np.int32)


@flax.struct.dataclass
class LLaDAState:
  """Loop carry. canvas/valid/positions [B, T]; row_step (steps the row was live in: its
  schedule position and forwards), committed, done, finite [B]; step/nfe [] loop steps and
  batched forwards; rng one key or [B] keys (one per row); traced the traced options."""
  canvas: Array
  valid: Array
  positions: Array
  step: Array
  row_step: Array
  nfe: Array
  committed: Array
  done: Array
  rng: Array
  traced: dict
  finite: Array


def bidirectional_logits(params, cfg: ModelConfig, canvas, valid, positions) -> Array:
  """[B, T] canvas -> [B, T, V] logits with full (bidirectional) attention over real tokens."""
  return Transformer(cfg).apply({"params": params}, canvas, block_ids=jnp.zeros_like(canvas),
                                positions=positions, valid=valid)


def forbidden_ids(cfg: ModelConfig, opts: LLaDAOptions) -> tuple[int, ...]:
  ids = (cfg.mask_token_id,)
  return ids + (cfg.eos_token_id,) if opts.logits_eos_inf else ids


def check(cfg: ModelConfig, tokens, valid, opts: LLaDAOptions) -> None:
  """Validates a prompt batch against the options (before anything is compiled)."""
  base.check_prompts(cfg, tokens, valid, opts.gen_length, block_length=opts.block_length)
  if opts.logits_eos_inf and cfg.eos_token_id is None:
    raise ValueError(f"logits_eos_inf needs an EOS id but config {cfg.name!r} has none.")


def init_state(params, cfg: ModelConfig, opts: LLaDAOptions, tokens, valid,
               rng, traced: dict | None = None) -> LLaDAState:
  """The all-masked canvas (no forward yet; `params` is unused, kept for a uniform API).

  `traced` are the traced options (default: `opts.split()[1]`)."""
  del params
  traced = opts.split()[1] if traced is None else traced
  canvas, cvalid, positions = base.init_canvas(tokens, valid, opts.gen_length, cfg.mask_token_id)
  b = tokens.shape[0]
  zero = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the state may be donated
  return LLaDAState(canvas=canvas, valid=cvalid, positions=positions, step=zero(), nfe=zero(),
                    row_step=jnp.zeros((b,), jnp.int32), committed=jnp.zeros((b,), jnp.int32),
                    done=jnp.zeros((b,), bool), rng=rng, traced=traced, finite=jnp.ones((b,), bool))


def _block_logits(params, cfg, opts, state: LLaDAState, start: Array) -> Array:
  """[B, b, V] model logits of each row's block (canvas columns [start, start + b)), with
  CFG as one batched call of [conditional; prompt masked].

  The LM head runs on the block's slots only (the other T - b outputs would be dropped):
  a shifted-logits model's (Dream's) prediction for slot j is the raw output at j - 1 (at
  0 for slot 0), as `Transformer` shifts it."""
  canvas, valid, positions = state.canvas, state.valid, state.positions
  start = jnp.broadcast_to(start, canvas.shape[:1])
  guided = opts.cfg_scale != 0.0
  if guided:
    p = canvas.shape[1] - opts.gen_length
    in_prompt = (jnp.arange(canvas.shape[1]) < p)[None, :] & valid
    uncond = jnp.where(in_prompt, cfg.mask_token_id, canvas)
    canvas, valid = jnp.concatenate([canvas, uncond]), jnp.concatenate([valid, valid])
    positions, start = jnp.concatenate([positions, positions]), jnp.concatenate([start, start])
  hidden = Transformer(cfg).apply({"params": params}, canvas, block_ids=jnp.zeros_like(canvas),
                                  positions=positions, valid=valid, head=False)
  at = start[:, None] - int(cfg.shift_logits) + jnp.arange(opts.block_length, dtype=jnp.int32)
  logits = project(params, cfg, hidden, jnp.maximum(at, 0))
  if not guided:
    return logits
  cond, un = jnp.split(logits, 2)
  return un + sampling.by_row(state.traced["cfg_scale"], un.ndim) * (cond - un)  # the weight cfg_scale + 1 (split())


def select_ranked(scores: Array, candidates: Array, k: Array, order_temp, keys: Array,
                  demoted: Array | None = None, *, invariant: bool = False) -> Array:
  """Each row commits its k[b] best candidates; demoted candidates rank below all others.

  [B, W] scores / candidates / demoted, [B] k, [B] keys -> [B, W] bool. `order_temp` > 0
  samples the order per row (Gumbel-top-k, `sampling.sample_order_mask`); `invariant` ranks
  on the grid (`sampling.rank_scores`).
  """
  def pick(s, mask, count, key, order_temp):
    return sampling.sample_order_mask(jnp.where(mask, s, sampling.NEG_INF)[None],
                                      count[None], order_temp, key, invariant=invariant)[0]
  if demoted is None:
    return sampling.map_rows(pick, (scores, candidates, k, keys), order_temp=order_temp)

  def two_tiers(s, c, d, kk, key, order_temp):
    first = pick(s, c & ~d, kk, key, order_temp)
    return first | pick(s, c & d, kk - jnp.sum(first), key, order_temp)
  return sampling.map_rows(two_tiers, (scores, candidates, demoted, k, keys),
                           order_temp=order_temp)


def response_view(cfg: ModelConfig, opts, state) -> tuple[Array, Array]:
  """([B, G] response slots, [B, G] bool decided)."""
  response = state.canvas[:, -opts.gen_length:]
  return response, response != cfg.mask_token_id


def row_done(cfg: ModelConfig, response: Array, decided: Array) -> Array:
  """[B] the row's answer is final: its first stop is decided with all before it, or all is."""
  return base.first_stop_decided(response, decided, base.stop_ids(cfg)) | jnp.all(decided, 1)


def _schedule_step(opts: LLaDAOptions, state: LLaDAState) -> Array:
  """[B] each row's position in the fixed schedule (S - 1 once its S steps ran: such a row
  has no candidates left)."""
  return jnp.minimum(state.row_step, opts.steps - 1)


def _block_start(cfg: ModelConfig, opts: LLaDAOptions, state: LLaDAState) -> Array:
  """[B] canvas column of the block each row works on: its row_step // steps_per_block for
  a fixed schedule; its first block with a mask left for entropy_bound (the last block for
  a row with none: it has no candidates)."""
  t = state.canvas.shape[1]
  first = t - opts.gen_length
  if not opts.adaptive:
    return first + (_schedule_step(opts, state) // opts.steps_per_block) * opts.block_length
  b = state.canvas.shape[0]
  masked = state.canvas[:, first:] == cfg.mask_token_id
  open_blocks = jnp.any(masked.reshape(b, opts.num_blocks, opts.block_length), axis=-1)
  block = jnp.where(jnp.any(open_blocks, 1), jnp.argmax(open_blocks, 1), opts.num_blocks - 1)
  return first + block.astype(jnp.int32) * opts.block_length


def _take_block(x: Array, start: Array, width: int) -> Array:
  """[B, T, ...] -> [B, width, ...] from column `start` ([] shared or [B] per row)."""
  if start.ndim == 0:
    return jax.lax.dynamic_slice_in_dim(x, start, width, 1)
  return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, width, 0))(x, start)


def _put_block(x: Array, block: Array, start: Array) -> Array:
  """Writes [B, W] `block` into [B, T] `x` at column `start` ([] or [B])."""
  if start.ndim == 0:
    return jax.lax.dynamic_update_slice_in_dim(x, block, start, 1)
  return jax.vmap(lambda r, u, s: jax.lax.dynamic_update_slice_in_dim(r, u, s, 0))(
      x, block, start)


def step(params, cfg: ModelConfig, opts: LLaDAOptions, state: LLaDAState) -> LLaDAState:
  """One denoising step: forward, propose, score, commit each row's top-k (k from the
  unmasking schedule, or the entropy bound)."""
  b, t = state.canvas.shape
  bl = opts.block_length
  start = _block_start(cfg, opts, state)
  # Only the current block competes: propose and score its [B, b] slots.
  logits = _block_logits(params, cfg, opts, state, start)
  finite = state.finite & (sampling.all_finite(logits) | state.done)
  logits = sampling.forbid(logits, forbidden_ids(cfg, opts))
  if sampling.is_row_keys(state.rng):  # one key per row: fold_in(rng[b], row_step[b])
    row_keys = sampling.row_step_keys(state.rng, state.row_step)
  else:
    row_keys = sampling.row_keys(state.rng, state.step, b, state.traced.get("row_offset", 0))
  keys = jax.vmap(lambda k: jax.random.split(k, 3))(row_keys)          # [B, 3]
  temperature = base.traced_option(opts, state.traced, "temperature")
  alg_temp = base.traced_option(opts, state.traced, "alg_temp")
  x0 = sampling.map_rows(sampling.propose, (logits, keys[:, 0]), temperature=temperature)
  kind = REMASKING[opts.remasking]
  conf = jax.vmap(lambda lg, x, k: sampling.confidence(lg, x, kind, k))(logits, x0, keys[:, 1])

  block = _take_block(state.canvas, start, bl)
  live = state.row_step < opts.steps
  live = live & ~state.done if opts.early_stop else live
  candidates = (block == cfg.mask_token_id) & live[:, None]
  demoted = None
  if opts.confidence_eos_eot_inf:
    demoted = jnp.isin(x0, jnp.asarray(base.stop_ids(cfg), jnp.int32))
  if opts.adaptive:
    order = sampling.map_rows(
        lambda s, c, k, order_temp: unmasking_lib.order_scores(s, c, order_temp, k),
        (conf, candidates, keys[:, 2]), order_temp=alg_temp)
    commit = unmasking_lib.entropy_bound_mask(
        order, unmasking_lib.predictive_entropy(logits), candidates,
        state.traced["entropy_bound"], demoted, invariant=opts.batch_invariant)
  else:
    k = jnp.asarray(schedule(opts))[_schedule_step(opts, state)]          # [B]
    commit = select_ranked(conf, candidates, k, alg_temp, keys[:, 2], demoted,
                           invariant=opts.batch_invariant)

  canvas = _put_block(state.canvas, jnp.where(commit, x0, block), start)
  new = state.replace(canvas=canvas, step=state.step + 1, nfe=state.nfe + 1, finite=finite,
                      row_step=state.row_step + live.astype(jnp.int32),
                      committed=state.committed + jnp.sum(commit, axis=1, dtype=jnp.int32))
  # Done stays done (a final answer stays final; a row the serving engine retired stays
  # retired), and a row whose own S steps ran is done.
  done = row_done(cfg, *response_view(cfg, opts, new)) | state.done
  return new.replace(done=done | (new.row_step >= opts.steps))


def running(opts: LLaDAOptions, state: LLaDAState) -> Array:
  """More steps to run: a fixed schedule runs its `steps`; entropy_bound runs until every
  row is done (early_stop) or fully decided (G steps at most: each step commits >= 1 per
  row with masks left). With early_stop, rows that are done end the loop either way."""
  more = state.step < opts.steps
  if opts.adaptive and not opts.early_stop:
    more = more & ~jnp.all(state.committed >= opts.gen_length)
  return more & ~jnp.all(state.done) if opts.early_stop else more


def finish(cfg: ModelConfig, opts, state) -> base.DecodeOutput:
  response, decided = response_view(cfg, opts, state)
  pad = base.output_pad_id(cfg)
  tokens, lengths, _ = base.finalize(response, decided, base.stop_ids(cfg), pad)
  return base.decode_output(tokens, lengths, state.nfe, state.step, state.committed,
                            row_done(cfg, response, decided), state.finite, pad)


class LLaDADecoder(protocol.LoopDecoder):
  """LLaDA: full-canvas bidirectional forwards, the top-k of each semi-AR block per step."""
  module = sys.modules[__name__]
  options = LLaDAOptions
  sampling_options = ("temperature", "alg_temp")

  def forwards(self, state):
    return state.row_step  # each row follows its own S steps


DREAM_DEFAULTS = {"remasking": "entropy"}


class DreamDecoder(LLaDADecoder):
  """LLaDA's loop with Dream's default ordering (`remasking="entropy"`)."""
  defaults = DREAM_DEFAULTS


def llada_generate(params, cfg: ModelConfig, prompt_tokens, prompt_valid=None, rng=None, *,
                   on_nonfinite: str = "raise", **options) -> base.DecodeOutput:
  """Masked-diffusion decoding of a left-padded prompt batch (one jitted while_loop).

  Args:
    params: model parameters.
    cfg: the model config (needs mask_token_id).
    prompt_tokens: [B, P] int left-padded prompts; prompt_valid: [B, P] bool (None: all real).
    rng: PRNG key for temperature / random orders (default key 0), or [B] keys, one per
      row (each row then draws from its own key only; docs/decoders.md).
    on_nonfinite: "raise" (NonFiniteLogitsError naming rows whose logits were NaN/inf) or
      "flag" (return them with `finite` False, lengths 0).
    **options: fields of `LLaDAOptions` (unknown names raise ValueError).
  """
  return protocol.decode_batch(LLaDADecoder, params, cfg, prompt_tokens, prompt_valid, rng,
                               on_nonfinite=on_nonfinite, **options)


def dream_generate(params, cfg: ModelConfig, prompt_tokens, prompt_valid=None, rng=None, *,
                   on_nonfinite: str = "raise", **options) -> base.DecodeOutput:
  """`llada_generate` with Dream's default ordering (`remasking="entropy"`)."""
  return protocol.decode_batch(DreamDecoder, params, cfg, prompt_tokens, prompt_valid, rng,
                               on_nonfinite=on_nonfinite, **options)

