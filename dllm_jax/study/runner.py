"""Runs one decoder over a prompt set and tallies accuracy, tokens/s, latency and NFE.

A *cell* of the study is (method, setting, batch size). Each cell:
  1. encodes the held-out prompts left-padded to one fixed length P (static shapes, so one
     compile serves every batch);
  2. runs the first batch once untimed to compile (reported as `compile_s`);
  3. times every batch from dispatch to the result on the host (`block_until_ready`), scores the
     decoded responses and tallies tokens, forwards and correct answers (accounting.py).
Rows added to fill the last batch are decoded but never counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dllm_jax.decoding.base import DecodeOutput
from dllm_jax.study import accounting

DecodeFn = Callable[..., DecodeOutput]  # (params, tokens[B,P], valid[B,P], rng) -> output


def _batches(n: int, batch_size: int):
  for start in range(0, n, batch_size):
    yield start, min(start + batch_size, n)


def run_cell(decode: DecodeFn, params, *, layout, suite, examples: Sequence,
             batch_size: int, method: str, label: str, setting: dict, prompt_len: int,
             seed: int = 0, on_batch: Callable[[], None] | None = None
             ) -> accounting.MethodResult:
  """Decodes `examples` in batches of `batch_size` and returns the cell's tally.

  Args:
    decode: a jitted decoder bound to its options: (params, tokens, valid, rng) -> DecodeOutput.
    layout: an SFTLayout (its tokenizer decodes responses; its prompt encoding matches training).
    suite: the TaskSuite that scores responses.
    examples: held-out Examples; prompts are left-padded to `prompt_len`.
  """
  tally = accounting.Tally(method, label, setting, batch_size)
  enc = layout.encode_prompts([ex.prompt for ex in examples], length=prompt_len)
  tokens, valid = enc["tokens"], enc["valid"]
  n = len(examples)
  rng = jax.random.key(seed)

  def batch(start, stop):
    idx = np.arange(start, start + batch_size) % n  # pad the last batch with repeats
    return tokens[idx], valid[idx], stop - start

  t0 = time.perf_counter()
  tok0, val0, _ = batch(0, min(batch_size, n))
  jax.block_until_ready(decode(params, tok0, val0, rng))
  tally.result.compile_s = time.perf_counter() - t0

  for i, (start, stop) in enumerate(_batches(n, batch_size)):
    btok, bval, real = batch(start, stop)
    key = jax.random.fold_in(rng, i)
    t0 = time.perf_counter()
    out = decode(params, btok, bval, key)
    out = jax.device_get(out)
    wall = time.perf_counter() - t0
    texts = accounting.response_texts(layout.tokenizer, out.tokens, out.lengths)
    correct = accounting.score(suite, examples[start:stop], texts[:real])
    tally.add(out.lengths, correct, real, wall, int(out.nfe), int(out.steps),
              [ex.task for ex in examples[start:stop]])
    if on_batch is not None:
      on_batch()
  return tally.result
