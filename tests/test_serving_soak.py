"""Soak: 1,000 requests, some invalid, some cancelled, through a small two-lane engine.

Every valid request is answered exactly once, every invalid one with its named error, and
no slot leaks (occupancy returns to 0, nothing queued).
"""

import numpy as np

from dllm_jax.models import get_preset
from dllm_jax.serving import (BadOptionError, Engine, InvalidPromptError, MaskInPromptError,
                              PromptTooLongError, Result, UnknownMethodError)
from test_decoding_d2f import peaked_params

CFG = get_preset("tiny")
INVALID = (
    (dict(prompt=[5] * 9, method="ar"), PromptTooLongError),
    (dict(prompt=[5, CFG.mask_token_id], method="d2f"), MaskInPromptError),
    (dict(prompt=[5], method="fast_dllm"), UnknownMethodError),
    (dict(prompt=[5], method="ar", options=dict(top_k=-1)), BadOptionError),
    (dict(prompt=[5], method="d2f", max_new_tokens=0), BadOptionError),
    (dict(prompt=[], method="ar"), InvalidPromptError),
    (dict(prompt=[CFG.vocab_size], method="d2f"), InvalidPromptError),
)


def test_soak_1000_requests():
  engine = Engine(peaked_params(), CFG,
                  methods={"ar": dict(gen_length=4, temperature=1.0),
                           "d2f": dict(gen_length=4, block_length=2, temperature=1.0)},
                  slots=8, max_prompt_len=8, prompt_buckets=(8,), admit_sizes=(1, 8))
  rng = np.random.default_rng(0)
  expect, answered, cancelled = {}, {}, set()
  for i in range(1000):
    if rng.random() < 0.1:
      kw, kind = INVALID[int(rng.integers(len(INVALID)))]
      kw = dict(kw)
      expect[engine.submit(kw.pop("prompt"), **kw)] = kind
    else:
      prompt = [int(t) for t in rng.integers(4, CFG.vocab_size, rng.integers(1, 9))]
      method = ("ar", "d2f")[i % 2]
      expect[engine.submit(prompt, method=method, seed=i,
                           max_new_tokens=int(rng.integers(1, 5)))] = None
    if i % 50 == 49:  # serve a little while requests keep arriving; cancel one now and then
      for event in engine.step():
        if isinstance(event, Result):
          assert event.request_id not in answered
          answered[event.request_id] = event
      running = [s.request.id for lane in engine.lanes.values() for s in lane.slots if s]
      if running and engine.cancel(running[0]):
        cancelled.add(running[0])
  for event in engine.serve():
    if isinstance(event, Result):
      assert event.request_id not in answered
      answered[event.request_id] = event
  assert set(answered) == set(expect)
  for rid, kind in expect.items():
    result = answered[rid]
    if kind is not None:
      assert result.status == "error" and type(result.error) is kind
    elif rid in cancelled:
      assert result.status == "cancelled"
    else:
      assert result.ok and 0 <= len(result.tokens) <= 4
  assert engine.occupancy == 0 and not engine.busy
  assert all(s is None for lane in engine.lanes.values() for s in lane.slots)
  assert sum(kind is None for kind in expect.values()) > 800 and cancelled
