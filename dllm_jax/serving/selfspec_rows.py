"""Self-speculative (TiDAR-style) decoding served by the engine: one network, per row.

Shape legend: B slots, A admitted rows, p this admission's prompt bucket, P the largest,
G gen_length, k draft_length.

    engine = Engine(params, cfg, methods="selfspec", options=dict(gen_length=64,
                    draft_length=4), slots=8)

One network (trained with `selfspec_loss`) verifies the previous round's draft causally and
drafts the next k tokens with a block of masks in the same forward (`decoding.selfspec`).
Every option is jit-static (temperature included: greedy is its own rule), so it is fixed
per lane. `decoding.selfspec` keeps every cursor per row: the committed count `n`, the cache
length, the draft and whether it is offered; with [B] keys (`serving.request_keys`) a row's
round-i draws come from fold_in(rng[b], i) (`speculative.round_keys`), and a finished or
empty row's cache does not grow, so a row admitted later decodes as it would alone.

Admission runs round 0 (the forward over prompt ++ k + 1 masks: the first token and the
first draft); a step is one round for every slot (one forward: verify, commit, roll the
cache back, draft). The cache holds each row's prompt in its first p slots and its response
after them, so `pad` prepends P - p empty slots (`rows.prepend_cache_slots`): positions are
the row's own, counted from its first real token. NFE: one forward per round.
"""

from __future__ import annotations

from dllm_jax.decoding import base
from dllm_jax.decoding import selfspec
from dllm_jax.models.config import ModelConfig
from dllm_jax.serving import rows


class SelfSpecRows(rows.RowDecoder):
  """Self-speculative rows: round 0 admits a row; one round (one forward) a step."""

  def __init__(self):
    super().__init__(method="", needs_mask=True)

  def make_options(self, cfg: ModelConfig, options: dict) -> selfspec.SelfSpecOptions:
    selfspec.check_model(cfg)
    return base.make_options(selfspec.SelfSpecOptions, options)

  def split(self, opts: selfspec.SelfSpecOptions):
    return opts, ()  # every option is static

  def gen_length(self, static: selfspec.SelfSpecOptions) -> int:
    return static.gen_length

  def check_window(self, cfg: ModelConfig, static: selfspec.SelfSpecOptions,
                   prompt_len: int) -> None:
    base.check_window(cfg, prompt_len, static.gen_length)
    selfspec.check_capacity(cfg, prompt_len, static)

  def check(self, cfg, tokens, valid, opts: selfspec.SelfSpecOptions):
    selfspec.check(cfg, tokens, valid, opts)

  def init(self, params, cfg, static, traced, tokens, valid, keys, mesh=None, rules=None):
    return selfspec._init(params, tokens, valid, keys, cfg=cfg, opts=static)

  def pad(self, cfg, static, state, prompt_len: int):
    # The cache is [prompt width | G]: pad the prompt slots (empty; positions are the row's).
    width = state.cache.capacity - static.gen_length
    return state.replace(cache=rows.prepend_cache_slots(
        state.cache, prompt_len - width, selfspec._capacity(prompt_len, static)))

  def step(self, params, cfg, static, state, mesh=None, rules=None):
    return selfspec._step(params, state, cfg=cfg, opts=static)

  def with_traced(self, state, traced):
    return state

  def progress(self, static, state):
    # response[:n] is committed (final); a row's forwards are its rounds (one each), as
    # `selfspec_generate` counts a one-row batch.
    return state.response, state.n, state.done, state.finite, state.rounds


rows.register(selfspec.SelfSpecDecoder, SelfSpecRows())
