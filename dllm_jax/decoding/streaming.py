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

It runs every method through its `protocol.Decoder`: `protocol.jit_init`, then
`protocol.jit_step` (the state donated) until `decoder.running` is False, reading
`decoder.view` after each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import numpy as np

from dllm_jax.decoding import api, base, protocol, registry


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


def stream(params, cfg, prompts, *, method: str = registry.DEFAULT_METHOD, rng=None,
           **options) -> Iterator[StreamEvent]:
  """Decodes like `api.generate` (same options) but yields a `StreamEvent` after every
  forward; the last event's `output` equals `generate`'s result."""
  on_nonfinite = options.get("on_nonfinite", "raise")
  base.check_on_nonfinite(on_nonfinite)
  plan = protocol.plan(method, cfg, options)
  decoder = plan.decoder
  tokens, valid = api.as_prompt_batch(cfg, prompts)
  decoder.check(tokens, valid)
  protocol.check_row_inputs(plan, tokens.shape[0])
  rng = jax.random.key(0) if rng is None else rng
  params = plan.params(params)

  state = protocol.jit_init(params, *base.prompt_inputs(tokens, valid), rng, plan.traced,
                            plan.row_inputs, decoder=decoder)
  seen = np.zeros((tokens.shape[0], decoder.gen_length), bool)
  step, more = 0, True
  if decoder.init_forwards:
    seen, event, more = _event(decoder, state, seen, step, on_nonfinite)
    yield event
  while more:
    state = protocol.jit_step(params, state, decoder=decoder)
    step += 1
    seen, event, more = _event(decoder, state, seen, step, on_nonfinite)
    yield event


def _event(decoder, state, seen, step, on_nonfinite):
  """The host view of `state`; the last event (loop finished) carries the output."""
  response, decided = jax.device_get(_view(state, decoder=decoder))
  decided = np.asarray(decided)
  more = bool(_running(state, decoder=decoder))
  output = None
  if not more:
    output = base.raise_if_nonfinite(_output(state, decoder=decoder), on_nonfinite)
  return decided, StreamEvent(step=step, new=decided & ~seen, response=np.asarray(response),
                              decided=decided, output=output), more


_view = jax.jit(lambda state, decoder: decoder.view(state), static_argnames="decoder")
_running = jax.jit(lambda state, decoder: decoder.running(state), static_argnames="decoder")
_output = jax.jit(lambda state, decoder: decoder.output(state), static_argnames="decoder")
