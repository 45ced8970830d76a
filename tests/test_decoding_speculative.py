"""Speculative and self-speculative decoding against AR decoding of the same target.

Greedy: token for token equal to `ar_generate` (batched, and one row alone), on random
weights and on briefly trained tiny models, with drafters that accept whole blocks (the
target drafting for itself) and drafters that reject at once (unrelated random weights).
Sampling: the joint distribution of the generated tokens against the exact AR distribution
(enumerated on an 8-id vocabulary) by a seeded chi-square test.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from dllm_jax.decoding import api, ar, protocol, selfspec, speculative
from dllm_jax.decoding.base import pad_prompts
from dllm_jax.diffusion.objectives import make_objective
from dllm_jax.models import abstract_params, forward, get_preset
from dllm_jax.models.transformer import Transformer

CFG = get_preset("tiny")
G, K = 12, 3
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]


def random_params(cfg, seed, scale=0.1):
  """Random weights of the right shapes without compiling an init (norm scales 1)."""
  rs = np.random.RandomState(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.ones(x.shape, x.dtype) if "norm" in jax.tree_util.keystr(path)
      else jnp.asarray(rs.randn(*x.shape) * scale, x.dtype), nn.unbox(abstract_params(cfg)))


def batch_of(prompts, length=None):
  return pad_prompts(prompts, CFG.pad_token_id, length)


def spec(target, drafter, kind, tokens, valid, **kw):
  kw = dict(gen_length=G, draft_length=K, return_stats=True, drafter_cfg=CFG) | kw
  return speculative.speculative_generate(target, CFG, tokens, valid, drafter_params=drafter,
                                          drafter=kind, **kw)


def same_tokens(out, ref):
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))


@pytest.fixture(scope="module")
def random_models():
  return random_params(CFG, 0, 0.3), random_params(CFG, 1, 0.3)


# ----------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("kind", [
    pytest.param("ar", marks=pytest.mark.slow), "d2f",
    pytest.param("block_diffusion", marks=pytest.mark.slow)])
def test_greedy_equals_ar_on_random_models(random_models, kind):
  target, stranger = random_models
  tokens, valid = batch_of(PROMPTS)
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  for drafter in (target, stranger):
    out, st = spec(target, drafter, kind, tokens, valid)
    same_tokens(out, ref)
    assert np.all(np.asarray(out.committed) >= np.asarray(ref.lengths))
    assert int(out.nfe) == int(st.target_forwards) + int(st.drafter_forwards)
    committed, rounds = np.asarray(out.committed), np.asarray(st.rounds)
    accepted = np.asarray(st.accepted)
    # Every live round commits its accepted drafts plus one target token (cut at G / EOS).
    assert np.all(committed <= accepted + rounds) and np.all(committed >= rounds)
  if kind == "ar":  # the target drafting for itself: every draft is accepted
    out, st = spec(target, target, kind, tokens, valid)
    full = np.asarray(st.rounds) * K
    assert np.all(np.asarray(st.accepted) >= full - K)  # the last round may end early
    assert int(st.target_forwards) <= -(-G // (K + 1)) + 1


def test_unrelated_drafter_rejects_and_still_matches(random_models):
  """A drafter with unrelated weights is rejected at the first token in most rounds: each
  round then commits exactly the target's own token."""
  target, stranger = random_models
  tokens, valid = batch_of(PROMPTS)
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  out, st = spec(target, stranger, "d2f", tokens, valid)
  same_tokens(out, ref)
  assert np.sum(np.asarray(st.accepted)) <= 2
  np.testing.assert_array_equal(np.asarray(st.rounds),
                                np.asarray(out.committed) - np.asarray(st.accepted))


@pytest.mark.slow
def test_one_row_alone_equals_its_batched_row(random_models):
  target, stranger = random_models
  tokens, valid = batch_of(PROMPTS)
  batched, _ = spec(target, stranger, "ar", tokens, valid)
  for r, prompt in enumerate(PROMPTS):
    t1, v1 = batch_of([prompt], tokens.shape[1])
    alone, _ = spec(target, stranger, "ar", t1, v1)
    np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(batched.tokens[r]))


@pytest.mark.parametrize("k", [1, pytest.param(K, marks=pytest.mark.slow)])
def test_selfspec_greedy_equals_ar_on_random_model(random_models, k):
  target, _ = random_models
  tokens, valid = batch_of(PROMPTS)
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  out, st = selfspec.selfspec_generate(target, CFG, tokens, valid, gen_length=G,
                                       draft_length=k, return_stats=True)
  same_tokens(out, ref)
  assert int(out.nfe) == int(out.steps) == int(st.forwards)
  if k == K:
    for r, prompt in enumerate(PROMPTS):
      t1, v1 = batch_of([prompt], tokens.shape[1])
      alone = selfspec.selfspec_generate(target, CFG, t1, v1, gen_length=G, draft_length=k)
      np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(out.tokens[r]))


# ----------------------------------------------------------------------------- trained models

def counting_batch(rs, b=32, p=4, length=16):
  """Rows `a, a+1, a+2, ...` (ids 4..59, wrapping): the answer continues the prompt."""
  start = rs.randint(4, 60, (b, 1))
  tokens = (4 + (start - 4 + np.arange(length)[None]) % 56).astype(np.int32)
  prompt = np.zeros((b, length), bool)
  prompt[:, :p] = True
  valid = np.ones((b, length), bool)
  return dict(tokens=tokens, valid=valid, prompt_mask=prompt, loss_mask=~prompt,
              positions=np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)))


def train(name, steps, seed, cfg=CFG, **options):
  loss_fn = make_objective(name, cfg, **options)
  params = random_params(cfg, seed, 0.05)
  tx = optax.adam(1e-2)

  @jax.jit
  def update(params, opt_state, batch, rng):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, rs = tx.init(params), np.random.RandomState(seed)
  for i in range(steps):
    params, opt_state, loss = update(params, opt_state, counting_batch(rs),
                                     jax.random.key(i))
  return params, float(loss)


def counting_model(run_cache, name, seed, **options):
  """`train(name, 200, seed, **options)` as host arrays, trained once per test run: this file,
  test_decoding_adaptive and test_serving_selfspec decode the same counting models."""
  key = "-".join(["counting", name, str(seed)] + [f"{k}={v}" for k, v in sorted(options.items())])
  return run_cache(key, lambda: jax.device_get(train(name, 200, seed, **options)))


@pytest.fixture(scope="module")
def trained(run_cache):
  """A selfspec-trained target (also an AR model) and a block-diffusion drafter."""
  target, target_loss = counting_model(run_cache, "selfspec", 0, block_size=K + 1)
  drafter, _ = counting_model(run_cache, "block_diffusion", 1, block_size=K + 1, sft=True)
  return target, drafter, target_loss


COUNT_PROMPTS = [[20, 21, 22, 23], [40, 41], [7, 8, 9, 10, 11]]


@pytest.mark.slow
@pytest.mark.parametrize("kind", speculative.DRAFTERS)
def test_greedy_equals_ar_on_trained_models(trained, random_models, kind):
  target, drafter, loss = trained
  assert loss < 1.0, f"the tiny target did not train (loss {loss})"
  tokens, valid = batch_of(COUNT_PROMPTS, 7)
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  # The target is selfspec-trained: an AR model, and a drafter in the "selfspec" layout.
  drafter = target if kind in ("ar", "selfspec") else drafter
  out, st = spec(target, drafter, kind, tokens, valid)
  same_tokens(out, ref)
  per_forward = np.asarray(out.committed).sum() / np.asarray(st.rounds).sum()
  print(f"{kind} drafter: {per_forward:.2f} tokens per target forward, "
        f"{int(st.drafter_forwards)} drafter forwards")
  assert per_forward > 1.5  # trained drafters get whole blocks accepted


def test_selfspec_drafter_drafts_in_its_training_layout(random_models, monkeypatch):
  """Every round's draft of a "selfspec" drafter equals the greedy mask block of one uncached
  forward in `selfspec_loss`'s layout (ids = positions, the prompt's too; the k masks at the
  next k positions with the id of the first): left padding, the drafter's cache, and the
  prefix the target accepted change nothing."""
  target, stranger = random_models
  seen = []
  real = speculative.diffusion_draft

  def spy(dparams, dcfg, opts, forbid, context, cache, block_id, block_pos):
    drafts, conf, cache = real(dparams, dcfg, opts, forbid, context, cache, block_id, block_pos)
    jax.debug.callback(lambda pos, d: seen.append((np.asarray(pos), np.asarray(d))),
                       block_pos, drafts)
    return drafts, conf, cache

  monkeypatch.setattr(speculative, "diffusion_draft", spy)
  # One loop over the whole batch (no stages that finished rows leave), so every recorded
  # draft has a row per prompt, in prompt order.
  monkeypatch.setattr(protocol, "run_batch", protocol.run)
  protocol.clear_programs()  # trace the spy, and leave no program holding it
  try:
    tokens, valid = batch_of(PROMPTS)
    out, _ = spec(target, stranger, "selfspec", tokens, valid)
  finally:
    protocol.clear_programs()
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  same_tokens(out, ref)
  width = max(map(len, PROMPTS)) + G

  @jax.jit
  def reference(clean, length):
    """The greedy mask block after clean[:length] ([width], padded), one uncached forward."""
    slot = jnp.arange(width + K, dtype=jnp.int32)
    block = slot >= width
    ids = jnp.where(block, length, slot)                    # ids = positions; block: one id
    positions = jnp.where(block, length + slot - width, slot)
    tokens = jnp.concatenate([clean, jnp.full((K,), CFG.mask_token_id, jnp.int32)])
    logits = Transformer(CFG).apply({"params": stranger}, tokens[None], block_ids=ids[None],
                                    positions=positions[None],
                                    valid=((slot < length) | block)[None])
    return speculative.greedy(logits[0, width:], (CFG.mask_token_id,))

  checked = 0
  for pos, drafts in seen:
    for r, prompt in enumerate(PROMPTS):
      n = int(pos[r]) - len(prompt)  # the block starts after n committed tokens
      if n > int(ref.lengths[r]):
        continue
      clean = list(prompt) + [int(t) for t in np.asarray(ref.tokens[r, :n])]
      want = reference(jnp.asarray(clean + [0] * (width - len(clean)), jnp.int32), len(clean))
      np.testing.assert_array_equal(drafts[r], np.asarray(want), err_msg=f"row {r}, n={n}")
      checked += 1
  assert checked >= len(PROMPTS) * 2, f"only {checked} drafts checked"


# A drafter much smaller than the target: every width differs (D, layers, heads, K/V heads,
# head_dim, F); only the tokenizer (vocab, special ids) and the window are shared.
NARROW = CFG.replace(name="tiny-narrow", d_model=24, n_layers=1, n_heads=2, n_kv_heads=1,
                     mlp_dim=40)
WIDTHS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "resolved_head_dim", "mlp_dim")


@pytest.fixture(scope="module")
def narrow_trained(trained):
  """The trained target, and a narrow AR drafter trained on the same counting data."""
  drafter, loss = train("ar", 200, 2, cfg=NARROW)
  return trained[0], drafter, loss


@pytest.mark.parametrize("weights", ["random", pytest.param("trained", marks=pytest.mark.slow)])
def test_narrow_ar_drafter_is_greedy_exact(request, random_models, weights):
  """A narrower, shallower AR drafter (its own cache shapes) leaves the output the target's
  greedy AR tokens, batched over prompts of different lengths and one row alone. Trained,
  it gets whole drafts accepted, so the full-accept round (`pending`) runs as well."""
  if weights == "random":
    (target, _), drafter, prompts = random_models, random_params(NARROW, 5, 0.3), PROMPTS
  else:
    target, drafter, loss = request.getfixturevalue("narrow_trained")
    assert loss < 1.0, f"the narrow drafter did not train (loss {loss})"
    prompts = COUNT_PROMPTS
  assert all(getattr(NARROW, w) != getattr(CFG, w) for w in WIDTHS)

  def narrow(tokens, valid):
    return spec(target, drafter, "ar", tokens, valid, drafter_cfg=NARROW)

  tokens, valid = batch_of(prompts)
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  out, st = narrow(tokens, valid)
  same_tokens(out, ref)
  assert int(st.drafter_forwards) == K * int(st.target_forwards)
  for r, prompt in enumerate(prompts):
    alone, _ = narrow(*batch_of([prompt], tokens.shape[1]))
    np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(out.tokens[r]))
  if weights == "trained":
    per_forward = np.asarray(out.committed).sum() / np.asarray(st.rounds).sum()
    assert per_forward > 1.5, f"{per_forward:.2f} tokens per target forward"


@pytest.mark.slow
def test_selfspec_equals_ar_on_trained_model(trained):
  target, _, _ = trained
  tokens, valid = batch_of(COUNT_PROMPTS, 7)
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  out, st = selfspec.selfspec_generate(target, CFG, tokens, valid, gen_length=G,
                                       draft_length=K, return_stats=True)
  same_tokens(out, ref)
  per_forward = np.asarray(out.committed).sum() / np.asarray(st.rounds).sum()
  print(f"selfspec: {per_forward:.2f} tokens per forward (AR: 1.00)")
  assert per_forward > 1.5


def selfspec_rounds(params, tokens, valid, k):
  """Per round and row: (drafts verified, drafts accepted, tokens committed), read off the
  decoder's state between forwards (the protocol's own init/step)."""
  plan = protocol.plan("selfspec", CFG, dict(gen_length=G, draft_length=k))
  decoder = plan.decoder
  state = protocol.jit_init(params, tokens, valid, jax.random.key(0), plan.traced,
                            decoder=decoder)
  rounds = []
  while not bool(np.all(np.asarray(state.done))):
    before = jax.device_get((state.drafted, state.accepted, state.n))
    state = protocol.jit_step(params, state, decoder=decoder)
    after = jax.device_get((state.drafted, state.accepted, state.n))
    rounds.append(np.stack([a - b for a, b in zip(after, before)], -1))  # [B, 3]
  return np.stack(rounds, 1)  # [B, R, 3]


@pytest.mark.slow
def test_selfspec_drafts_after_a_partial_acceptance(trained):
  """TiDAR's rule: every forward drafts, for whatever number of drafts it accepts. On the
  counting target, prompts that break the count (a jump the network must first correct)
  reject part of a draft; the round after such a round offers a full draft again and, the
  count being back on track, commits more than one token. (Drafting only after a fully
  accepted round, the round after a rejection would verify nothing and commit one.)"""
  target, _, _ = trained
  prompts = [[20, 21, 22, 50], [40, 41, 7], [7, 8, 9, 30, 31], [60, 61, 62, 63, 10]]
  tokens, valid = batch_of(prompts, 5)
  trace = selfspec_rounds(target, tokens, valid, K)
  drafted, accepted, committed = trace[..., 0], trace[..., 1], trace[..., 2]
  after_partial = [(b, r) for b in range(len(prompts)) for r in range(trace.shape[1] - 1)
                   if drafted[b, r] == K and accepted[b, r] < K and committed[b, r] > 0
                   and committed[b, r + 1] > 0]
  assert after_partial, trace
  assert all(drafted[b, r + 1] == K for b, r in after_partial), trace
  assert any(committed[b, r + 1] > 1 for b, r in after_partial), trace
  out = selfspec.selfspec_generate(target, CFG, tokens, valid, gen_length=G, draft_length=K)
  same_tokens(out, ar.ar_generate(target, CFG, tokens, valid, gen_length=G))


# ----------------------------------------------------------------------------- sampling

SMALL = CFG.replace(vocab_size=8, mask_token_id=7, eos_token_id=None, pad_token_id=0,
                    bos_token_id=None)
SG, SAMPLES = 3, 12000


def exact_ar_distribution(params, prompt, temperature):
  """{sequence: probability} of AR sampling G=SG tokens (the mask id never emitted)."""
  seqs = np.array(np.meshgrid(*[np.arange(7)] * SG, indexing="ij")).reshape(SG, -1).T
  full = np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs], 1)
  logits = np.asarray(jax.jit(forward, static_argnums=1)(params, SMALL, jnp.asarray(full)),
                      np.float64)
  logits[..., 7] = -np.inf
  logp = logits / temperature
  logp = logp - np.log(np.exp(logp - logp.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logp.max(-1, keepdims=True)
  p = len(prompt)
  picked = np.take_along_axis(logp[:, p - 1:-1], seqs[..., None], -1)[..., 0]
  return {tuple(s): float(np.exp(v)) for s, v in zip(seqs.tolist(), picked.sum(1))}


def chi_square_p(samples, exact):
  counts = {}
  for row in np.asarray(samples).tolist():
    counts[tuple(row)] = counts.get(tuple(row), 0) + 1
  keys = sorted(exact, key=lambda s: -exact[s])
  expected = np.array([exact[s] * len(samples) for s in keys])
  observed = np.array([counts.get(s, 0) for s in keys], float)
  assert sum(counts.get(s, 0) for s in keys) == len(samples)  # no impossible sequence
  big = expected >= 5  # pool the rare sequences into one cell
  obs = np.append(observed[big], observed[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  return stats.chisquare(obs, exp).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar_drafter", "d2f_drafter", "selfspec"])
def test_sampling_matches_ar_distribution(method):
  target = random_params(SMALL, 3, 0.5)
  drafter = random_params(SMALL, 4, 0.5)
  prompt = [1, 2]
  tokens = np.tile(np.asarray([prompt], np.int32), (SAMPLES, 1))
  kw = dict(gen_length=SG, temperature=1.0, rng=jax.random.key(11))
  if method == "selfspec":
    out = selfspec.selfspec_generate(target, SMALL, tokens, None, draft_length=2, **kw)
  else:
    kind = "ar" if method == "ar_drafter" else "d2f"
    out = speculative.speculative_generate(target, SMALL, tokens, None,
                                           drafter_params=drafter, drafter_cfg=SMALL,
                                           drafter=kind, draft_length=2, **kw)
  exact = exact_ar_distribution(target, prompt, 1.0)
  assert chi_square_p(out.tokens, exact) > 1e-3
  # The test has power: the drafter's own distribution is far from the target's.
  wrong = exact_ar_distribution(drafter, prompt, 1.0)
  assert chi_square_p(out.tokens, wrong) < 1e-6


# ----------------------------------------------------------------------------- traced sampling

# The hybrids' options for the sweep: a drafter with unrelated weights, so rounds reject and
# sample from the residual; adaptive verifies every round (its rule never leaves VERIFY).
SWEPT = {"speculative": dict(drafter="ar", draft_length=K),
         "selfspec": dict(draft_length=K),
         "adaptive": dict(draft_length=K, parallel_confidence=float("inf"), ar_confidence=0.0,
                          min_acceptance=0.0, trust_streak=0)}
SWEEP = (dict(temperature=0.3), dict(temperature=0.7, top_k=5),
         dict(temperature=1.3, top_p=0.8))


@pytest.mark.parametrize("method", [pytest.param("speculative", marks=pytest.mark.slow),
                                    "selfspec", pytest.param("adaptive", marks=pytest.mark.slow)])
def test_a_sampling_sweep_compiles_once_and_equals_the_static_program(random_models, method):
  """generate at temperatures 0.3, 0.7 and 1.3 (with top_k, then top_p) runs one program for
  the three (the target's sampling is traced, `speculative.split_sampling`), and each output
  equals that of the program holding those options static (the decoder built from options
  not split: one program per value, as `plan` compiled before)."""
  target, stranger = random_models
  cfg = CFG.replace(max_seq_len=100)  # a config no other test compiles for
  options = dict(SWEPT[method], gen_length=G)
  if method != "selfspec":
    options.update(drafter_params=stranger, drafter_cfg=cfg)
  tokens, valid = batch_of(PROMPTS)
  rng = jax.random.key(5)
  before = protocol.compiled_programs()[0]
  outs = [api.generate(target, cfg, (tokens, valid), method=method, rng=rng, pad_to=None,
                       batch_buckets=None, **options, **sampling) for sampling in SWEEP]
  assert protocol.compiled_programs()[0] == before + 1
  assert len({np.asarray(o.tokens).tobytes() for o in outs}) == len(SWEEP)
  for sampling, out in zip(SWEEP, outs):
    plan = protocol.plan(method, cfg, {**options, **sampling})
    opts = dataclasses.replace(plan.decoder.opts, **{**speculative.SAMPLING, **sampling})
    static = {k: v for k, v in plan.traced.items() if k not in speculative.SAMPLING}
    ref = protocol.run(plan.params(target), tokens, valid, rng, static, plan.row_inputs,
                       decoder=dataclasses.replace(plan.decoder, opts=opts))
    same_tokens(out, ref)
    assert int(out.nfe) == int(ref.nfe), sampling


# ----------------------------------------------------------------------------- errors

def test_invalid_settings_raise_named_errors(random_models):
  target, _ = random_models
  tokens, valid = batch_of(PROMPTS)
  other = CFG.replace(vocab_size=80)
  with pytest.raises(speculative.VocabMismatchError, match="vocabulary"):
    speculative.speculative_generate(target, CFG, tokens, valid, drafter_params=target,
                                     drafter_cfg=other, drafter="ar", gen_length=G)
  with pytest.raises(speculative.VocabMismatchError, match="eos_token_id"):
    speculative.speculative_generate(target, CFG, tokens, valid, drafter_params=target,
                                     drafter_cfg=CFG.replace(eos_token_id=5), drafter="ar",
                                     gen_length=G)
  for bad in (0, -1, G + 1):
    with pytest.raises(ValueError, match="draft_length"):
      spec(target, target, "ar", tokens, valid, draft_length=bad)
    with pytest.raises(ValueError, match="draft_length"):
      selfspec.selfspec_generate(target, CFG, tokens, valid, gen_length=G, draft_length=bad)
  with pytest.raises(ValueError, match="max_seq_len"):
    spec(target, target, "d2f", tokens, valid, gen_length=CFG.max_seq_len)
  with pytest.raises(ValueError, match="max_seq_len"):
    speculative.speculative_generate(
        target, CFG, tokens, valid, drafter_params=target, gen_length=100, draft_length=2,
        drafter_cfg=CFG.replace(max_seq_len=64), drafter="ar")
  with pytest.raises(ValueError, match="max_seq_len"):
    selfspec.selfspec_generate(target, CFG, tokens, valid, gen_length=CFG.max_seq_len)
  with pytest.raises(ValueError, match="Unknown drafter"):
    spec(target, target, "medusa", tokens, valid)
  with pytest.raises(ValueError, match="draft_steps"):
    spec(target, target, "ar", tokens, valid, draft_steps=2)
  with pytest.raises(ValueError, match="mask_token_id"):
    speculative.speculative_generate(
        target, CFG, tokens, valid, drafter_params=target, gen_length=G,
        drafter_cfg=CFG.replace(mask_token_id=None), drafter="d2f")
  with pytest.raises(ValueError, match="mask_token_id"):
    selfspec.selfspec_generate(target, CFG.replace(mask_token_id=None), tokens, valid,
                               gen_length=G)
