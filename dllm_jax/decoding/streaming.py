"""Streaming decoding: yields the tokens each forward commits, for interactive front ends.

Shape legend: B batch, G gen_length.

It drives the same jitted step function the batch decoders loop over in `lax.while_loop`
(state donated between calls), with one host round trip per step to report progress. It is
for display, not for benchmarks: the fused loop in `generate` is the fast path. Every method
streams; there is one event after every forward (AR's prefill and D2F's / block diffusion's
first forward happen in the init, so their first event has step 0; a hybrid's round, its
drafter forwards and the verifying forward, is one event: its `steps`, not its `nfe`), and
the last event
carries the same `DecodeOutput` that `generate` returns (or raises NonFiniteLogitsError like
it, unless on_nonfinite="flag").

Every decoder module used here exposes the same small interface, on the checked options
`opts` that `_STREAMERS` builds for the method:
  check(cfg, tokens, valid, opts)                        (prompt batch vs options)
  jit_init_state(params, cfg, opts, tokens, valid, rng) -> state
  jit_step(params, cfg, opts, state) -> state            (state donated)
  running(opts, state) -> [] bool
  response_view(cfg, opts, state) -> ([B, G] response, [B, G] bool decided)
  finish(cfg, opts, state) -> DecodeOutput
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import numpy as np

from dllm_jax.decoding import (adaptive, api, ar, base, d2f, fast_dllm, llada, selfspec,
                               speculative)


@dataclasses.dataclass(frozen=True)
class _Streamer:
  """How to stream one method: its module, how to build its options, whether the init
  already runs a forward (and so already commits tokens)."""
  module: object
  options: object
  init_forwards: bool


_STREAMERS = {
    "ar": _Streamer(ar, lambda cfg, **o: base.make_options(ar.AROptions, o), True),
    "llada": _Streamer(llada, lambda cfg, **o: base.make_options(llada.LLaDAOptions, o), False),
    "dream": _Streamer(llada, lambda cfg, **o: base.make_options(
        llada.LLaDAOptions, {**llada.DREAM_DEFAULTS, **o}), False),
    "fast_dllm": _Streamer(fast_dllm, lambda cfg, **o: base.make_options(
        fast_dllm.FastDLLMOptions, o), False),
    "d2f": _Streamer(d2f, d2f.d2f_options, True),
    "block_diffusion": _Streamer(d2f, d2f.block_diffusion_options, True),
    # Hybrids: the options carry the drafter (drafter_params, drafter_cfg), and the init
    # runs round 0 (drafts and the verifying prefill), which already commits tokens.
    "speculative": _Streamer(speculative, speculative.run_options, True),
    "selfspec": _Streamer(selfspec, lambda cfg, **o: base.make_options(
        selfspec.SelfSpecOptions, o), True),
    "adaptive": _Streamer(adaptive, adaptive.run_options, True),
}


@dataclasses.dataclass(frozen=True)
class StreamEvent:
  """One decode step as seen from the host.

  Attributes:
    step: forwards run so far after the first event (0 for the init's forward: AR prefill,
      D2F's first forward, a hybrid's round 0), loop iterations otherwise (a hybrid: rounds).
    new: [B, G] bool, slots committed by this forward (each slot is new exactly once).
    response: [B, G] response slots after the step (undecided slots hold [MASK] for
      diffusion decoders, pad for AR).
    decided: [B, G] bool.
    output: the final `DecodeOutput` on the last event, else None.
  """
  step: int
  new: np.ndarray
  response: np.ndarray
  decided: np.ndarray
  output: base.DecodeOutput | None = None


def stream(params, cfg, prompts, *, method: str = "llada", rng=None,
           **options) -> Iterator[StreamEvent]:
  """Decodes like `api.generate` (same options) but yields a `StreamEvent` after every
  forward; the last event's `output` equals `generate`'s result."""
  if method not in _STREAMERS:
    api.resolve(method)  # the unknown-method error
  api.check_options(method, options)
  on_nonfinite = options.pop("on_nonfinite", "raise")
  base.check_on_nonfinite(on_nonfinite)
  streamer = _STREAMERS[method]
  module = streamer.module
  opts = streamer.options(cfg, **options)
  tokens, valid = api.as_prompt_batch(cfg, prompts)
  module.check(cfg, tokens, valid, opts)
  rng = jax.random.key(0) if rng is None else rng

  state = module.jit_init_state(params, cfg, opts, tokens, valid, rng)
  seen = np.zeros((tokens.shape[0], opts.gen_length), bool)
  step, more = 0, True
  if streamer.init_forwards:
    seen, event, more = _event(module, cfg, opts, state, seen, step, on_nonfinite)
    yield event
  while more:
    state = module.jit_step(params, cfg, opts, state)
    step += 1
    seen, event, more = _event(module, cfg, opts, state, seen, step, on_nonfinite)
    yield event


def _event(module, cfg, opts, state, seen, step, on_nonfinite):
  """The host view of `state`; the last event (loop finished) carries the output."""
  response, decided = jax.device_get(module.response_view(cfg, opts, state))
  decided = np.asarray(decided)
  more = bool(module.running(opts, state))
  output = None
  if not more:
    output = base.raise_if_nonfinite(module.finish(cfg, opts, state), on_nonfinite)
  return decided, StreamEvent(step=step, new=decided & ~seen, response=np.asarray(response),
                              decided=decided, output=output), more
