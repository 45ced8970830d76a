"""Streaming decoding: yields the tokens each step commits, for interactive front ends.

Shape legend: B batch, G gen_length.

It drives the same jitted step function the batch decoders loop over in `lax.while_loop`
(state donated between calls), with one host round trip per step to report progress. It is
for display, not for benchmarks: the fused loop in `generate` is the fast path. The final
`StreamEvent` carries the same `DecodeOutput` that `generate` returns.

Every decoder module used here exposes the same small interface:
  jit_init_state(params, cfg, opts, tokens, valid, rng) -> state
  jit_step(params, cfg, opts, state) -> state          (state donated)
  running(opts, state) -> [] bool
  response_view(cfg, opts, state) -> ([B, G] response, [B, G] bool decided)
  finish(cfg, opts, state) -> DecodeOutput
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import numpy as np

from dllm_jax.decoding import api, ar, base, fast_dllm, llada

# method -> (module, options class, default options)
_STREAMABLE = {
    "ar": (ar, ar.AROptions, {}),
    "llada": (llada, llada.LLaDAOptions, {}),
    "dream": (llada, llada.LLaDAOptions, {"remasking": "entropy"}),
    "fast_dllm": (fast_dllm, fast_dllm.FastDLLMOptions, {}),
}


@dataclasses.dataclass(frozen=True)
class StreamEvent:
  """One decode step as seen from the host.

  Attributes:
    step: loop iterations done so far.
    new: [B, G] bool, slots committed by this step.
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
  """Decodes like `api.generate` but yields a `StreamEvent` after every step."""
  if method not in _STREAMABLE:
    raise ValueError(f"method {method!r} cannot be streamed; use one of {sorted(_STREAMABLE)} "
                     "(or api.generate for the others).")
  module, options_cls, defaults = _STREAMABLE[method]
  opts = base.make_options(options_cls, {**defaults, **options})
  tokens, valid = api.as_prompt_batch(cfg, prompts)
  if method == "ar":
    base.check_prompts(cfg, tokens, valid, opts.gen_length, needs_mask=False)
  elif method == "fast_dllm":
    base.check_prompts(cfg, tokens, valid, opts.gen_length)
  else:
    llada.check(cfg, tokens, valid, opts)
  rng = jax.random.key(0) if rng is None else rng

  state = module.jit_init_state(params, cfg, opts, tokens, valid, rng)
  seen = np.zeros((tokens.shape[0], opts.gen_length), bool)
  step, more = 0, True
  if method == "ar":  # the prefill already chose the first token
    seen, event, more = _event(module, cfg, opts, state, seen, step)
    yield event
  while more:
    state = module.jit_step(params, cfg, opts, state)
    step += 1
    seen, event, more = _event(module, cfg, opts, state, seen, step)
    yield event


def _event(module, cfg, opts, state, seen, step):
  """The host view of `state`; the last event (loop finished) carries the output."""
  response, decided = jax.device_get(module.response_view(cfg, opts, state))
  decided = np.asarray(decided)
  more = bool(module.running(opts, state))
  output = None if more else module.finish(cfg, opts, state)
  return decided, StreamEvent(step=step, new=decided & ~seen, response=np.asarray(response),
                              decided=decided, output=output), more
