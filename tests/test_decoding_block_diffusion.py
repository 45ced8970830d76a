"""Block diffusion (BD3-style semi-AR) decoding: D2F's one-block special case.

Checked against (1) D2F itself with one block in flight and no threshold commits, and
(2) a Python re-statement of semi-autoregressive block decoding (LLaDA's per-block
schedule) that runs the model's FULL block-causal forward every step, one prompt at a time.
The model and the full-forward helper are shared with test_decoding_d2f.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding import base, d2f
from test_decoding_d2f import CFG, PROMPTS, full_forward, peaked_params

G, K = 16, 4


@pytest.fixture(scope="module")
def params():
  return peaked_params()


@pytest.fixture(scope="module")
def batch():
  return base.pad_prompts(PROMPTS, CFG.pad_token_id)


def reference_block_diffusion(params, cfg, prompt, *, gen_length, block_size, steps):
  """One unpadded prompt: for each block, `steps` full forwards, each committing the
  k // s (+1 for the first k % s steps) most probable masked slots of the block.

  Stops appending blocks once a stop token was committed, and stops a prompt as soon as
  its first stop token has only decided tokens before it. Returns (tokens, length, forwards).
  """
  k, p, mask = block_size, len(prompt), cfg.mask_token_id
  stops = set(base.stop_ids(cfg))
  x = np.array(list(prompt) + [mask] * gen_length)
  forwards = 0
  for b in range(gen_length // k):
    sl = slice(p + b * k, p + (b + 1) * k)
    for i in range(steps):
      valid = np.arange(p + gen_length) < p + (b + 1) * k
      logits = full_forward(params, x[None], valid[None], cfg=cfg, prompt_len=p, block_size=k)
      logits = np.asarray(logits)[0, sl].astype(np.float64)
      forwards += 1
      logits[:, mask] = -np.inf
      x0 = logits.argmax(-1)
      probs = np.exp(logits - logits.max(-1, keepdims=True))
      conf = (probs / probs.sum(-1, keepdims=True))[np.arange(k), x0]
      conf = np.where(x[sl] == mask, conf, -np.inf)
      quota = k // steps + (i < k % steps)
      chosen = np.argsort(-conf, kind="stable")[:quota]
      x[sl.start + chosen] = x0[chosen]
      r = x[p:]
      hits = [j for j, t in enumerate(r) if t in stops]
      if hits and np.all(r[:hits[0]] != mask):
        break
    if any(t in stops for t in x[p:]):
      break
  r = x[p:]
  cut = next((j for j, t in enumerate(r) if t in stops), gen_length)
  return np.where(np.arange(gen_length) < cut, r, cfg.pad_token_id), cut, forwards


def test_equals_d2f_with_one_block_in_flight(params, batch):
  """s = k commits the top-1 per step: exactly D2F with one block in flight and a
  threshold above 1. Both run G forwards, the first with the prompt (no stop token here)."""
  bd, bd_state = d2f.block_diffusion_generate(params, CFG, *batch, gen_length=G,
                                              block_length=K, steps_per_block=K,
                                              return_state=True)
  pipe, pipe_state = d2f.d2f_generate(params, CFG, *batch, gen_length=G, block_length=K,
                                      tau_conf=1.5, max_active_blocks=1, return_state=True)
  np.testing.assert_array_equal(bd.tokens, pipe.tokens)
  assert not np.any(np.isin(np.asarray(bd.tokens), base.stop_ids(CFG)))
  for out, state in ((bd, bd_state), (pipe, pipe_state)):
    assert int(out.steps) == G and int(out.nfe) == G
    np.testing.assert_array_equal(out.committed, G)
    np.testing.assert_array_equal(out.lengths, G)
    np.testing.assert_array_equal(state.block_steps, K)
    np.testing.assert_array_equal(state.forwards, G)
    assert float(out.tokens_per_step) == 1.0


def test_matches_semi_ar_reference_with_uneven_schedule(params, batch):
  """k = 4, s = 3: steps commit 2, 1, 1 tokens; N * s forwards per row."""
  steps = 3
  out, state = d2f.block_diffusion_generate(params, CFG, *batch, gen_length=G, block_length=K,
                                            steps_per_block=steps, return_state=True)
  stopped = 0
  for row, prompt in enumerate(PROMPTS):
    tokens, length, forwards = reference_block_diffusion(
        params, CFG, prompt, gen_length=G, block_size=K, steps=steps)
    np.testing.assert_array_equal(out.tokens[row], tokens, err_msg=f"row {row}")
    assert int(out.lengths[row]) == length
    assert int(state.forwards[row]) == forwards
    if length == G:
      assert forwards == (G // K) * steps
    else:
      stopped += 1
  assert stopped >= 1, "no row met a stop token; the early stop went untested"
  assert int(out.nfe) == int(out.steps) == int(jnp.max(state.forwards))
  assert bool(jnp.all(out.done))


@pytest.mark.parametrize("kw,match", [
    (dict(steps_per_block=0), "steps_per_block"),
    (dict(steps_per_block=K + 1), "steps_per_block"),
    (dict(gen_length=G + 2), "multiple of block_length"),
    (dict(temperature=-1.0), "temperature"),
])
def test_bad_settings_raise(params, batch, kw, match):
  args = dict(gen_length=G, block_length=K, steps_per_block=2) | kw
  with pytest.raises(ValueError, match=match):
    d2f.block_diffusion_generate(params, CFG, *batch, **args)
