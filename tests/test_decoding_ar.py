"""Cached AR decoding vs repeated full causal forwards, per-row runs and a Python-loop driver."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding import protocol
from dllm_jax.decoding import ar, base
from dllm_jax.models import forward, get_preset
from test_decoding_llada import random_params

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
G = 12
SAMPLED = dict(gen_length=G, temperature=1.0, top_k=10, top_p=0.9)


@pytest.fixture(scope="module")
def model():
  cfg = get_preset("tiny").replace(eos_token_id=None)  # no stop unless a test sets one
  return cfg, random_params(cfg, seed=0)


@pytest.fixture(scope="module")
def batch():
  return base.pad_prompts(PROMPTS, 0)


def greedy_reference(cfg, params, tokens, valid):
  """Greedy decoding by full causal forwards over the growing canvas (no cache)."""
  tokens, valid = np.asarray(tokens), np.asarray(valid)
  b, p = tokens.shape
  canvas = np.concatenate([tokens, np.zeros((b, G), np.int32)], 1)
  cvalid = jnp.asarray(np.concatenate([valid, np.ones((b, G), bool)], 1))
  fwd = jax.jit(lambda c: forward(params, cfg, c, attention="causal", valid=cvalid))
  lag = 0 if cfg.shift_logits else 1  # shifted (Dream) logits at slot j predict slot j
  for i in range(G):  # causal: slots after p + i cannot change the logits read here
    logits = np.array(fwd(jnp.asarray(canvas)))[:, p + i - lag]
    logits[:, cfg.mask_token_id] = -np.inf
    canvas[:, p + i] = logits.argmax(-1)
  return canvas[:, p:]


def test_cached_greedy_equals_full_forwards(model, batch):
  cfg, params = model
  out = ar.ar_generate(params, cfg, *batch, gen_length=G)
  np.testing.assert_array_equal(out.tokens, greedy_reference(cfg, params, *batch))
  assert int(out.nfe) == G == int(out.steps)  # prefill + G - 1 decode steps
  np.testing.assert_array_equal(out.committed, [G] * 3)
  np.testing.assert_array_equal(out.lengths, [G] * 3)
  assert bool(jnp.all(out.done))


def test_shifted_logits_model_decodes_its_next_token_predictions(model, batch):
  cfg, params = model
  cfg = cfg.replace(shift_logits=True)
  out = ar.ar_generate(params, cfg, *batch, gen_length=G)
  np.testing.assert_array_equal(out.tokens, greedy_reference(cfg, params, *batch))


def test_batched_equals_per_row(model, batch):
  cfg, params = model
  batched = ar.ar_generate(params, cfg, *batch, gen_length=G)
  for i in (1, 2):  # the padded rows, each run alone without padding
    single = ar.ar_generate(params, cfg, *base.pad_prompts([PROMPTS[i]], 0), gen_length=G)
    np.testing.assert_array_equal(single.tokens[0], batched.tokens[i])


def test_while_loop_equals_python_loop(model, batch):
  cfg, params = model
  opts = ar.AROptions(**SAMPLED)
  rng = jax.random.key(7)
  plan = ar.ARDecoder.from_options(cfg, opts)
  state = protocol.jit_init(params, *batch, rng, plan.traced, decoder=plan.decoder)
  steps = 0
  while bool(ar.running(opts, state)):
    state = protocol.jit_step(params, state, decoder=plan.decoder)
    steps += 1
  looped = ar.finish(cfg, opts, state)
  fused = ar.ar_generate(params, cfg, *batch, rng=rng, **SAMPLED)
  np.testing.assert_array_equal(looped.tokens, fused.tokens)
  assert int(fused.nfe) == 1 + steps == int(looped.nfe)


def test_sampling_is_seeded(model, batch):
  cfg, params = model
  run = lambda seed: np.asarray(
      ar.ar_generate(params, cfg, *batch, rng=jax.random.key(seed), **SAMPLED).tokens)
  a, b, c = run(0), run(0), run(1)
  np.testing.assert_array_equal(a, b)
  assert np.any(a != c)
  assert np.any(a != np.asarray(ar.ar_generate(params, cfg, *batch, gen_length=G).tokens))
  assert not np.any(a == cfg.mask_token_id)


def test_eos_stops_rows_and_the_loop(model, batch):
  cfg, params = model
  ref = greedy_reference(cfg, params, *batch)
  first = lambda t, row: list(row).index(t) if t in row else G
  # The stop id every row emits soonest: the loop then ends early.
  eos = min(set.intersection(*map(set, ref.tolist())),
            key=lambda t: max(first(t, r) for r in ref.tolist()))
  eos_cfg = cfg.replace(eos_token_id=int(eos))
  out = ar.ar_generate(params, eos_cfg, *batch, gen_length=G)
  cut = [first(eos, r) for r in ref.tolist()]
  assert max(cut) + 1 < G  # the test needs a batch that stops early
  np.testing.assert_array_equal(out.lengths, cut)
  for row, n in enumerate(cut):
    np.testing.assert_array_equal(out.tokens[row, :n], ref[row, :n])
    assert np.all(np.asarray(out.tokens[row, n:]) == base.output_pad_id(eos_cfg))
  assert int(out.nfe) == max(cut) + 1 == int(out.steps)
  np.testing.assert_array_equal(out.committed, np.array(cut) + 1)  # the EOS counts
  assert bool(jnp.all(out.done))


@pytest.mark.parametrize("tokens,options,match", [
    ([[5, 6]], {"gen_length": 0}, "gen_length"),
    ([[5] * 120], {"gen_length": 16}, "max_seq_len"),
    ([[5, 6]], {"gen_length": 8, "temperature": -1.0}, "temperature"),
    ([[5, 6]], {"gen_length": 8, "top_p": 0.0}, "top_p"),
    ([[5, 6]], {"gen_length": 8, "topk": 3}, "top_k"),
    ([[5, 64]], {"gen_length": 8}, "vocabulary"),
])
def test_bad_input_raises_before_compiling(tokens, options, match):
  toks, valid = base.pad_prompts(tokens, 0)
  with pytest.raises(ValueError, match=match):
    ar.ar_generate(None, get_preset("tiny"), toks, valid, **options)


def test_right_padding_is_rejected():
  toks = np.array([[5, 6, 0]])
  with pytest.raises(ValueError, match="LEFT padded"):
    ar.ar_generate(None, get_preset("tiny"), toks, np.array([[True, True, False]]),
                   gen_length=4)
