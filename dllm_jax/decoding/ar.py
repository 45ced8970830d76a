"""Autoregressive decoding with a K/V cache: one causal prefill, then one token per forward.

Shape legend: B batch, P padded prompt length, G gen_length, V vocab, L layers,
C = P + G cache slots, K kv heads, Dh head dim.

How it works, in full: docs/decoders.md, `decoding.ar`.
"""

from __future__ import annotations

import dataclasses
import sys

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, protocol, sampling
from dllm_jax.models import kv_cache, masks
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer

Array = jnp.ndarray


@dataclasses.dataclass(frozen=True)
class AROptions:
  """Decoding options; `split()` gives the static part (a jit argument) and the traced options.

  Attributes:
    gen_length: G, the most tokens generated per row.
    temperature: 0 = greedy.
    top_k: keep the k most likely tokens before sampling (0 = all).
    top_p: nucleus mass to keep (1 = all).
    early_stop: exit the loop once every row has emitted a stop token.
  """
  gen_length: int = base.GEN_LENGTH
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  early_stop: bool = True

  TRACED = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}

  def __post_init__(self):
    object.__setattr__(self, "early_stop", base.check_flag("early_stop", self.early_stop))
    if not isinstance(self.gen_length, (int, np.integer)) or self.gen_length <= 0:
      raise ValueError(f"gen_length must be a positive int, got {self.gen_length!r}.")
    base.check_number("temperature", self.temperature, low=0.0)
    if not isinstance(self.top_k, (int, np.integer)) or not 0 <= self.top_k < 2 ** 31:
      raise ValueError(f"top_k must be an int in [0, 2**31) (0 keeps all tokens), got "
                       f"{self.top_k!r}.")
    base.check_number("top_p", self.top_p, low=0.0, low_open=True, high=1.0)

  def split(self):
    """(static options, {temperature, top_k, top_p} [] arrays)."""
    return base.split_options(self, self.TRACED, {"top_k": np.int32})


@flax.struct.dataclass
class ARState:
  """Loop carry. response [B, G]; last/next_pos/committed/done [B]; step/nfe []."""
  response: Array
  cache: kv_cache.KVCache
  last: Array
  next_pos: Array
  step: Array
  nfe: Array
  committed: Array
  done: Array
  rng: Array
  traced: dict
  finite: Array


def _next_token_view(cfg: ModelConfig) -> ModelConfig:
  """The raw output at slot t predicts slot t + 1 in both conventions; shifted-logits models
  (Dream) only re-index it, which a one-token step would undo, so decode unshifted."""
  return cfg.replace(shift_logits=False) if cfg.shift_logits else cfg


def _choose(cfg: ModelConfig, opts: AROptions, traced: dict, logits: Array, rng: Array, step,
            row_step: Array) -> Array:
  """[B, V] logits -> [B] tokens, with a per-row key for loop `step` (one `rng`) or for the
  row's response slot `row_step` [B] (per-row keys `rng` [B]). Greedy `opts` (static
  temperature 0) take the argmax with no sampling code."""
  logits = sampling.forbid(logits, (cfg.mask_token_id,))
  if sampling.is_row_keys(rng):
    keys = sampling.row_step_keys(rng, row_step)
  else:
    keys = sampling.row_keys(rng, step, logits.shape[0], traced.get("row_offset", 0))
  return sampling.map_rows(sampling.sample, (logits, keys),
                           temperature=base.traced_option(opts, traced, "temperature"),
                           top_k=traced["top_k"], top_p=traced["top_p"])


def _is_stop(cfg: ModelConfig, tokens: Array) -> Array:
  stop = jnp.zeros(tokens.shape, bool)
  for i in base.stop_ids(cfg):
    stop = stop | (tokens == i)
  return stop


def prefill(params, cfg: ModelConfig, opts: AROptions, tokens, valid, rng,
            traced: dict | None = None) -> ARState:
  """Runs the prompt through the model (filling the cache) and samples the first token.

  `traced` are the traced options (default: `opts.split()[1]`); `rng` is one key or [B] keys
  (one per row, see the docs/decoders.md)."""
  traced = opts.split()[1] if traced is None else traced
  b, p = tokens.shape
  g = opts.gen_length
  positions = masks.left_pad_positions(valid)
  cache = kv_cache.init_cache(cfg, b, p + g)
  logits, cache = Transformer(_next_token_view(cfg)).apply(
      {"params": params}, tokens, block_ids=masks.causal_ids(positions), positions=positions,
      valid=valid, cache=cache, write_len=p)
  first = _choose(cfg, opts, traced, logits[:, -1], rng, 0, jnp.zeros((b,), jnp.int32))
  response = jnp.full((b, g), base.output_pad_id(cfg), jnp.int32).at[:, 0].set(first)
  return ARState(response=response, cache=cache, last=first, next_pos=positions[:, -1] + 1,
                 step=jnp.ones((), jnp.int32), nfe=jnp.ones((), jnp.int32),
                 committed=jnp.ones((b,), jnp.int32), done=_is_stop(cfg, first) | (g == 1),
                 rng=rng, traced=traced, finite=sampling.all_finite(logits[:, -1]))


def step(params, cfg: ModelConfig, opts: AROptions, state: ARState) -> ARState:
  """Feeds each row's last token, samples the next one into response[b, committed[b]] (a live
  row has committed one token per loop step, so in a plain decode that is column `step`)."""
  pos = state.next_pos[:, None]
  logits, cache = Transformer(_next_token_view(cfg)).apply(
      {"params": params}, state.last[:, None], block_ids=masks.causal_ids(pos), positions=pos,
      cache=state.cache, write_len=1)
  token = _choose(cfg, opts, state.traced, logits[:, 0], state.rng, state.step,
                  state.committed)
  token = jnp.where(state.done, base.output_pad_id(cfg), token)
  column = jnp.where(state.done, opts.gen_length, state.committed)  # done rows: dropped
  # A select over [B, G], not a scatter: one fused pass.
  at_column = jnp.arange(opts.gen_length, dtype=jnp.int32)[None] == column[:, None]
  response = jnp.where(at_column, token[:, None], state.response)
  done = state.done | _is_stop(cfg, token) | (state.committed + 1 >= opts.gen_length)
  return state.replace(response=response, cache=cache, last=token, next_pos=state.next_pos + 1,
                       step=state.step + 1, nfe=state.nfe + 1,
                       committed=state.committed + (~state.done).astype(jnp.int32), done=done,
                       finite=state.finite & (sampling.all_finite(logits) | state.done))


def running(opts: AROptions, state: ARState) -> Array:
  more = state.step < opts.gen_length
  return more & ~jnp.all(state.done) if opts.early_stop else more


def response_view(cfg: ModelConfig, opts: AROptions, state: ARState) -> tuple[Array, Array]:
  """([B, G] response, [B, G] bool decided)."""
  decided = jnp.arange(opts.gen_length)[None, :] < state.step
  return state.response, jnp.broadcast_to(decided, state.response.shape)


def finish(cfg: ModelConfig, opts: AROptions, state: ARState) -> base.DecodeOutput:
  response, decided = response_view(cfg, opts, state)
  pad = base.output_pad_id(cfg)
  tokens, lengths, _ = base.finalize(response, decided, base.stop_ids(cfg), pad)
  return base.decode_output(tokens, lengths, state.nfe, state.step, state.committed,
                            state.done, state.finite, pad)


init_state = prefill


class ARDecoder(protocol.LoopDecoder):
  """Cached autoregressive decoding: the prefill samples the first token, each step one more."""
  module = sys.modules[__name__]
  options = AROptions
  init_forwards = True
  attention = "causal"

  def pad(self, state, prompt_len):
    # The cache is position-ordered: a larger prompt bucket only appends empty slots.
    return state.replace(cache=protocol.append_cache_slots(state.cache,
                                                           prompt_len + self.gen_length))

  def progress(self, state):
    # A live row has committed response[:committed]; a done row's EOS is in it.
    return state.response, state.committed, state.done, state.finite, state.committed


def ar_generate(params, cfg: ModelConfig, prompt_tokens, prompt_valid=None, rng=None, *,
                on_nonfinite: str = "raise", **options) -> base.DecodeOutput:
  """Cached autoregressive decoding of a left-padded prompt batch (one jitted while_loop).

  Args:
    params: model parameters (a causal LM).
    cfg: the model config.
    prompt_tokens: [B, P] int left-padded prompts; prompt_valid: [B, P] bool (None: all real).
    rng: PRNG key for sampling (default key 0), or [B] keys, one per row (a row's tokens
      then depend only on its key; docs/decoders.md).
    on_nonfinite: "raise" (NonFiniteLogitsError naming rows whose logits were NaN/inf) or
      "flag" (return them with `finite` False, lengths 0).
    **options: fields of `AROptions` (unknown names raise ValueError).
  """
  return protocol.decode_batch(ARDecoder, params, cfg, prompt_tokens, prompt_valid, rng,
                               on_nonfinite=on_nonfinite, **options)


def check(cfg: ModelConfig, tokens, valid, opts: AROptions) -> None:
  """Validates a prompt batch against the options (before anything is compiled)."""
  base.check_prompts(cfg, tokens, valid, opts.gen_length, needs_mask=False)
