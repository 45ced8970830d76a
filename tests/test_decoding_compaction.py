"""Finished rows leave the forward (`compaction`): a staged batch decode equals the one-loop
decode, field for field, for every decoder that compacts.

The model is the tiny preset with random weights peaked enough (`dp_bench.random_params`)
that threshold decoders commit at different rates; a stop id is chosen from a first decode
so that rows stop at different steps. Each case checks that a later stage really ran (its
program was compiled), so a decode that never compacts cannot pass.
"""

import functools

import jax
import numpy as np
import pytest

from dllm_jax.decoding import compaction, protocol, sampling
from dllm_jax.decoding import base
from dllm_jax.models import get_preset
from studylib import dp_bench

# Two prompts of different lengths: stages (2, 1), the second as soon as one row is done.
PROMPTS = [[5, 9, 17, 33, 40, 21, 8], [12, 7]]
G, K = 12, 4
CASES = {  # name: (method, options)
    "ar": ("ar", {}),
    "ar_sampled": ("ar", {"temperature": 0.8}),
    "llada": ("llada", {"block_length": K, "steps": G}),
    "fast_dllm": ("fast_dllm", {"block_length": K, "cache": "dual", "threshold": 0.5}),
    "d2f": ("d2f", {"block_length": K, "tau_add": 0.1, "tau_act": 0.5, "tau_conf": 0.5}),
    "d2f_sampled": ("d2f", {"block_length": K, "tau_add": 0.1, "tau_act": 0.5,
                            "tau_conf": 0.5, "temperature": 1.0}),
    "dream": ("dream", {"block_length": K, "steps": G}),
    "block_diffusion": ("block_diffusion", {"block_length": K}),
    "d2f_eos": ("d2f", {"block_length": K}),
    "speculative": ("speculative", {"drafter": "ar", "draft_length": 3}),
    "speculative_sampled": ("speculative", {"drafter": "ar", "draft_length": 3,
                                            "temperature": 0.8}),
    "selfspec": ("selfspec", {"draft_length": 3}),
    "selfspec_sampled": ("selfspec", {"draft_length": 3, "temperature": 0.8}),
}
FAST = ("ar_sampled", "fast_dllm", "d2f_sampled")


@pytest.fixture(scope="module")
def model():
  cfg = get_preset("tiny").replace(eos_token_id=None)
  return cfg, dp_bench.random_params(cfg)


def keeps_stats(decoder) -> bool:
  return type(decoder).stats is not protocol.Decoder.stats


@functools.partial(jax.jit, static_argnames=("decoder",))
def one_loop(params, tokens, valid, rng, traced, row_inputs=None, *, decoder):
  """The reference: init, one `lax.while_loop` over the whole batch, output (and stats)."""
  state = decoder.init(params, tokens, valid, rng, traced, row_inputs)
  state = jax.lax.while_loop(decoder.running, functools.partial(decoder.step, params), state)
  out = decoder.output(state)
  return (out, decoder.stats(state)) if keeps_stats(decoder) else out


def _inputs(cfg, method, options, params):
  if method == "speculative":
    options = dict(options, drafter_params=dp_bench.random_params(cfg, seed=1),
                   drafter_cfg=cfg)
  plan = protocol.plan(method, cfg, dict(options, gen_length=G))
  tokens, valid = base.prompt_inputs(*base.pad_prompts(PROMPTS, cfg.pad_token_id))
  return plan, (plan.params(params), tokens, valid, jax.random.key(7), plan.traced,
                plan.row_inputs)


def _stop_apart(cfg, params, method, options):
  """A config whose stop id is a token row 0 writes early: rows then stop apart."""
  plan, args = _inputs(cfg, method, options, params)
  out = one_loop(*args, decoder=plan.decoder)
  out = out[0] if keeps_stats(plan.decoder) else out
  tokens = np.asarray(out.tokens)
  for token in tokens[0, 1:4]:
    if token not in tokens[1, :G // 2]:
      return cfg.replace(eos_token_id=int(token))
  return cfg.replace(eos_token_id=int(tokens[0, 1]))


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CASES])
def test_a_staged_batch_equals_the_one_loop_decode(model, name):
  cfg, params = model
  method, options = CASES[name]
  if method not in ("fast_dllm", "d2f") or name.endswith("_eos"):
    cfg = _stop_apart(cfg, params, method, options)  # rows stop apart only at a stop id
  plan, args = _inputs(cfg, method, options, params)
  assert plan.decoder.compacts
  stages = compaction.stage._cache_size()
  staged = protocol.run_batch(*args, decoder=plan.decoder,
                              with_stats=keeps_stats(plan.decoder))
  assert compaction.stage._cache_size() > stages, "no row finished before the others"
  reference = one_loop(*args, decoder=plan.decoder)
  for got, want in zip(jax.tree.leaves(staged), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(_host(got), _host(want))


def _host(x):
  return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x)


def test_stage_sizes_halve_to_one_row():
  assert compaction.stage_sizes(1) == (1,)
  assert compaction.stage_sizes(2) == (2, 1)
  assert compaction.stage_sizes(4) == (4, 2, 1)
  assert compaction.stage_sizes(5) == (5, 3, 2, 1)
  assert compaction.stage_sizes(16) == (16, 8, 4, 2, 1)


def test_row_ids_move_with_their_rows(model):
  """Keys follow each row's global index: rows taken out of a batch draw what they drew in
  it, for a [] offset (row 0's index) as for [B] ids."""
  rng = jax.random.key(3)
  whole = sampling.row_keys(rng, 5, 4, 2)
  ids = sampling.row_indices(4, 2)
  np.testing.assert_array_equal(np.asarray(ids), [2, 3, 4, 5])
  moved = sampling.row_keys(rng, 5, 2, ids[np.array([3, 1])])
  np.testing.assert_array_equal(jax.random.key_data(moved),
                                jax.random.key_data(whole[np.array([3, 1])]))
  cfg, params = model
  for method, options in (("ar", {}), ("d2f", {"block_length": K}),
                          ("selfspec", {"draft_length": 3})):
    plan, args = _inputs(cfg, method, options, params)
    state = plan.decoder.with_row_ids(plan.decoder.init(*args))
    # The offset the keys read becomes [B] ids (selfspec also keeps its plan's [] offset
    # in `traced`, which only `init` reads).
    offsets = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state)
               if "row_offset" in jax.tree_util.keystr(path) and np.ndim(leaf) == 1]
    assert len(offsets) == 1, method
    np.testing.assert_array_equal(np.asarray(offsets[0]), [0, 1])


def test_decoders_whose_finished_rows_run_on_do_not_compact(model):
  cfg, _ = model
  assert not protocol.plan("ar", cfg, {"early_stop": False}).decoder.compacts
  assert not protocol.plan("llada", cfg, {"early_stop": False}).decoder.compacts
  assert protocol.plan("d2f", cfg, {}).decoder.compacts
  # adaptive runs its own two-phase loop: it keeps it.
  assert not protocol.plan("adaptive", cfg, {"drafter_params": {}, "drafter_cfg": cfg}
                           ).decoder.compacts
