"""What every decoder shares: left-padded prompt batches, input and option checks, the window
check, the output record, non-finite-logit handling and parameter placement.

Shape legend: B batch, P padded prompt length, G generation length (response slots).

Prompts are **left padded**: a row's real tokens end at column P - 1, so every row's response
starts at canvas column P and RoPE positions come from `masks.left_pad_positions(valid)`.
That makes a batched decode give each row exactly its one-prompt result.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import option_cache
from dllm_jax.models import masks
from dllm_jax.models.config import ModelConfig

Array = jnp.ndarray

# Defaults shared by every method (docs/decoding_options.md lists the whole vocabulary).
GEN_LENGTH = 128
BLOCK_LENGTH = 32          # capped at gen_length: a shorter response is one block
ON_NONFINITE = ("raise", "flag")


class NonFiniteLogitsError(FloatingPointError):
  """A forward produced NaN/inf logits for some rows, so their tokens mean nothing.

  Attributes:
    rows: the batch rows whose logits were non-finite.
    output: the flagged `DecodeOutput` (those rows have `finite` False, `lengths` 0).
  """

  def __init__(self, rows, output=None):
    self.rows, self.output = [int(r) for r in rows], output
    super().__init__(
        f"the model produced non-finite (NaN/inf) logits for batch row(s) {self.rows}, so "
        "their tokens are meaningless. Check the weights (dllm_jax.models.finite names a "
        "NaN/inf tensor) and the dtype; pass on_nonfinite='flag' to get the output with those "
        "rows flagged (finite False, lengths 0) instead of this error.")


@flax.struct.dataclass
class DecodeOutput:
  """Result of one batched decode.

  Attributes:
    tokens: [B, G] response tokens; everything after a row's first EOS is `pad`.
    lengths: [B] response tokens before the first EOS (the EOS itself not counted); this is
      what tokens/s counts.
    nfe: [] model forward passes the loop ran (one batched call counts once).
    steps: [] loop iterations.
    committed: [B] tokens each row committed (decided) during the loop.
    done: [B] the row finished (EOS reached or all G slots decided).
    finite: [B] bool, every forward gave the row finite logits. A False row's tokens are
      all pad and its length 0 (`generate` raises NonFiniteLogitsError unless
      on_nonfinite="flag").
  """
  tokens: Array
  lengths: Array
  nfe: Array
  steps: Array
  committed: Array
  done: Array
  finite: Array | None = None

  @property
  def tokens_per_step(self) -> Array:
    """Mean response tokens committed per forward pass, over the batch."""
    return jnp.mean(self.committed) / jnp.maximum(self.nfe, 1)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, length: int | None = None):
  """Left-pads token lists into ([B, P] int32 tokens, [B, P] bool valid) NumPy arrays (the
  jitted decoders move them to the device with their other arguments)."""
  if not prompts:
    raise ValueError("Empty prompt batch: pass at least one prompt.")
  longest = max(len(p) for p in prompts)
  if longest == 0:
    raise ValueError("Every prompt is empty; a prompt needs at least one token.")
  length = longest if length is None else length
  if longest > length:
    raise ValueError(f"A prompt has {longest} tokens but the padded length is {length}.")
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  valid = np.zeros((len(prompts), length), bool)
  for i, p in enumerate(prompts):
    if len(p):
      tokens[i, length - len(p):] = p
      valid[i, length - len(p):] = True
  return tokens, valid


def as_input(x, dtype) -> Array | np.ndarray:
  """A decoder input as `dtype`, left where it is.

  A jax.Array stays on its devices (and keeps its sharding); anything else becomes a NumPy
  array, which the jitted decoder moves to the device with its other arguments. That is
  cheaper than a `jnp.asarray` dispatch per input, a cost every short decode pays.
  """
  if isinstance(x, jax.Array):
    return x if x.dtype == dtype else x.astype(dtype)
  return np.asarray(x, dtype)


def prompt_inputs(tokens, valid):
  """(int32 tokens, bool valid) decoder inputs; valid None means no padding."""
  valid = np.ones(np.shape(tokens), bool) if valid is None else valid
  return as_input(tokens, np.int32), as_input(valid, np.bool_)


def check_window(cfg: ModelConfig, prompt_len: int, gen_length: int,
                 block_length: int = 1) -> None:
  """The one window check every method runs: prompt + gen_length <= max_seq_len.

  The message names the largest gen_length that fits (a multiple of block_length).
  """
  if not isinstance(gen_length, (int, np.integer)) or gen_length <= 0:
    raise ValueError(f"gen_length must be a positive int, got {gen_length!r}.")
  total = prompt_len + gen_length
  if total > cfg.max_seq_len:
    room = (cfg.max_seq_len - prompt_len) // block_length * block_length
    fix = (f"pass gen_length={room} or less" + (
        f" (a multiple of block_length={block_length})" if block_length > 1 else "")
           if room > 0 else "shorten the prompt")
    raise ValueError(
        f"prompt ({prompt_len}) + gen_length ({gen_length}) = {total} exceeds the model "
        f"window max_seq_len={cfg.max_seq_len} of {cfg.name!r}; {fix}.")


def check_prompts(cfg: ModelConfig, tokens, valid, gen_length: int, *,
                  needs_mask: bool = True, block_length: int = 1) -> None:
  """Checks a prompt batch before anything is compiled; raises ValueError naming the fix."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"prompt tokens must be [batch, length], got shape {tokens.shape}.")
  if not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"prompt tokens must be integer ids, got {tokens.dtype}.")
  if valid is not None:
    valid = np.asarray(valid)
    if valid.shape != tokens.shape:
      raise ValueError(f"valid mask shape {valid.shape} differs from tokens {tokens.shape}.")
    if np.any(valid[:, :-1] & ~valid[:, 1:]):
      raise ValueError("prompts must be LEFT padded (valid must be False...True per row); "
                       "use dllm_jax.decoding.pad_prompts.")
    if not np.all(valid[:, -1]):
      raise ValueError("a prompt row is empty; every prompt needs at least one token.")
  check_window(cfg, tokens.shape[1], gen_length, block_length)
  if np.any((tokens < 0) | (tokens >= cfg.vocab_size)):
    raise ValueError(f"prompt holds token ids outside the vocabulary [0, {cfg.vocab_size}).")
  if needs_mask:
    check_mask_free(cfg, tokens, valid)


def check_mask_free(cfg: ModelConfig, tokens, valid) -> None:
  """Raises ValueError unless `cfg` has a mask id and no prompt holds it (`check_prompts`'
  diffusion part)."""
  if cfg.mask_token_id is None:
    raise ValueError(
        f"model config {cfg.name!r} has no mask_token_id; diffusion decoding needs one "
        "(set ModelConfig.mask_token_id or load it from the checkpoint).")
  tokens = np.asarray(tokens)
  real = tokens if valid is None else np.where(valid, tokens, -1)
  if np.any(real == cfg.mask_token_id):
    raise ValueError(
        f"a prompt contains the mask id {cfg.mask_token_id}; remove [MASK] tokens from "
        "prompts (they would be decoded as blanks).")


def stop_ids(cfg: ModelConfig, *, include_eot: bool = True) -> tuple[int, ...]:
  """Ids that end a response: EOS and, for chat models, end-of-turn."""
  ids = [cfg.eos_token_id]
  if include_eot:
    ids.append(cfg.eot_token_id)
  return tuple(sorted({i for i in ids if i is not None}))


def _first_stop(response: Array, decided: Array, stops: tuple[int, ...]):
  """([B] index of each row's first decided stop token, or G; [B] whether it has one)."""
  is_stop = jnp.zeros(response.shape, bool)
  for s in stops:
    is_stop = is_stop | (response == s)
  is_stop = is_stop & decided
  found = jnp.any(is_stop, axis=1)
  return jnp.where(found, jnp.argmax(is_stop, axis=1), response.shape[1]), found


def finalize(response: Array, decided: Array, stops: tuple[int, ...], pad_id: int):
  """Cuts each row at its first stop token.

  Args:
    response: [B, G] canvas response slots (undecided slots may hold the mask id).
    decided: [B, G] bool, slot holds a final token.
    stops: stop token ids.
  Returns ([B, G] tokens padded after the first stop, [B] lengths before it,
           [B] bool whether a stop was decided).
  """
  first, found = _first_stop(response, decided, stops)
  keep = jnp.arange(response.shape[1])[None, :] < first[:, None]
  return jnp.where(keep, response, pad_id), first.astype(jnp.int32), found


def first_stop_decided(response: Array, decided: Array, stops: tuple[int, ...]) -> Array:
  """[B] bool: the row's response holds a decided stop token and every slot before the first
  decided stop is decided too (so the text up to EOS can no longer change)."""
  first, found = _first_stop(response, decided, stops)
  before = jnp.arange(response.shape[1])[None, :] < first[:, None]
  return found & jnp.all(decided | ~before, axis=1)

def init_canvas(tokens: Array, valid: Array | None, gen_length: int, fill_id: int):
  """Appends G `fill_id` slots to a left-padded prompt batch.

  Returns ([B, P+G] int32 canvas, [B, P+G] bool valid, [B, P+G] int32 RoPE positions);
  the response slots are valid and continue each row's positions after its last real token.
  """
  b, p = tokens.shape
  valid = jnp.ones((b, p), bool) if valid is None else jnp.asarray(valid, bool)
  canvas = jnp.concatenate(
      [jnp.asarray(tokens, jnp.int32), jnp.full((b, gen_length), fill_id, jnp.int32)], axis=1)
  canvas_valid = jnp.concatenate([valid, jnp.ones((b, gen_length), bool)], axis=1)
  return canvas, canvas_valid, masks.left_pad_positions(canvas_valid)


def output_pad_id(cfg: ModelConfig) -> int:
  """The id written after a response's first stop: pad, else EOS, else 0."""
  for i in (cfg.pad_token_id, cfg.eos_token_id):
    if i is not None:
      return i
  return 0


def check_number(name: str, value, *, low: float | None = None, low_open: bool = False,
                 high: float | None = None, allow_inf: bool = False) -> None:
  """Raises a ValueError naming `name` unless `value` is a real number in range.

  NaN is always rejected, inf unless `allow_inf` (e.g. a threshold above every probability).
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                   np.floating)):
    raise ValueError(f"{name} must be a number, got {value!r}.")
  if math.isnan(value) or (math.isinf(value) and not allow_inf):
    raise ValueError(f"{name}={value} is not a finite number; pass a finite {name}.")
  if low is not None and (value < low or (low_open and value == low)):
    raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}.")
  if high is not None and value > high:
    raise ValueError(f"{name} must be <= {high}, got {value}.")


def check_flag(name: str, value) -> bool:
  """`value` as a Python bool; ValueError naming `name` unless it is a bool (True/False, not
  1, "yes" or an array: a flag that picks the compiled program must be static)."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be True or False, got {value!r}.")
  return bool(value)


def resolve_block_length(block_length, gen_length: int) -> int:
  """block_length, or the shared default: BLOCK_LENGTH capped at gen_length."""
  if block_length is None:
    return min(BLOCK_LENGTH, gen_length) if isinstance(gen_length, (int, np.integer)) else \
        BLOCK_LENGTH
  if isinstance(block_length, (bool, np.bool_)) or not isinstance(
      block_length, (int, np.integer)) or block_length <= 0:
    raise ValueError(f"block_length must be a positive int, got {block_length!r}.")
  return int(block_length)


def check_on_nonfinite(on_nonfinite: str) -> None:
  if on_nonfinite not in ON_NONFINITE:
    raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}.")


def decode_output(tokens, lengths, nfe, steps, committed, done, finite, pad_id: int):
  """The `DecodeOutput` of a finished loop; rows with non-finite logits are all pad, length 0."""
  return DecodeOutput(tokens=jnp.where(finite[:, None], tokens, pad_id),
                      lengths=jnp.where(finite, lengths, 0), nfe=nfe, steps=steps,
                      committed=committed, done=done, finite=finite)


def raise_if_nonfinite(out: DecodeOutput, on_nonfinite: str = "raise") -> DecodeOutput:
  """Raises NonFiniteLogitsError naming the flagged rows (on_nonfinite="raise")."""
  if on_nonfinite == "raise" and out.finite is not None and not isinstance(
      out.finite, jax.core.Tracer):  # traced (e.g. generate under eval_shape): nothing to check
    finite = np.asarray(out.finite)
    if not finite.all():
      raise NonFiniteLogitsError(np.flatnonzero(~finite), out)
  return out


# Traced options whose zero selects a deterministic rule (temperature 0: argmax; alg_temp 0:
# the top-k by score). The static part keeps whether each is zero (0.0, else 1.0; the value is
# traced), so a greedy decode compiles a loop with no sampling in it (no per-step conditional
# on the traced value, no per-slot keys: 6% of an AR step and 13% of a D2F step of the study's
# model on XLA:CPU), while a sweep of positive values still compiles once.
ZERO_IS_STATIC = ("temperature", "alg_temp")


def split_options(opts, canonical: dict, dtypes: dict, **fixed):
  """(static options, traced): the options with every traced field set to its `canonical`
  value (so all sweeps share one hash: one compile) and a dict of [] arrays holding the real
  values, which the decoder reads inside the loop (through `traced_option`). A field in
  ZERO_IS_STATIC keeps 0.0 when it is zero and becomes 1.0 otherwise. `fixed`: other fields
  the static options take. `opts` was validated when built; the copy is not validated again
  (canonical values are valid by construction), which keeps a batch-1 call's planning cheap."""
  traced = {k: np.asarray(getattr(opts, k), dtypes.get(k, np.float32)) for k in canonical}
  static = copy.copy(opts)
  for k, v in canonical.items():
    object.__setattr__(static, k, (0.0 if getattr(opts, k) == 0 else 1.0)
                       if k in ZERO_IS_STATIC else v)
  for k, v in fixed.items():
    object.__setattr__(static, k, v)
  return static, traced


def traced_option(static, traced: dict, name: str):
  """The value a decoder reads for the traced option `name`: a Python 0.0 where the static
  part says a ZERO_IS_STATIC option is zero (the deterministic rule, traced without
  sampling), else the traced value."""
  if name in ZERO_IS_STATIC and getattr(static, name) == 0.0:
    return 0.0
  return traced[name]


def make_options(cls, options: dict):
  """Builds a frozen options dataclass; unknown names raise a ValueError listing valid ones."""
  names = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(options) - set(names))
  if unknown:
    raise ValueError(f"Unknown option(s) {unknown} for {cls.__name__}; valid options: {names}.")
  return cls(**options)


def _split_method(opts):
  return opts.split()


def checked_options(cls, options: dict, split=None):
  """(opts, static, traced): `make_options(cls, options)` and its `split` (default: the
  dataclass's own `split()`), built once per distinct option set (`option_cache`): a
  batch-1 decode's planning then costs a dict lookup. The traced dict is a fresh copy."""
  return option_cache.checked(cls, options, make_options, split or _split_method)
