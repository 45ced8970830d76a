"""Unmasking schedules (`decoding/unmasking.py`) against NumPy re-statements of their rules.

even / cosine: the static counts per step, then the tokens each decoder step commits (LLaDA
step by step, block diffusion through `stream`). entropy_bound: each step's commits are
recomputed from that step's logits (float64 entropies, the decoder's commit order) on the
tiny random models of test_decoding_llada / test_decoding_d2f.
"""

import math

import jax
import numpy as np
import pytest

from dllm_jax.decoding import protocol
from dllm_jax.decoding import api, base, d2f, llada, streaming, unmasking
from test_decoding_d2f import CFG as BD_CFG, full_forward, peaked_params
from test_decoding_llada import _FORWARD, G, PROMPTS, batch, model, np_confidence  # noqa: F401

K = 4  # block diffusion's block


def np_counts(name, k, s):
  """The schedules as documented: even = LLaDA's split; cosine = diffs of the masked counts
  M_j = min(floor(k cos(pi/2 (j+1)/s)), M_{j-1}-1), M_{-1} = k."""
  if name == "even":
    return [k // s + (j < k % s) for j in range(s)]
  masked = [k]
  for j in range(s):
    m = math.floor(k * math.cos(math.pi / 2 * (j + 1) / s) + 1e-9)
    masked.append(min(m, masked[-1] - 1))
  return [a - b for a, b in zip(masked[:-1], masked[1:])]


def np_entropy(logits):
  z = logits.astype(np.float64)
  z = z - z.max(-1, keepdims=True)
  p = np.exp(z)
  p /= p.sum(-1, keepdims=True)
  return -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1)


def np_bounded_prefix(order, ent, bound, margins):
  """The entropy-bound rule: the longest prefix of `order` with sum - max <= bound (>= 1).
  Appends |sum - max - bound| of every prefix tested to `margins`."""
  count = 0
  for j in range(1, len(order) + 1):
    e = ent[order[:j]]
    spread = e.sum() - e.max()
    margins.append(abs(spread - bound))
    if spread > bound:
      break
    count = j
  return order[:max(count, 1)]


def test_fixed_counts_match_the_documented_rules():
  for k in range(1, 41):
    for s in range(1, k + 1):
      even, cosine = unmasking.counts("even", k, s), unmasking.counts("cosine", k, s)
      np.testing.assert_array_equal(even, np_counts("even", k, s))
      np.testing.assert_array_equal(cosine, np_counts("cosine", k, s))
      np.testing.assert_array_equal(even, llada.transfer_schedule(k, s, 1))
      for c in (even, cosine):
        assert c.sum() == k and c.min() >= 1 and c.dtype == np.int32
  np.testing.assert_array_equal(unmasking.counts("cosine", 16, 4), [2, 3, 5, 6])
  np.testing.assert_array_equal(unmasking.counts("cosine", 8, 3), [2, 2, 4])
  np.testing.assert_array_equal(unmasking.counts("cosine", 6, 6), [1] * 6)


def test_llada_cosine_commits_the_schedule(model, batch):
  cfg, params = model
  opts = llada.LLaDAOptions(gen_length=G, block_length=8, steps=6, unmasking="cosine")
  expect = np.tile(np_counts("cosine", 8, 3), 2)                         # [2, 2, 4] per block
  state = _jit_init(params, cfg, opts, batch, jax.random.key(0))
  p = batch[0].shape[1]
  for i in range(opts.steps):
    before = np.asarray(state.canvas)
    state = protocol.jit_step(params, state, decoder=llada.LLaDADecoder.from_options(cfg, opts).decoder)
    changed = np.asarray(state.canvas) != before
    block = p + (i // 3) * 8
    assert not changed[:, :block].any() and not changed[:, block + 8:].any()
    np.testing.assert_array_equal(changed.sum(1), expect[i], err_msg=f"step {i}")
  assert not bool(llada.running(opts, state))
  np.testing.assert_array_equal(state.committed, G)


def test_cosine_equals_even_at_one_token_per_step(model):
  cfg, params = model
  run = lambda method, p, c, **kw: api.generate(p, c, PROMPTS, method=method, gen_length=G,
                                                **kw)
  for method, p, c, kw in (("llada", params, cfg, dict(block_length=8, steps=G)),
                           ("block_diffusion", peaked_params(), BD_CFG,
                            dict(block_length=K, steps_per_block=K, use_cache=False))):
    even = run(method, p, c, unmasking="even", **kw)
    cosine = run(method, p, c, unmasking="cosine", **kw)
    np.testing.assert_array_equal(cosine.tokens, even.tokens, err_msg=method)
    np.testing.assert_array_equal(cosine.lengths, even.lengths, err_msg=method)
    assert int(cosine.nfe) == int(even.nfe), method


def test_block_diffusion_cosine_commits_the_schedule():
  """The count rule is shared by the cached and uncached loops; uncached compiles faster."""
  params = peaked_params()
  cfg = BD_CFG.replace(eos_token_id=None, eot_token_id=None)  # no stop: every block decodes
  counts = np_counts("cosine", K, 3)                                     # [1, 1, 2]
  events = list(streaming.stream(params, cfg, PROMPTS, method="block_diffusion",
                                 gen_length=G, block_length=K, steps_per_block=3,
                                 unmasking="cosine", use_cache=False))
  assert len(events) == (G // K) * 3 == int(events[-1].output.nfe)
  for i, event in enumerate(events):
    new = event.new
    block = (i // 3) * K
    assert not new[:, :block].any() and not new[:, block + K:].any()
    np.testing.assert_array_equal(new.sum(1), counts[i % 3], err_msg=f"step {i}")


@pytest.mark.parametrize("remasking,kind,bounds", [
    ("low_confidence", "probability", (0.6, 2.5)),
    ("entropy", "entropy", (1.2,)),                 # Dream's order: lowest entropy first
])
def test_llada_entropy_bound_matches_numpy(model, batch, remasking, kind, bounds):
  cfg, params = model
  p = batch[0].shape[1]
  for bound in bounds:
    opts = llada.LLaDAOptions(gen_length=G, block_length=8, remasking=remasking,
                              unmasking="entropy_bound", entropy_bound=bound)
    state = _jit_init(params, cfg, opts, batch, jax.random.key(0))
    margins, sizes = [], []
    steps = 0
    while bool(llada.running(opts, state)):
      canvas = np.asarray(state.canvas)
      logits = np.array(_FORWARD(params, cfg, state.canvas, state.valid))[:, p:]
      logits[..., cfg.mask_token_id] = -np.inf
      x0 = logits.argmax(-1)
      conf = np_confidence(logits, x0, kind)
      ent = np_entropy(logits)
      expect = canvas.copy()
      for r in range(len(PROMPTS)):
        masked = canvas[r, p:] == cfg.mask_token_id
        if not masked.any():
          continue
        start = np.flatnonzero(masked)[0] // 8 * 8
        slots = start + np.flatnonzero(masked[start:start + 8])
        order = slots[np.argsort(-conf[r, slots], kind="stable")]
        chosen = np_bounded_prefix(order, ent[r], bound, margins)
        sizes.append((len(chosen), len(slots)))
        expect[r, p + chosen] = x0[r, chosen]
      state = protocol.jit_step(params, state, decoder=llada.LLaDADecoder.from_options(cfg, opts).decoder)
      steps += 1
      np.testing.assert_array_equal(np.asarray(state.canvas), expect,
                                    err_msg=f"bound {bound}, step {steps}")
    assert min(margins) > 1e-4, "a prefix sits on the bound: float noise could decide it"
    assert not np.any(np.asarray(state.canvas)[:, p:] == cfg.mask_token_id)
    # The bound binds (some step commits fewer than the block has left) and lets several
    # through (some step commits more than one): both sides of the rule are exercised.
    assert any(c < n for c, n in sizes) and any(c > 1 for c, n in sizes), sizes
    out = llada.llada_generate(params, cfg, *batch, gen_length=G, block_length=8,
                               remasking=remasking, unmasking="entropy_bound",
                               entropy_bound=bound)
    np.testing.assert_array_equal(out.tokens, np.asarray(state.canvas)[:, p:])
    assert int(out.nfe) == int(out.steps) == steps < G


def test_block_diffusion_entropy_bound_matches_numpy():
  params = peaked_params()
  cfg = BD_CFG.replace(eos_token_id=None, eot_token_id=None)
  prompts = [[5, 6, 7, 8, 9], [12, 13, 14, 15, 16]]  # one length: one compiled full forward
  bound, p, mask = 0.8, 5, cfg.mask_token_id
  events = list(streaming.stream(params, cfg, prompts, method="block_diffusion", gen_length=G,
                                 block_length=K, unmasking="entropy_bound",
                                 entropy_bound=bound))
  response = np.full((2, G), mask)
  margins, sizes = [], []
  for i, event in enumerate(events):
    expect = np.zeros((2, G), bool)
    for r in range(2):
      masked = response[r] == mask
      if not masked.any():
        continue
      start = np.flatnonzero(masked)[0] // K * K
      canvas = np.concatenate([prompts[r], response[r]])[None]
      valid = (np.arange(p + G) < p + start + K)[None]
      logits = np.array(full_forward(params, canvas, valid, cfg=cfg, prompt_len=p,
                                     block_size=K))[0, p:]
      logits[:, mask] = -np.inf
      slots = start + np.flatnonzero(masked[start:start + K])
      conf = np_confidence(logits, logits.argmax(-1), "probability")
      order = slots[np.argsort(-conf[slots], kind="stable")]
      chosen = np_bounded_prefix(order, np_entropy(logits), bound, margins)
      sizes.append((len(chosen), len(slots)))
      expect[r, chosen] = True
      response[r, chosen] = logits.argmax(-1)[chosen]
    np.testing.assert_array_equal(event.new, expect, err_msg=f"step {i}")
    np.testing.assert_array_equal(event.response, response, err_msg=f"step {i}")
  assert min(margins) > 1e-4, "a prefix sits on the bound: float noise could decide it"
  assert not (response == mask).any()
  assert any(c < n for c, n in sizes) and any(c > 1 for c, n in sizes), sizes
  assert int(events[-1].output.nfe) == len(events) < G


@pytest.mark.parametrize("method,options,match", [
    ("llada", {"unmasking": "cosin"}, "unmasking schedule 'cosin'"),
    ("dream", {"unmasking": None}, "unmasking schedule None"),
    ("block_diffusion", {"unmasking": "linear"}, "unmasking schedule 'linear'"),
    ("llada", {"unmasking": "entropy_bound", "entropy_bound": -0.5}, "entropy_bound must be"),
    ("llada", {"unmasking": "entropy_bound", "entropy_bound": float("nan")}, "entropy_bound="),
    ("block_diffusion", {"unmasking": "entropy_bound", "entropy_bound": -1.0},
     "entropy_bound must be"),
    ("block_diffusion", {"entropy_bound": float("nan")}, "entropy_bound="),
    ("llada", {"unmasking": "entropy_bound", "steps": 8}, "steps=8.*leave steps unset"),
    ("block_diffusion", {"unmasking": "entropy_bound", "steps_per_block": 2},
     "steps_per_block=2.*leave steps_per_block unset"),
])
def test_bad_values_raise_before_compiling(method, options, match):
  toks, valid = base.pad_prompts([[5, 6]], 0)
  for name in ("unmasking", "entropy_bound"):
    assert name in api.option_names(method)
  with pytest.raises(ValueError, match=match):  # params=None: nothing is traced
    api.generate(None, BD_CFG, (toks, valid), method=method, gen_length=G, block_length=K,
                 **options)
  with pytest.raises(ValueError, match="commits by threshold"):
    d2f.d2f_options(BD_CFG, gen_length=G, block_length=K, unmasking="cosine")


def _jit_init(params, cfg, opts, batch, rng):
  plan = llada.LLaDADecoder.from_options(cfg, opts)
  return protocol.jit_init(params, *batch, rng, plan.traced, decoder=plan.decoder)
