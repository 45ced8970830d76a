"""LLaDA / Dream sampling vs a plain NumPy re-statement of the reference loop (temperature 0).

The reference below is LLaDA's `generate` written out: Python loops over blocks and steps,
one full-canvas forward per step (the jitted model is the forward), NumPy confidences and a
per-row stable top-k with the reference's num_transfer_tokens schedule.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding import protocol
from dllm_jax.decoding import base, llada
from dllm_jax.models import abstract_params, forward, get_preset

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
G = 16


def random_params(cfg, seed=0, std=0.3, head_std=0.7):
  """Random weights, peaked enough that confidences rarely tie (built without compiling)."""
  rs = np.random.default_rng(seed)

  def leaf(path, shape):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return jnp.ones(shape.shape, jnp.float32)
    sd = head_std if ("lm_head" in name or "embed" in name) else std
    return jnp.asarray(sd * rs.standard_normal(shape.shape), jnp.float32)
  return jax.tree_util.tree_map_with_path(leaf, nn.unbox(abstract_params(cfg)))


@pytest.fixture(scope="module")
def model():
  cfg = get_preset("tiny").replace(eos_token_id=None)  # no stop: whole canvases compared
  return cfg, random_params(cfg)


_FORWARD = jax.jit(lambda params, cfg, canvas, valid: forward(
    params, cfg, canvas, attention="bidirectional", valid=valid), static_argnums=1)


@pytest.fixture(scope="module")
def batch():
  return base.pad_prompts(PROMPTS, 0)


def np_confidence(logits, x0, kind):
  z = logits.astype(np.float64)
  z = z - z.max(-1, keepdims=True)
  p = np.exp(z)
  p /= p.sum(-1, keepdims=True)
  if kind == "probability":
    return np.take_along_axis(p, x0[..., None], -1)[..., 0]
  if kind == "margin":
    top = np.sort(p, -1)
    return top[..., -1] - top[..., -2]
  logp = np.log(np.where(p > 0, p, 1.0))
  return (p * logp).sum(-1)  # negative entropy


def reference(cfg, params, tokens, valid, *, steps, block_length, kind="probability",
              cfg_scale=0.0, logits_eos_inf=False, demote_ids=(), history=None):
  """LLaDA's generate(), restated. Returns the [B, G] response (and appends the response
  after every step to `history` when given)."""
  tokens, valid = np.asarray(tokens), np.asarray(valid)
  b, p = tokens.shape
  mask = cfg.mask_token_id
  cvalid = np.concatenate([valid, np.ones((b, G), bool)], 1)
  both_valid = jnp.asarray(np.concatenate([cvalid, cvalid]))
  model_cfg = cfg.replace(eos_token_id=None)  # stop ids do not change the forward
  fwd = lambda c: _FORWARD(params, model_cfg, c, both_valid)
  x = np.concatenate([tokens, np.full((b, G), mask)], 1)
  prompt_index = np.zeros_like(x, bool)
  prompt_index[:, :p] = valid
  num_blocks = G // block_length
  spb = steps // num_blocks
  for blk in range(num_blocks):
    start, end = p + blk * block_length, p + (blk + 1) * block_length
    m = (x[:, start:end] == mask).sum(1)
    num_transfer = np.stack([m // spb + (j < m % spb) for j in range(spb)], 1)  # [B, spb]
    for j in range(spb):
      mask_index = x == mask
      mask_index[:, :p] = False
      un = np.where(prompt_index, mask, x)
      both = np.asarray(fwd(jnp.asarray(np.concatenate([x, un]), jnp.int32)))
      logits, un_logits = both[:b], both[b:]
      if cfg_scale:
        logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
      logits = logits.copy()
      logits[..., mask] = -np.inf
      if logits_eos_inf:
        logits[..., cfg.eos_token_id] = -np.inf
      x0 = logits.argmax(-1)
      conf = np_confidence(logits, x0, kind)
      conf[:, end:] = -np.inf
      x0 = np.where(mask_index, x0, x)
      conf = np.where(mask_index, conf, -np.inf)
      # Candidates first, demoted candidates after the others, each by confidence.
      tier = np.where(np.isfinite(conf), np.isin(x0, demote_ids), 2)
      for r in range(b):
        order = np.lexsort((-conf[r], tier[r]))
        pick = order[:num_transfer[r, j]]
        x[r, pick] = x0[r, pick]
      if history is not None:
        history.append(x[:, p:].copy())
  return x[:, p:]


@pytest.mark.parametrize("steps,block_length", [(16, 16), (6, 8), (8, 4)])
def test_low_confidence_matches_reference(model, batch, steps, block_length):
  cfg, params = model
  out = llada.llada_generate(params, cfg, *batch, gen_length=G, block_length=block_length,
                             steps=steps)
  ref = reference(cfg, params, *batch, steps=steps, block_length=block_length)
  np.testing.assert_array_equal(np.asarray(out.tokens), ref)
  assert int(out.nfe) == steps and int(out.steps) == steps
  np.testing.assert_array_equal(out.committed, [G] * len(PROMPTS))
  np.testing.assert_array_equal(out.lengths, [G] * len(PROMPTS))
  assert bool(jnp.all(out.done))


@pytest.mark.parametrize("remasking,kind", [("maskgit_plus", "probability"),
                                            ("topk_margin", "margin"), ("entropy", "entropy")])
def test_dream_orderings_match_reference(model, batch, remasking, kind):
  cfg, params = model
  out = llada.llada_generate(params, cfg, *batch, gen_length=G, block_length=8, steps=8,
                             remasking=remasking)
  ref = reference(cfg, params, *batch, steps=8, block_length=8, kind=kind)
  np.testing.assert_array_equal(np.asarray(out.tokens), ref)


def test_dream_generate_defaults_to_entropy(model, batch):
  cfg, params = model
  out = llada.dream_generate(params, cfg, *batch, gen_length=G, block_length=8, steps=8)
  np.testing.assert_array_equal(
      np.asarray(out.tokens), reference(cfg, params, *batch, steps=8, block_length=8,
                                        kind="entropy"))


def test_cfg_matches_reference(model, batch):
  cfg, params = model
  out = llada.llada_generate(params, cfg, *batch, gen_length=G, block_length=8, steps=8,
                             cfg_scale=1.5)
  ref = reference(cfg, params, *batch, steps=8, block_length=8, cfg_scale=1.5)
  np.testing.assert_array_equal(np.asarray(out.tokens), ref)
  assert int(out.nfe) == 8  # one batched call of 2B rows per step


def _frequent_token(tokens):
  values, counts = np.unique(np.asarray(tokens), return_counts=True)
  return int(values[np.argmax(counts)])


def test_eos_options_match_reference(model, batch):
  cfg, params = model
  plain = llada.llada_generate(params, cfg, *batch, gen_length=G, block_length=4, steps=8)
  eos_cfg = cfg.replace(eos_token_id=_frequent_token(plain.tokens))  # a token it likes
  pad = base.output_pad_id(eos_cfg)
  for flags in ({"logits_eos_inf": True}, {"confidence_eos_eot_inf": True}):
    out = llada.llada_generate(params, eos_cfg, *batch, gen_length=G, block_length=8, steps=8,
                               early_stop=False, **flags)
    ref = reference(eos_cfg, params, *batch, steps=8, block_length=8,
                    logits_eos_inf=flags.get("logits_eos_inf", False),
                    demote_ids=(eos_cfg.eos_token_id,) if "confidence_eos_eot_inf" in flags
                    else ())
    expect, lengths, _ = base.finalize(jnp.asarray(ref), jnp.ones(ref.shape, bool),
                                       base.stop_ids(eos_cfg), pad)
    np.testing.assert_array_equal(out.tokens, expect)
    np.testing.assert_array_equal(out.lengths, lengths)
  assert not np.any(np.asarray(out.tokens) == eos_cfg.mask_token_id)


def test_random_orders_follow_schedule_and_argmax(model, batch):
  """`random` / `alg_temp` orders are random: replay each step against the reference rules."""
  cfg, params = model
  for options in ({"remasking": "random"}, {"remasking": "entropy", "alg_temp": 0.5}):
    opts = llada.LLaDAOptions(gen_length=G, block_length=8, steps=6, **options)
    schedule = llada.transfer_schedule(8, 3, 2)
    state = llada.init_state(params, cfg, opts, *batch, jax.random.key(1))
    p = batch[0].shape[1]
    for i in range(opts.steps):
      before = np.asarray(state.canvas)
      logits = np.array(_FORWARD(params, cfg, state.canvas, state.valid))
      logits[..., cfg.mask_token_id] = -np.inf
      state = protocol.jit_step(params, state, decoder=llada.LLaDADecoder.from_options(cfg, opts).decoder)
      after = np.asarray(state.canvas)
      changed = after != before
      start = p + (i // 3) * 8
      assert not changed[:, :start].any() and not changed[:, start + 8:].any()
      np.testing.assert_array_equal(changed.sum(1), schedule[i])
      np.testing.assert_array_equal(after[changed], logits.argmax(-1)[changed])
    assert not bool(llada.running(opts, state))
  assert not np.any(after[:, p:] == cfg.mask_token_id)


def test_early_stop_keeps_tokens_and_counts_steps(model, batch):
  cfg, params = model
  history = []
  ref = reference(cfg, params, *batch, steps=16, block_length=16, history=history)
  # A stop id every row produces: early stop then ends the loop before the last step.
  first = lambda t, row: list(row).index(t) if t in row else G
  eos = min(set.intersection(*map(set, ref.tolist())), key=lambda t: max(
      first(t, row) for row in ref.tolist()))
  eos_cfg = cfg.replace(eos_token_id=int(eos))
  mask = cfg.mask_token_id

  def done_after(resp):  # NumPy restatement of "the answer up to the first EOS is final"
    decided = resp != mask
    out = []
    for row, dec in zip(resp, decided):
      stops = np.flatnonzero((row == eos) & dec)
      out.append(bool(dec.all()) or (stops.size > 0 and bool(dec[:stops[0]].all())))
    return np.array(out)
  expected_nfe = next(i + 1 for i, r in enumerate(history) if done_after(r).all())
  assert expected_nfe < 16  # the test needs a batch that stops early

  full = llada.llada_generate(params, eos_cfg, *batch, gen_length=G, block_length=16, steps=16,
                              early_stop=False)
  fast = llada.llada_generate(params, eos_cfg, *batch, gen_length=G, block_length=16, steps=16)
  np.testing.assert_array_equal(fast.tokens, full.tokens)
  np.testing.assert_array_equal(fast.lengths, full.lengths)
  np.testing.assert_array_equal(fast.lengths, [first(eos, row) for row in ref.tolist()])
  assert int(full.nfe) == 16 and int(fast.nfe) == expected_nfe == int(fast.steps)
  # A row commits until the step that makes it done, then freezes.
  done_step = [next(i for i, r in enumerate(history) if done_after(r)[row])
               for row in range(len(PROMPTS))]
  np.testing.assert_array_equal(
      fast.committed, [(history[i][row] != mask).sum() for row, i in enumerate(done_step)])
  assert bool(jnp.all(fast.done))


def test_temperature_is_seeded(model, batch):
  cfg, params = model
  run = lambda seed: llada.llada_generate(params, cfg, *batch, gen_length=G, block_length=8,
                                          steps=8, temperature=1.0,
                                          rng=jax.random.key(seed)).tokens
  a, b, c = run(0), run(0), run(1)
  np.testing.assert_array_equal(a, b)
  assert np.any(np.asarray(a) != np.asarray(c))
  assert not np.any(np.asarray(a) == cfg.mask_token_id)


def test_transfer_schedule():
  np.testing.assert_array_equal(llada.transfer_schedule(8, 3, 2), [3, 3, 2, 3, 3, 2])
  np.testing.assert_array_equal(llada.transfer_schedule(16, 5, 1), [4, 3, 3, 3, 3])


@pytest.mark.parametrize("tokens,options,match", [
    ([[5, 3, 6]], {"gen_length": 16}, "mask id"),
    ([[5, 6]], {"gen_length": 16, "block_length": 5}, "multiple of block_length"),
    ([[5, 6]], {"gen_length": 16, "block_length": 8, "steps": 1}, "steps=1"),
    ([[5, 6]], {"gen_length": 16, "steps": 17}, "steps=17"),
    ([[5, 6]], {"gen_length": 16, "block_length": 4, "steps": 6}, "steps=6"),
    ([[5] * 120], {"gen_length": 16}, "max_seq_len"),
    ([[5, 6]], {"gen_length": 16, "remasking": "lowconf"}, "remasking"),
    ([[5, 6]], {"block_len": 4}, "block_length"),
])
def test_bad_input_raises_before_compiling(tokens, options, match):
  cfg = get_preset("tiny")
  toks, valid = base.pad_prompts(tokens, 0)
  with pytest.raises(ValueError, match=match):
    llada.llada_generate(None, cfg, toks, valid, **options)  # params=None: nothing traced
