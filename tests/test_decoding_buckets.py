"""Prompt-length and batch buckets: one compile per bucket, the unbucketed tokens.

The diffusion methods rank with batch_invariant=True (the grid): the default ranks exact
scores, as the references do, and a near-tie may then rank differently in another bucket.
"""

import jax
import numpy as np
import pytest

from dllm_jax.decoding import api, buckets, compaction, protocol
from dllm_jax.models import get_preset
from studylib import dp_bench

CFG = get_preset("tiny")
INV = dict(batch_invariant=True)
RUNS = {
    "ar": dict(gen_length=8, temperature=1.0),
    "llada": dict(gen_length=8, block_length=4, steps=4, **INV),
    "dream": dict(gen_length=8, block_length=4, steps=4, **INV),
    "fast_dllm": dict(gen_length=8, block_length=4, cache="dual", **INV),
    "d2f": dict(gen_length=8, block_length=4, temperature=1.0, **INV),
    "block_diffusion": dict(gen_length=8, block_length=4, **INV),
}


@pytest.fixture(scope="module")
def params():
  return dp_bench.random_params(CFG)


def test_prompt_buckets_pow2_capped_by_the_window():
  room = CFG.max_seq_len
  assert [buckets.prompt_length(p, 8, room) for p in (1, 16, 17, 33)] == [16, 16, 32, 64]
  # bucket + gen_length would overflow the window: the exact length, never an error.
  assert buckets.prompt_length(room - 10, 8, room) == room - 10
  assert buckets.prompt_length(40, room - 50, room) == 40
  assert buckets.prompt_length(5, 8, room, pad_to=None) == 5
  assert buckets.prompt_length(5, 8, room, pad_to=24) == 24
  assert buckets.prompt_length(30, 8, room, pad_to=24) == 30  # longer than every bucket
  assert buckets.prompt_length(9, 8, room, pad_to=[12, 8, 20]) == 12


def test_batch_buckets_and_data_parallel_multiple():
  assert [buckets.batch_size(b) for b in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, 16]
  assert buckets.batch_size(3, multiple=8) == 8
  assert buckets.batch_size(9, None, multiple=4) == 12
  assert buckets.batch_size(5, [6, 10]) == 6


@pytest.mark.parametrize("bad", [0, [4, -1], [], "fibonacci", 2.5, True])
def test_bad_buckets_name_the_option(bad):
  with pytest.raises(ValueError, match="pad_to|buckets|bucket rule"):
    buckets.prompt_length(5, 8, CFG.max_seq_len, pad_to=bad)
  with pytest.raises(ValueError, match="batch_buckets|buckets|bucket rule"):
    buckets.batch_size(5, bad)


def test_pad_batch_left_pads_and_repeats_the_last_row():
  tokens, valid = buckets.pad_batch(np.array([[5, 6], [0, 7]]), np.array([[1, 1], [0, 1]], bool),
                                    4, 3, 0)
  np.testing.assert_array_equal(tokens, [[0, 0, 5, 6], [0, 0, 0, 7], [0, 0, 0, 7]])
  np.testing.assert_array_equal(valid, [[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1]])


@pytest.mark.parametrize("method", [m if m in ("ar", "fast_dllm") else
                                    pytest.param(m, marks=pytest.mark.slow) for m in RUNS])
def test_one_compile_per_bucket_and_unbucketed_tokens(params, method):
  kw = RUNS[method]
  rs = np.random.default_rng(0)
  prompt = lambda n: [int(t) for t in rs.integers(5, CFG.vocab_size, n)]
  rng = jax.random.key(2)
  before = protocol.compiled_programs()[0]
  by_length = [prompt(n) for n in range(1, 17)]                 # every length of bucket 16
  outs = [api.generate(params, CFG, [p], method=method, rng=rng, **kw) for p in by_length]
  assert protocol.compiled_programs()[0] == before + 1, \
      "prompt lengths 1..16 compiled more than once"
  before, later = protocol.compiled_programs()
  for b in range(5, 9):                                          # every batch of bucket 8
    bucketed = api.generate(params, CFG, by_length[:b], method=method, rng=rng, **kw)
  assert protocol.compiled_programs()[0] == before + 1, "batches 5..8 compiled more than once"
  # The staged decode's later stages (and merges): at most once per stage shape.
  stages = len(compaction.stage_sizes(8)) - 1
  assert protocol.compiled_programs()[1] - later <= 2 * stages, "a later stage recompiled"
  exact = api.generate(params, CFG, by_length[:8], method=method, rng=rng, pad_to=None,
                       batch_buckets=None, **kw)
  assert bucketed.tokens.shape == exact.tokens.shape == (8, 8)
  for field in ("tokens", "lengths", "committed", "done"):
    np.testing.assert_array_equal(np.asarray(getattr(bucketed, field)),
                                  np.asarray(getattr(exact, field)), err_msg=field)
  # A row alone (bucketed to batch 1, length 16) equals that row in the exact batch (row 0
  # only when sampling: a row's keys follow its index).
  for i in range(1 if kw.get("temperature") else 3):
    np.testing.assert_array_equal(np.asarray(outs[i].tokens)[0], np.asarray(exact.tokens)[i])
