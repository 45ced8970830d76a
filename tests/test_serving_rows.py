"""Per-row keys: a sampled row's tokens depend only on its own key, never on the batch.

The reference is each prompt decoded alone (a one-row batch) with its key; the batch mixes
prompt lengths, so left padding, window widths and batch indices differ from the one-row
runs. Fast-dLLM runs with each cache mode (none, prefix, dual); AR with top-k and with top-p;
LLaDA with random remasking, Dream with its sampled order and CFG.

Compile budget: a decode compiles once per shape, so the prompts have two lengths (5 and 1:
two one-row programs, plus the batch's); lanes that differ only in traced options (AR's top_k,
top_p) share their programs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding import ar, base, d2f, fast_dllm, llada, sampling
from dllm_jax.models import get_preset
from dllm_jax.serving import request_keys, rows
from test_decoding_d2f import peaked_params

CFG = get_preset("tiny")
PROMPTS = [[5, 6, 7, 8, 9], [10], [12, 13, 14, 15, 16], [40]]
SEEDS = [7, 3, 7, 11]  # a repeated seed on different prompts
INVARIANT = dict(batch_invariant=True)  # rank on the grid, as the engine's lanes do
METHODS = {
    "ar": (ar.ar_generate, dict(gen_length=12, temperature=1.0, top_k=20)),
    "ar_top_p": (ar.ar_generate, dict(gen_length=12, temperature=1.0, top_p=0.9)),
    "d2f": (d2f.d2f_generate, dict(gen_length=12, block_length=4, temperature=1.0,
                                   remasking="random", tau_conf=0.5, **INVARIANT)),
    "block_diffusion": (d2f.block_diffusion_generate,
                        dict(gen_length=12, block_length=4, temperature=0.7, **INVARIANT)),
    "fast_dllm_dual": (fast_dllm.fast_dllm_generate,
                       dict(gen_length=12, block_length=4, temperature=1.0, cache="dual",
                            threshold=0.7, **INVARIANT)),
    "fast_dllm_prefix": (fast_dllm.fast_dllm_generate,
                         dict(gen_length=12, block_length=4, temperature=1.0, cache="prefix",
                              rule="factor", **INVARIANT)),
    "fast_dllm_none": (fast_dllm.fast_dllm_generate,
                       dict(gen_length=12, block_length=6, temperature=1.0, cache="none",
                            threshold=0.7, **INVARIANT)),
    "llada": (llada.llada_generate, dict(gen_length=12, block_length=4, steps=6,
                                         temperature=1.0, remasking="random", **INVARIANT)),
    "dream_cfg": (llada.dream_generate, dict(gen_length=12, block_length=6, temperature=1.0,
                                             alg_temp=0.5, cfg_scale=0.5, **INVARIANT)),
}


@pytest.fixture(scope="module")
def params():
  return peaked_params()


@pytest.mark.parametrize("method", sorted(METHODS))
def test_row_keys_give_each_row_its_alone_result(params, method):
  fn, opts = METHODS[method]
  tokens, valid = base.pad_prompts(PROMPTS, CFG.pad_token_id)
  batch = fn(params, CFG, tokens, valid, request_keys(SEEDS), **opts)
  for i, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS)):
    alone = fn(params, CFG, np.asarray([prompt]), None, request_keys([seed]), **opts)
    np.testing.assert_array_equal(np.asarray(batch.tokens[i]), np.asarray(alone.tokens[0]))
    assert int(batch.lengths[i]) == int(alone.lengths[0])
  # The seed matters: another seed changes some row (sampling is on).
  other = fn(params, CFG, tokens, valid, request_keys([s + 1 for s in SEEDS]), **opts)
  assert not np.array_equal(np.asarray(other.tokens), np.asarray(batch.tokens))


def test_one_key_keeps_its_meaning(params):
  """A single key still means fold_in(fold_in(rng, step), row): rows of one batch differ."""
  tokens, valid = base.pad_prompts([[5, 6, 7]] * 3, CFG.pad_token_id)
  out = ar.ar_generate(params, CFG, tokens, valid, jax.random.key(0), gen_length=8,
                       temperature=1.0)
  rows = {tuple(np.asarray(r).tolist()) for r in out.tokens}
  assert len(rows) > 1


def test_keyed_noise_matches_per_key_draws():
  keys = request_keys([1, 2, 3])
  noise = sampling.keyed_noise(keys, (3, 5), lambda k, s: jax.random.uniform(k, s))
  for i in range(3):
    np.testing.assert_array_equal(noise[i], jax.random.uniform(keys[i], (5,)))
  with pytest.raises(ValueError, match="must lead the noise shape"):
    sampling.keyed_noise(keys, (4, 5), lambda k, s: jax.random.uniform(k, s))


@pytest.mark.parametrize("method,options", [("fast_dllm", dict(cache=c))
                                            for c in fast_dllm.CACHE_MODES] + [("llada", {})])
def test_canvas_pad_equals_init_at_the_largest_bucket(params, method, options):
  """Rows built at a small prompt bucket and padded to P are the rows built at P, leaf by
  leaf (canvas, cache slots in canvas order, cursors, keys); the per-row axis rule holds."""
  decoder = rows.for_method(method)
  static, traced = decoder.split(decoder.make_options(
      CFG, dict(gen_length=12, block_length=4, **options)))
  keys = request_keys(SEEDS)

  def init(length):
    tokens, valid = base.pad_prompts(PROMPTS, base.output_pad_id(CFG), length)
    return decoder.init(params, CFG, static, traced, tokens, valid, keys)

  small, big = decoder.pad(CFG, static, init(7), 16), init(16)
  assert small.canvas.shape == (len(PROMPTS), 16 + 12)
  data = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x
  flat_small, tree = jax.tree_util.tree_flatten_with_path(small)
  flat_big, tree_big = jax.tree_util.tree_flatten_with_path(big)
  assert tree == tree_big
  for (path, a), (_, b) in zip(flat_small, flat_big):
    assert a.dtype == b.dtype, path
    np.testing.assert_array_equal(np.asarray(data(a)), np.asarray(data(b)), err_msg=str(path))
  axes = {jax.tree_util.keystr(p): a for p, a in
          jax.tree_util.tree_flatten_with_path(decoder.row_axes(big))[0]}
  for path, leaf in flat_big:
    name = jax.tree_util.keystr(path)
    if jnp.ndim(leaf) == 0:
      assert name not in axes, name  # shared scalars carry no row axis
    else:
      assert leaf.shape[axes[name]] == len(PROMPTS), name
