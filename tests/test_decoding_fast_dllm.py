"""Fast-dLLM: threshold/factor rules and prefix/dual caches vs NumPy re-statements.

`np_forward` is the transformer written in NumPy (float64) with one extra: the K/V of chosen
slots can come from an earlier pass. That is what an approximate cache means: the prefix (and
for the dual cache the suffix) keep the K/V of the canvas at the block's first step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding import protocol
from dllm_jax.decoding import base, fast_dllm
from dllm_jax.models import get_preset, masks
from test_decoding_llada import PROMPTS, random_params, reference

G, BL = 16, 8


@pytest.fixture(scope="module")
def model():
  cfg = get_preset("tiny").replace(eos_token_id=None)
  return cfg, random_params(cfg)


@pytest.fixture(scope="module")
def batch():
  return base.pad_prompts(PROMPTS, 0)


@pytest.fixture(scope="module")
def llada_answer(model, batch):
  """LLaDA's one-token-per-step answer (the NumPy-driven reference), computed once."""
  cfg, params = model
  return reference(cfg, params, *batch, steps=G, block_length=BL)


def _rms(x, scale, eps):
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def _rope(x, pos, theta):
  dh = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, dh, 2) / dh)
  ang = pos[..., None, None] * np.concatenate([inv, inv])
  x1, x2 = np.split(x, 2, -1)
  return x * np.cos(ang) + np.concatenate([-x2, x1], -1) * np.sin(ang)


def np_forward(params, cfg, tokens, positions, valid, cached_kv=None, use_cached=None):
  """Bidirectional forward; slots with use_cached [B, T] take K/V from cached_kv (per layer).
  Returns ([B, T, V] logits, per-layer (k, v))."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  lay = p["layers"]
  b, t = tokens.shape
  h, kh, dh = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
  x = p["embed"]["embedding"][tokens]
  kvs = []
  for l in range(cfg.n_layers):
    y = _rms(x, lay["attn_norm"]["scale"][l], cfg.norm_eps)
    q = _rope((y @ lay["attn"]["q"]["kernel"][l]).reshape(b, t, h, dh), positions,
              cfg.rope_theta)
    k = _rope((y @ lay["attn"]["k"]["kernel"][l]).reshape(b, t, kh, dh), positions,
              cfg.rope_theta)
    v = (y @ lay["attn"]["v"]["kernel"][l]).reshape(b, t, kh, dh)
    if cached_kv is not None:
      k = np.where(use_cached[..., None, None], cached_kv[l][0], k)
      v = np.where(use_cached[..., None, None], cached_kv[l][1], v)
    kvs.append((k, v))
    kr, vr = np.repeat(k, h // kh, 2), np.repeat(v, h // kh, 2)
    s = np.einsum("bthd,bshd->bhts", q, kr) / np.sqrt(dh)
    s = np.where(valid[:, None, None, :], s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("bhts,bshd->bthd", a, vr).reshape(b, t, h * dh) @ lay["attn"]["o"][
        "kernel"][l]
    y = _rms(x, lay["mlp_norm"]["scale"][l], cfg.norm_eps)
    gate = y @ lay["mlp"]["gate"]["kernel"][l]
    x = x + (gate / (1 + np.exp(-gate)) * (y @ lay["mlp"]["up"]["kernel"][l])) @ lay["mlp"][
        "down"]["kernel"][l]
  x = _rms(x, p["final_norm"]["scale"], cfg.norm_eps)
  return x @ p["lm_head"]["kernel"], kvs


def np_rule(conf, candidates, rule, value):
  """Fast-dLLM's commit rules for one row (conf, candidates: [b])."""
  conf = np.where(candidates, conf, -np.inf)
  order = np.argsort(-conf, kind="stable")
  if rule == "threshold":
    pick = (conf > value) & candidates
  else:
    n = 0
    while n < candidates.sum() and conf[order[n]] >= 1 - value / (n + 2):
      n += 1
    pick = np.isin(np.arange(conf.size), order[:n])
  if candidates.any():
    pick[order[0]] = True
  return pick


@pytest.mark.parametrize("cache,rule,value,shift", [("none", "threshold", 0.5, False),
                                                    ("prefix", "factor", 1.0, False),
                                                    ("dual", "threshold", 0.5, False),
                                                    ("dual", "threshold", 0.5, True)])
def test_steps_match_numpy_reference(model, batch, cache, rule, value, shift):
  """Replays every step: a row's first forward in a block is a plain full forward (no cache);
  its later forwards see the block's K/V fresh and the rest as cached at the row's own first
  step of that block. Rows move between blocks on their own. With shifted logits (Dream)
  slot i reads the output at i - 1, so the chunk starts one earlier."""
  cfg, params = model
  cfg = cfg.replace(shift_logits=shift)
  opts = fast_dllm.FastDLLMOptions(gen_length=G, block_length=BL, rule=rule, threshold=value,
                                   factor=value, cache=cache)
  state = fast_dllm.init_state(params, cfg, opts, *batch, jax.random.key(0))
  p = batch[0].shape[1]
  valid, positions = np.asarray(state.valid), np.asarray(state.positions)
  kv0, nfe, multi, apart = None, 0, False, False
  forwards = np.zeros(len(PROMPTS), int)
  while bool(fast_dllm.running(opts, state)):
    canvas = np.asarray(state.canvas)
    live = np.asarray(fast_dllm.live_rows(opts, state))
    fresh = np.asarray(state.fresh)[:, None]
    start = p + np.asarray(state.block)[:, None] * BL                    # [B, 1]
    slot = np.arange(canvas.shape[1])[None]
    in_block = (slot >= start) & (slot < start + BL)
    logits, kv_full = np_forward(params, cfg, canvas, positions, valid)
    if cache != "none":
      first = start - int(shift)
      reuse = slot < first if cache == "prefix" else (slot < first) | (slot >= start + BL)
      kv0 = kv_full if kv0 is None else kv0
      cached, _ = np_forward(params, cfg, canvas, positions, valid, kv0, reuse)
      logits = np.where(fresh[..., None], logits, cached)
      kv0 = [tuple(np.where(fresh[..., None, None], new, old) for new, old in zip(kn, ko))
             for kn, ko in zip(kv_full, kv0)]
    if shift:
      logits = np.concatenate([logits[:, :1], logits[:, :-1]], 1)
    logits[..., cfg.mask_token_id] = -np.inf
    x0 = logits.argmax(-1)
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    conf = np.take_along_axis(prob / prob.sum(-1, keepdims=True), x0[..., None], -1)[..., 0]
    expect = canvas.copy()
    for r in range(canvas.shape[0]):
      cand = in_block[r] & (canvas[r] == cfg.mask_token_id) & live[r]
      pick = np_rule(conf[r], cand, rule, value)
      expect[r, pick] = x0[r, pick]
    state = protocol.jit_step(params, state, decoder=fast_dllm.FastDLLMDecoder.from_options(cfg, opts).decoder)
    nfe += 1
    forwards += live
    np.testing.assert_array_equal(np.asarray(state.canvas), expect)
    multi |= bool(((expect != canvas).sum(1) > 1).any())
    apart |= len(set(start[live, 0])) > 1
  assert int(state.nfe) == nfe == forwards.max() and nfe < G and multi  # decoded in parallel
  np.testing.assert_array_equal(state.forwards, forwards)
  assert apart  # rows were in different blocks at some step
  assert not np.any(np.asarray(state.canvas)[:, p:] == cfg.mask_token_id)


def test_threshold_above_one_is_llada_one_token_per_step(model, batch, llada_answer):
  cfg, params = model
  ref = llada_answer
  for cache in fast_dllm.CACHE_MODES:
    out = fast_dllm.fast_dllm_generate(params, cfg, *batch, gen_length=G, block_length=BL,
                                       threshold=1.5, cache=cache)
    assert int(out.nfe) == G == int(out.steps)
    np.testing.assert_array_equal(out.committed, [G] * len(PROMPTS))
    if cache == "none":
      np.testing.assert_array_equal(out.tokens, ref)


def test_a_model_that_predicts_mask_cannot_stall(batch):
  cfg = get_preset("tiny").replace(eos_token_id=None)
  params = random_params(cfg)
  head = np.array(params["lm_head"]["kernel"])
  head[:, cfg.mask_token_id] = 50.0 * np.abs(head).max()  # [MASK] wins everywhere by far
  params = {**params, "lm_head": {"kernel": jnp.asarray(head)}}
  out = fast_dllm.fast_dllm_generate(params, cfg, *batch, gen_length=G, block_length=BL,
                                     threshold=0.9, cache="dual")
  assert int(out.nfe) <= G and bool(jnp.all(out.done))
  assert not np.any(np.asarray(out.tokens) == cfg.mask_token_id)
  np.testing.assert_array_equal(out.lengths, [G] * len(PROMPTS))


def test_early_stop_keeps_tokens(model, batch, llada_answer):
  cfg, params = model
  ref = llada_answer
  eos_cfg = cfg.replace(eos_token_id=int(ref[0, 1]))
  kw = dict(gen_length=G, block_length=BL, threshold=0.5, cache="prefix")
  full = fast_dllm.fast_dllm_generate(params, eos_cfg, *batch, early_stop=False, **kw)
  fast = fast_dllm.fast_dllm_generate(params, eos_cfg, *batch, **kw)
  np.testing.assert_array_equal(fast.tokens, full.tokens)
  np.testing.assert_array_equal(fast.lengths, full.lengths)
  assert int(fast.nfe) <= int(full.nfe) and bool(jnp.all(fast.done))


def test_response_positions_continue_each_row(batch):
  """Response slots (and so every chunk) sit at each row's left-pad-aware positions."""
  cfg = get_preset("tiny")
  opts = fast_dllm.FastDLLMOptions(gen_length=G, block_length=BL, cache="dual")
  state = fast_dllm.init_state(None, cfg, opts, *batch, jax.random.key(0))
  np.testing.assert_array_equal(
      state.positions[:, -G:],
      np.asarray(masks.left_pad_positions(batch[1]))[:, -1:] + 1 + np.arange(G))


@pytest.mark.parametrize("tokens,options,match", [
    ([[5, 3, 6]], {"gen_length": 16, "block_length": 8}, "mask id"),
    ([[5, 6]], {"gen_length": 16, "block_length": 5}, "multiple of block_length"),
    ([[5, 6]], {"gen_length": 16, "block_length": 8, "cache": "suffix"}, "cache mode"),
    ([[5, 6]], {"gen_length": 16, "block_length": 8, "threshold": 0.0}, "threshold"),
    ([[5, 6]], {"gen_length": 16, "block_length": 8, "rule": "topk"}, "rule"),
    ([[5] * 120], {"gen_length": 16, "block_length": 8}, "max_seq_len"),
    ([[5, 6]], {"gen_length": 16, "block_length": 8, "tau": 0.8}, "threshold"),
])
def test_bad_input_raises_before_compiling(tokens, options, match):
  toks, valid = base.pad_prompts(tokens, 0)
  with pytest.raises(ValueError, match=match):
    fast_dllm.fast_dllm_generate(None, get_preset("tiny"), toks, valid, **options)
