"""Reference order: by default LLaDA and Fast-dLLM commit the slots the reference `generate`
commits, near-ties included; `batch_invariant=True` trades that for a row alone == in a batch.

The model is a random tiny one (float32, weights N(0, 0.2), embedding and head N(0, 0.5),
seed 2) on which, with these four prompts at G = 64, greedy low-confidence ranking on the
2^-12 grid commits another slot than LLaDA's `generate` for one prompt in four at steps 64 /
block 64 and at steps 32 / block 32 (`test_the_grid_would_commit_other_slots_here` checks
that the case is really there).

The re-statements are LLaDA's and Fast-dLLM's published loops written out: the model forward
is the decoder's own (the jitted model on the whole batch canvas, as the reference runs its
model on the canvas; Fast-dLLM's approximate caches use test_decoding_fast_dllm's NumPy
forward, whose prefix / suffix K/V come from the row's first forward in the block), and the
selection is NumPy on exact float32 confidences (softmax probability of the argmax), ranked
as torch.topk ranks them: a stable descending sort, equal scores to the lowest slot. Each
decode is compared token for token, in forwards (NFE) and in the step that committed each
slot.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding import api, base, fast_dllm, llada, protocol
from dllm_jax.models import get_preset
from test_decoding_fast_dllm import np_forward
from test_decoding_llada import random_params

G = 64
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20, 21, 22, 23]]
LLADA = [(64, 64), (32, 32), (64, 32)]  # (steps, block_length): the cases, semi-AR
FAST_BLOCK = 32


@pytest.fixture(scope="module")
def model():
  cfg = get_preset("tiny").replace(eos_token_id=None)  # no stop: whole canvases compared
  return cfg, random_params(cfg, seed=2, std=0.2, head_std=0.5)


@pytest.fixture(scope="module")
def batch():
  return base.pad_prompts(PROMPTS, 0)


_FORWARD = jax.jit(llada.bidirectional_logits, static_argnums=1)


def _canvas(cfg, tokens, valid):
  canvas, cvalid, positions = base.init_canvas(jnp.asarray(tokens), jnp.asarray(valid), G,
                                               cfg.mask_token_id)
  return np.array(canvas), np.asarray(cvalid), np.asarray(positions)


def _proposals(logits, mask_id):
  """Greedy proposals and their float32 softmax probability (LLaDA's low_confidence)."""
  logits = np.array(logits, np.float32)
  logits[..., mask_id] = -np.inf
  x0 = logits.argmax(-1)
  z = logits - logits.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  return x0, np.take_along_axis(p, x0[..., None], -1)[..., 0]


def topk(conf, candidates, k):
  """torch.topk's choice of k slots: a stable descending sort (equal scores: lowest slot)."""
  return np.argsort(-np.where(candidates, conf, -np.inf), kind="stable")[:k]


def reference_llada(cfg, params, tokens, valid, *, steps, block_length):
  """LLaDA's generate (greedy, low_confidence). Returns ([B, G] tokens, nfe, [B, G] step
  that committed each slot)."""
  canvas, cvalid, positions = _canvas(cfg, tokens, valid)
  b, p = tokens.shape
  mask = cfg.mask_token_id
  spb = steps // (G // block_length)
  committed_at = np.full((b, G), -1)
  nfe = 0
  for start in range(p, p + G, block_length):
    block = slice(start, start + block_length)
    m = (canvas[:, block] == mask).sum(1)
    for j in range(spb):
      x0, conf = _proposals(_FORWARD(params, cfg, canvas, cvalid, positions), mask)
      for r in range(b):
        k = m[r] // spb + (j < m[r] % spb)
        pick = start + topk(conf[r, block], canvas[r, block] == mask, k)
        canvas[r, pick] = x0[r, pick]
        committed_at[r, pick - p] = nfe
      nfe += 1
  return canvas[:, p:], nfe, committed_at


def reference_fast_dllm(cfg, params, tokens, valid, *, threshold, cache):
  """Fast-dLLM's generate (greedy), each row on its own block clock (a row starts its next
  block on the step after it filled one) in a batched forward per step: its block's masked
  slots with confidence > threshold, and at least the most confident one. A row's first
  forward in a block is a full forward; with a cache its later forwards take the K/V of the
  prefix (prefix) or of everything but the block (dual) from that one."""
  canvas, cvalid, positions = _canvas(cfg, tokens, valid)
  b, p = tokens.shape
  mask, bl = cfg.mask_token_id, FAST_BLOCK
  slot = np.arange(canvas.shape[1])[None]
  committed_at = np.full((b, G), -1)
  fresh = np.ones(b, bool)
  kv0, nfe = None, 0
  while True:
    open_ = (canvas[:, p:] == mask).reshape(b, -1, bl).any(-1)
    live = open_.any(1)
    if not live.any():
      return canvas[:, p:], nfe, committed_at
    start = p + bl * np.argmax(open_, 1)[:, None]                          # [B, 1]
    if cache == "none":
      logits = np.asarray(_FORWARD(params, cfg, canvas, cvalid, positions))
    else:
      logits, kv = np_forward(params, cfg, canvas, positions, cvalid)
      kv0 = kv if kv0 is None else [tuple(np.where(fresh[:, None, None, None], new, old)
                                          for new, old in zip(kn, ko))
                                    for kn, ko in zip(kv, kv0)]
      reuse = slot < start if cache == "prefix" else (slot < start) | (slot >= start + bl)
      cached, _ = np_forward(params, cfg, canvas, positions, cvalid, kv0, reuse)
      logits = np.where(fresh[:, None, None], logits, cached)
    x0, conf = _proposals(logits, mask)
    for r in np.flatnonzero(live):
      block = slice(start[r, 0], start[r, 0] + bl)
      candidates = canvas[r, block] == mask
      pick = set(start[r, 0] + topk(conf[r, block], candidates, 1))
      pick |= set(start[r, 0] + np.flatnonzero(candidates & (conf[r, block] > threshold)))
      pick = np.asarray(sorted(pick))
      canvas[r, pick] = x0[r, pick]
      committed_at[r, pick - p] = nfe
    filled = ~np.any(np.take_along_axis(canvas, start + np.arange(bl), 1) == mask, 1)
    fresh = np.where(live, filled, fresh)  # a row that filled its block starts the next
    nfe += 1


def stepped(module, params, cfg, opts, tokens, valid):
  """Runs the decoder's step interface; [B, G] the step that committed each slot."""
  decoder_cls = llada.LLaDADecoder if module is llada else fast_dllm.FastDLLMDecoder
  plan = decoder_cls.from_options(cfg, opts)
  state = protocol.jit_init(params, tokens, valid, jax.random.key(0), plan.traced,
                            decoder=plan.decoder)
  committed_at = np.full(tokens.shape[:1] + (G,), -1)
  before = np.asarray(state.canvas)[:, -G:]
  i = 0
  while bool(module.running(opts, state)):
    state = protocol.jit_step(params, state, decoder=plan.decoder)
    after = np.asarray(state.canvas)[:, -G:]
    committed_at[after != before] = i
    before, i = after, i + 1
  return committed_at


@pytest.fixture(scope="module")
def llada_reference(model, batch):
  """reference_llada(steps, block_length) of the model and batch, each computed once."""
  cfg, params = model
  done = {}

  def get(steps, block_length):
    if (steps, block_length) not in done:
      done[steps, block_length] = reference_llada(cfg, params, *batch, steps=steps,
                                                  block_length=block_length)
    return done[steps, block_length]
  return get


@pytest.mark.parametrize("steps,block_length", LLADA)
def test_llada_commits_what_the_reference_commits(model, batch, llada_reference, steps,
                                                  block_length):
  cfg, params = model
  tokens, nfe, committed_at = llada_reference(steps, block_length)
  out = llada.llada_generate(params, cfg, *batch, gen_length=G, block_length=block_length,
                             steps=steps)
  np.testing.assert_array_equal(out.tokens, tokens)
  assert int(out.nfe) == nfe == steps
  opts = llada.LLaDAOptions(gen_length=G, block_length=block_length, steps=steps)
  np.testing.assert_array_equal(stepped(llada, params, cfg, opts, *batch), committed_at)


@pytest.mark.parametrize("cache,threshold", [("none", np.inf), ("none", 0.9),
                                             ("prefix", 0.9), ("dual", 0.9)])
def test_fast_dllm_commits_what_the_reference_commits(model, batch, llada_reference, cache,
                                                      threshold):
  """threshold none is Fast-dLLM's generate without a threshold at steps = gen_length: one
  token per step, the most confident (here threshold=inf: none is above it), which is
  LLaDA's generate at steps = G."""
  cfg, params = model
  tokens, nfe, committed_at = reference_fast_dllm(cfg, params, *batch, threshold=threshold,
                                                  cache=cache)
  kw = dict(gen_length=G, block_length=FAST_BLOCK, threshold=threshold, cache=cache)
  out = fast_dllm.fast_dllm_generate(params, cfg, *batch, **kw)
  np.testing.assert_array_equal(out.tokens, tokens)
  assert int(out.nfe) == nfe
  opts = fast_dllm.FastDLLMOptions(**kw)
  np.testing.assert_array_equal(stepped(fast_dllm, params, cfg, opts, *batch), committed_at)
  if threshold == np.inf:
    llada_tokens, _, llada_at = llada_reference(G, FAST_BLOCK)
    np.testing.assert_array_equal(tokens, llada_tokens)
    np.testing.assert_array_equal(committed_at, llada_at)


def test_the_grid_would_commit_other_slots_here(model, batch, llada_reference):
  """The near-tie case is real on this model: batch_invariant=True (ranking on the grid)
  commits another slot than the reference for some prompt, where the default does not."""
  cfg, params = model
  differs = 0
  for steps, block_length in LLADA[:2]:
    tokens = llada_reference(steps, block_length)[0]
    grid = llada.llada_generate(params, cfg, *batch, gen_length=G, block_length=block_length,
                                steps=steps, batch_invariant=True)
    differs += int(np.any(np.asarray(grid.tokens) != tokens, axis=1).sum())
  assert differs >= 1


@pytest.mark.parametrize("method,options", [
    ("llada", dict(gen_length=G, block_length=G, steps=G)),
    ("fast_dllm", dict(gen_length=G, block_length=FAST_BLOCK, threshold=0.9)),
])
def test_batch_invariant_gives_a_row_alone_its_batch_result(model, method, options):
  """With batch_invariant=True each prompt decoded alone (a one-row batch) equals its row of
  the batch of four (the default promises the reference's order instead)."""
  cfg, params = model
  options = dict(options, batch_invariant=True)
  many = np.asarray(api.generate(params, cfg, PROMPTS, method=method, **options).tokens)
  for i, prompt in enumerate(PROMPTS):
    one = api.generate(params, cfg, [prompt], method=method, **options)
    np.testing.assert_array_equal(np.asarray(one.tokens)[0], many[i], err_msg=f"row {i}")
