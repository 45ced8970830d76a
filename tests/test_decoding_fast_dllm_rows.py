"""Per-row Fast-dLLM: in a batch, every row decodes exactly as its prompt alone.

The tiny model's weights are scaled up (`peaked_params`, as in the D2F tests) so confidences
spread over (0, 1): rows fill their blocks after different numbers of forwards, start blocks
at different steps (steps mix refreshing and cached rows) and stop early at different steps
(EOS). "Alone" is the prompt in a batch of four copies of itself, left-padded to the batch's
width: the copies move in lockstep with nothing else in the batch, the batch shape (so the
compiled program) is shared, and a decoder that made rows wait or mixed rows up would fail
the comparison. Padding is invisible and a copy is a lone row: the last test (sampling) and
the decoding contract test (greedy) compare with a batch of one, unpadded.
"""

import functools

import jax
import numpy as np
import pytest

from dllm_jax.decoding import base, fast_dllm
from dllm_jax.models import masks
from tests.test_decoding_d2f import CFG, peaked_params

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [20, 21, 22]]
G, BL = 16, 4


@pytest.fixture(scope="module")
def params():
  return peaked_params()


@functools.partial(jax.jit, static_argnames=("opts",))
def _decode(params, tokens, valid, rng, traced, *, opts):
  """The decode's output and its final state (cache dropped)."""
  state = fast_dllm.init_state(params, CFG, opts, tokens, valid, rng, traced)
  state = jax.lax.while_loop(functools.partial(fast_dllm.running, opts),
                             functools.partial(fast_dllm.step, params, CFG, opts), state)
  return fast_dllm.finish(CFG, opts, state), state.replace(cache=None)


def decode(params, prompts, width, seed=0, **options):
  opts = fast_dllm.FastDLLMOptions(gen_length=G, block_length=BL, **options)
  tokens, valid = base.pad_prompts(prompts, CFG.pad_token_id, width)
  static, traced = opts.split()
  return jax.device_get(_decode(params, tokens, valid, jax.random.key(seed), traced,
                                opts=static))


RUNS = [("none", "threshold"), ("none", "factor"), ("prefix", "threshold"),
        ("prefix", "factor"), ("dual", "threshold"), ("dual", "factor")]
SLOW = {("none", "factor"), ("prefix", "threshold")}  # the rest cover each mode and rule


@pytest.mark.parametrize("cache,rule", [
    pytest.param(*r, marks=pytest.mark.slow) if r in SLOW else r for r in RUNS])
def test_each_row_decodes_and_counts_forwards_as_alone(params, cache, rule):
  kw = dict(cache=cache, rule=rule, threshold=0.7, factor=1.0)
  width = max(map(len, PROMPTS))
  out, state = decode(params, PROMPTS, width, **kw)
  for i, prompt in enumerate(PROMPTS):
    one, alone = decode(params, [prompt] * len(PROMPTS), width, **kw)
    msg = f"row {i}"
    np.testing.assert_array_equal(out.tokens[i], one.tokens[0], err_msg=msg)
    assert out.lengths[i] == one.lengths[0] and out.committed[i] == one.committed[0], msg
    assert state.forwards[i] == alone.forwards[0] == one.nfe, msg
    np.testing.assert_array_equal(state.block_forwards[i], alone.block_forwards[0],
                                  err_msg=msg)
  per_block = state.block_forwards
  assert int(out.nfe) == int(out.steps) == state.forwards.max()
  assert state.forwards.sum() == per_block.sum()
  assert len({tuple(r) for r in per_block}) > 1  # rows filled blocks at different steps
  # A lockstep batch (a block advances when every row filled it) runs, per block, its
  # slowest row's forwards; per-row blocks run the slowest row's total.
  lockstep = per_block.max(0).sum()
  assert int(out.nfe) < lockstep, (int(out.nfe), lockstep)


def test_a_row_samples_the_same_whatever_its_neighbours(params):
  """At temperature > 0 a row's draws follow its own forwards and its index: rows 0 and 2 of
  two batches that differ elsewhere decode the same, and row 0 equals its prompt alone (the
  longest prompt: a batch of one, unpadded; batch_invariant ranks on the grid, so the batch
  shape's float noise cannot flip a near-tie)."""
  kw = dict(cache="dual", rule="threshold", threshold=0.7, temperature=0.8,
            batch_invariant=True)
  width = max(map(len, PROMPTS))
  a, sa = decode(params, PROMPTS, width, seed=3, **kw)
  other = [PROMPTS[0], PROMPTS[3], PROMPTS[2], PROMPTS[1]]
  b, sb = decode(params, other, width, seed=3, **kw)
  one, _ = decode(params, PROMPTS[:1], width, seed=3, **kw)
  greedy, _ = decode(params, PROMPTS, width, seed=3, **{**kw, "temperature": 0.0})
  assert not np.array_equal(a.tokens, greedy.tokens)  # the draws mattered
  for i in (0, 2):
    np.testing.assert_array_equal(a.tokens[i], b.tokens[i], err_msg=f"row {i}")
    assert sa.forwards[i] == sb.forwards[i]
  np.testing.assert_array_equal(a.tokens[0], one.tokens[0])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_lone_refreshing_row_forwards_its_canvas_alone(params, cache):
  """A step where one row starts a block: that row forwards the whole canvas into a fresh
  cache, the others read their caches (chunk forward), and every row's logits and cache are
  what its own one-row step gives; the step counts the refresh's T slots on top of the
  chunk. Rows start blocks apart in a ragged batch, so this is the common refresh step."""
  opts = fast_dllm.FastDLLMOptions(gen_length=G, block_length=BL, cache=cache, threshold=0.7)
  static, traced = opts.split()
  tokens, valid = base.pad_prompts(PROMPTS, CFG.pad_token_id, max(map(len, PROMPTS)))
  state = fast_dllm.init_state(params, CFG, static, tokens, valid, jax.random.key(0), traced)
  state = jax.jit(functools.partial(fast_dllm.step, params, CFG, static))(state)  # caches full
  state = state.replace(fresh=np.array([False, False, True, False]))

  @jax.jit
  def logits_of(s):
    live = fast_dllm.live_rows(static, s)
    return fast_dllm._cached_logits(params, CFG, static, s, live,  # pylint: disable=protected-access
                                    fast_dllm._block_starts(static, s))  # pylint: disable=protected-access
  logits, cache_out, width = jax.device_get(logits_of(state))
  row = lambda x, i, axis=0: jax.tree_util.tree_map(
      lambda a: a if np.ndim(a) == 0 else np.take(a, [i], axis=axis), x)
  for i in range(len(PROMPTS)):
    alone = state.replace(**{f: row(getattr(state, f), i) for f in (
        "canvas", "valid", "positions", "block", "fresh", "forwards", "block_forwards",
        "committed", "done", "finite")}, cache=jax.tree_util.tree_map(
            lambda a: np.take(a, [i], axis=1 if a.ndim == 5 else 0), state.cache))
    one_logits, one_cache, one_width = jax.device_get(logits_of(alone))
    np.testing.assert_allclose(logits[i], one_logits[0], rtol=1e-5, atol=1e-5,
                               err_msg=f"row {i}")
    np.testing.assert_array_equal(cache_out.block_ids[i], one_cache.block_ids[0])
    assert cache_out.length[i] == one_cache.length[0]
    written = one_cache.block_ids[0] != masks.NO_KEY
    assert written.any()
    for kv in ("k", "v"):
      np.testing.assert_allclose(getattr(cache_out, kv)[:, i][:, written],
                                 getattr(one_cache, kv)[:, 0][:, written], rtol=1e-5, atol=1e-5)
    if i == 2:
      assert int(one_width) == tokens.shape[1] + G  # alone, its refresh is the canvas
  _, _, chunk = jax.device_get(logits_of(state.replace(fresh=np.zeros(4, bool))))
  assert int(width) == int(chunk) + tokens.shape[1] + G  # every row's chunk, one canvas
