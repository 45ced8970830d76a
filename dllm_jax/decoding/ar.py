"""Autoregressive decoding with a K/V cache: one causal prefill, then one token per forward.

Shape legend: B batch, P padded prompt length, G gen_length, V vocab, L layers,
C = P + G cache slots, K kv heads, Dh head dim.

Prefill runs the left-padded prompt once with causal ids (= RoPE positions from
`masks.left_pad_positions`), writing all P slots; padding slots get NO_KEY and are never
attended. Each decode step feeds the last token at its row's next position and writes one
slot. Sampling is greedy at temperature 0, else top-k / top-p filtered Gumbel-max with a fresh
key per step and row (`fold_in`). The [MASK] id, when the config has one, is never emitted.

A row is done at its first stop token (EOS/EoT) or after G tokens; done rows emit `pad` and
the loop exits when every row is done. Rows never interact, so stopping early changes nothing
before a row's EOS. NFE = 1 (prefill) + decode steps.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, sampling
from dllm_jax.models import kv_cache, masks
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer

Array = jnp.ndarray


@dataclasses.dataclass(frozen=True)
class AROptions:
  """Static decoding options (hashable: a jit static argument).

  Attributes:
    gen_length: G, the most tokens generated per row.
    temperature: 0 = greedy.
    top_k: keep the k most likely tokens before sampling (0 = all).
    top_p: nucleus mass to keep (1 = all).
    early_stop: exit the loop once every row has emitted a stop token.
  """
  gen_length: int = 128
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  early_stop: bool = True

  def __post_init__(self):
    if not isinstance(self.gen_length, (int, np.integer)) or self.gen_length <= 0:
      raise ValueError(f"gen_length must be a positive int, got {self.gen_length!r}.")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 keeps all tokens), got {self.top_k}.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")


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


def _next_token_view(cfg: ModelConfig) -> ModelConfig:
  """The raw output at slot t predicts slot t + 1 in both conventions; shifted-logits models
  (Dream) only re-index it, which a one-token step would undo, so decode unshifted."""
  return cfg.replace(shift_logits=False) if cfg.shift_logits else cfg


def _choose(cfg: ModelConfig, opts: AROptions, logits: Array, rng: Array, step) -> Array:
  """[B, V] logits -> [B] tokens, with a per-row key for `step`."""
  logits = sampling.forbid(logits, (cfg.mask_token_id,))
  keys = sampling.row_keys(rng, step, logits.shape[0])
  return jax.vmap(lambda lg, k: sampling.sample(
      lg, k, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p))(logits, keys)


def _is_stop(cfg: ModelConfig, tokens: Array) -> Array:
  stop = jnp.zeros(tokens.shape, bool)
  for i in base.stop_ids(cfg):
    stop = stop | (tokens == i)
  return stop


def prefill(params, cfg: ModelConfig, opts: AROptions, tokens, valid, rng) -> ARState:
  """Runs the prompt through the model (filling the cache) and samples the first token."""
  b, p = tokens.shape
  g = opts.gen_length
  positions = masks.left_pad_positions(valid)
  cache = kv_cache.init_cache(cfg, b, p + g)
  logits, cache = Transformer(_next_token_view(cfg)).apply(
      {"params": params}, tokens, block_ids=masks.causal_ids(positions), positions=positions,
      valid=valid, cache=cache, write_len=p)
  first = _choose(cfg, opts, logits[:, -1], rng, 0)
  response = jnp.full((b, g), base.output_pad_id(cfg), jnp.int32).at[:, 0].set(first)
  return ARState(response=response, cache=cache, last=first, next_pos=positions[:, -1] + 1,
                 step=jnp.ones((), jnp.int32), nfe=jnp.ones((), jnp.int32),
                 committed=jnp.ones((b,), jnp.int32), done=_is_stop(cfg, first) | (g == 1),
                 rng=rng)


def step(params, cfg: ModelConfig, opts: AROptions, state: ARState) -> ARState:
  """Feeds each row's last token, samples the next one into response[:, step]."""
  pos = state.next_pos[:, None]
  logits, cache = Transformer(_next_token_view(cfg)).apply(
      {"params": params}, state.last[:, None], block_ids=masks.causal_ids(pos), positions=pos,
      cache=state.cache, write_len=1)
  token = _choose(cfg, opts, logits[:, 0], state.rng, state.step)
  token = jnp.where(state.done, base.output_pad_id(cfg), token)
  response = jax.lax.dynamic_update_slice(state.response, token[:, None], (0, state.step))
  done = state.done | _is_stop(cfg, token) | (state.step + 1 >= opts.gen_length)
  return state.replace(response=response, cache=cache, last=token, next_pos=state.next_pos + 1,
                       step=state.step + 1, nfe=state.nfe + 1,
                       committed=state.committed + (~state.done).astype(jnp.int32), done=done)


def running(opts: AROptions, state: ARState) -> Array:
  more = state.step < opts.gen_length
  return more & ~jnp.all(state.done) if opts.early_stop else more


def response_view(cfg: ModelConfig, opts: AROptions, state: ARState) -> tuple[Array, Array]:
  """([B, G] response, [B, G] bool decided)."""
  decided = jnp.arange(opts.gen_length)[None, :] < state.step
  return state.response, jnp.broadcast_to(decided, state.response.shape)


def finish(cfg: ModelConfig, opts: AROptions, state: ARState) -> base.DecodeOutput:
  response, decided = response_view(cfg, opts, state)
  tokens, lengths, _ = base.finalize(response, decided, base.stop_ids(cfg),
                                     base.output_pad_id(cfg))
  return base.DecodeOutput(tokens=tokens, lengths=lengths, nfe=state.nfe, steps=state.step,
                           committed=state.committed, done=state.done)


init_state = prefill  # the uniform decoder interface (see streaming.py)


@functools.partial(jax.jit, static_argnames=("cfg", "opts"))
def _generate(params, tokens, valid, rng, *, cfg, opts):
  state = prefill(params, cfg, opts, tokens, valid, rng)
  state = jax.lax.while_loop(functools.partial(running, opts),
                             functools.partial(step, params, cfg, opts), state)
  return finish(cfg, opts, state)


jit_init_state = jax.jit(prefill, static_argnums=(1, 2))
jit_step = jax.jit(step, static_argnums=(1, 2), donate_argnums=(3,))


def ar_generate(params, cfg: ModelConfig, prompt_tokens, prompt_valid=None, rng=None,
                **options) -> base.DecodeOutput:
  """Cached autoregressive decoding of a left-padded prompt batch (one jitted while_loop).

  Args:
    params: model parameters (a causal LM).
    cfg: the model config.
    prompt_tokens: [B, P] int left-padded prompts; prompt_valid: [B, P] bool (None: all real).
    rng: PRNG key for sampling (default key 0).
    **options: fields of `AROptions` (unknown names raise ValueError).
  """
  opts = base.make_options(AROptions, options)
  base.check_prompts(cfg, prompt_tokens, prompt_valid, opts.gen_length, needs_mask=False)
  rng = jax.random.key(0) if rng is None else rng
  tokens, valid = base.prompt_inputs(prompt_tokens, prompt_valid)
  return _generate(params, tokens, valid, rng, cfg=cfg, opts=opts)
