"""D2F's fitted forward window: same tokens as the full window, far fewer forwarded slots.

The fitted policy runs, each step, the smallest bucketed window (`d2f_state.bucket_sizes`)
that holds the widest live row's uncached blocks; the full policy the widest window the
settings allow. Stepping the decoder from Python records each step's span and width, so the
bucket choice itself is checked, not only its result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding import protocol
from dllm_jax.decoding import base, d2f
from dllm_jax.decoding import d2f_state as ds
from tests.test_decoding_d2f import CFG, PROMPTS, peaked_params

G, K = 32, 4  # eight blocks: room for many bucket sizes


@pytest.fixture(scope="module")
def params():
  return peaked_params()


@pytest.fixture(scope="module")
def batch():
  return base.pad_prompts(PROMPTS, CFG.pad_token_id)


def test_bucket_sizes_hold_every_span_within_one_and_a_half():
  for cap in range(1, 70):
    sizes = ds.bucket_sizes(cap)
    assert sizes[0] == 1 and sizes[-1] == cap and list(sizes) == sorted(set(sizes))
    for need in range(1, cap + 1):
      chosen = next(s for s in sizes if s >= need)
      assert chosen <= max(need * 1.5, need + 1), (cap, need, chosen)


@pytest.mark.parametrize("kw", [
    dict(tau_add=0.1, tau_act=0.95, tau_conf=0.9),
    dict(tau_add=0.0, tau_act=0.5, tau_conf=0.7),
    dict(tau_add=0.5, tau_act=0.5, tau_conf=0.7, max_active_blocks=3),
], ids=["reference-taus", "eager-append", "three-in-flight"])
def test_fitted_equals_full_with_fewer_slots(params, batch, kw):
  run = lambda window: d2f.d2f_generate(params, CFG, *batch, gen_length=G, block_length=K,
                                        window=window, return_state=True, **kw)
  (fit, fit_state), (full, full_state) = run("fitted"), run("full")
  np.testing.assert_array_equal(fit.tokens, full.tokens)
  np.testing.assert_array_equal(fit.lengths, full.lengths)
  assert int(fit.nfe) == int(full.nfe)
  for field in ("forwards", "block_steps", "n_blocks", "cached", "ready"):
    np.testing.assert_array_equal(getattr(fit_state, field), getattr(full_state, field))
  assert int(fit_state.forward_slots) < int(full_state.forward_slots)


def test_each_step_runs_the_smallest_bucket_that_holds_the_span(params, batch):
  kw = dict(gen_length=G, block_length=K, tau_add=0.0, tau_act=0.5, tau_conf=0.7)
  spec, traced = d2f.d2f_options(CFG, **kw)
  assert spec.window == "fitted" and spec.window_blocks == ds.bucket_sizes(spec.num_blocks)
  decoder = d2f.D2FDecoder(CFG, spec)
  state = protocol.jit_init(params, *batch, jax.random.key(0), traced, decoder=decoder)
  p = batch[0].shape[1]
  assert int(state.forward_slots) == p + K  # the first forward: prompt plus block 0
  widths = []
  while not bool(jnp.all(state.done)):
    span = int(jnp.max(jnp.where(state.done, 0, state.n_blocks - state.cached)))
    before = int(state.forward_slots)
    state = protocol.jit_step(params, state, decoder=decoder)
    width = (int(state.forward_slots) - before) // K
    assert width == next(s for s in spec.window_blocks if s >= span), (span, width)
    widths.append(width)
  assert len(set(widths)) >= 3, f"too few distinct windows to test the choice: {widths}"


def test_unknown_window_policy_is_named(params, batch):
  with pytest.raises(ValueError, match="window policy 'wide'.*fitted"):
    d2f.d2f_generate(params, CFG, *batch, gen_length=G, block_length=K, window="wide")
