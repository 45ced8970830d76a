"""Objectives end to end on the tiny model, against NumPy re-statements of the references."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dllm_jax.diffusion import corruption, layout
from dllm_jax.diffusion.objectives import make_objective
from dllm_jax.models import abstract_params, forward, get_preset, lora

CFG = get_preset("tiny")
B, L, P, K = 3, 16, 4, 4
# The tests compile more than they run: skip XLA's backend optimisations (halves compiles).
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
# One compiled reference forward per (cfg, attention kind), shared by the tests.
ref_forward = fast_jit(forward, static_argnums=1,
                       static_argnames=("attention", "prompt_len", "block_size"))


def np_ce(logits, targets):
  x = np.asarray(logits, np.float64)
  m = x.max(-1, keepdims=True)
  logp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
  return -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]


def make_batch(sft=True, seed=0, b=B, length=L):
  rs = np.random.RandomState(seed)
  tokens = rs.randint(4, CFG.vocab_size, (b, length)).astype(np.int32)
  valid = np.ones((b, length), bool)
  if sft:
    for r in range(b):
      valid[r, :r] = False  # left padding of the prompt
    tokens[0, -3:] = CFG.eos_token_id  # EOS padding after the answer (trained in SFT)
    prompt = np.zeros((b, length), bool)
    prompt[:, :P] = True
    prompt &= valid
  else:
    prompt = np.zeros((b, length), bool)
  positions = np.maximum(np.cumsum(valid, 1) - 1, 0).astype(np.int32)
  return dict(tokens=tokens, valid=valid, prompt_mask=prompt, loss_mask=valid & ~prompt,
              positions=positions)


def random_params(cfg, seed=0, scale=0.1):
  """Random weights of the right shapes without compiling an init (norm scales 1)."""
  rs = np.random.RandomState(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.ones(x.shape, x.dtype) if "norm" in jax.tree_util.keystr(path)
      else jnp.asarray(rs.randn(*x.shape) * scale, x.dtype), nn.unbox(abstract_params(cfg)))


@pytest.fixture(scope="module")
def params():
  return random_params(CFG)


@pytest.fixture(scope="module")
def lora_student(params):
  """A LoRA student whose adapters are nonzero (so it differs from its teacher)."""
  cfg, lp = lora.add_lora(params, CFG, jax.random.key(1), rank=4, alpha=4.0)
  base, adapters = lora.split_lora(lp)
  adapters = jax.tree.map(lambda x: x + 0.1, adapters)
  return cfg, lora.merge_trees(base, adapters)


def run(name, cfg=CFG, **options):
  return fast_jit(make_objective(name, cfg, **options))


def test_ar_loss_is_next_token_ce(params):
  batch = make_batch(sft=True)
  loss, metrics = run("ar")(params, batch, jax.random.key(1))
  logits = np.asarray(ref_forward(params, CFG, batch["tokens"], attention="causal",
                                  positions=batch["positions"], valid=batch["valid"]))
  terms = [np_ce(logits[r, i], batch["tokens"][r, i + 1])
           for r in range(B) for i in range(L - 1)
           if batch["loss_mask"][r, i + 1] and batch["valid"][r, i]]
  assert metrics["num_tokens"] == len(terms) == batch["loss_mask"].sum()
  np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-5)
  # Dream's shift_logits moves prediction i - 1 -> i inside the model; the AR loss is unchanged.
  shifted, _ = run("ar", CFG.replace(shift_logits=True))(params, batch, jax.random.key(1))
  np.testing.assert_allclose(float(shifted), float(loss), rtol=1e-6)


def test_mdm_sft_loss_is_llada_elbo(params):
  """Same corruption replayed; loss re-stated as in LLaDA's GUIDELINES.md (SFT)."""
  batch, eps, rng = make_batch(sft=True, seed=2), 1e-3, jax.random.key(5)
  loss, metrics = run("mdm", sft=True)(params, batch, rng)

  @fast_jit
  def replay(rng):
    k_t, k_mask, _ = jax.random.split(rng, 3)
    t = corruption.sample_times(k_t, (B,), t_min=eps)
    maskable = corruption.trainable_positions(batch, sft=True)
    x_t, masked = corruption.mask_bernoulli(k_mask, jnp.asarray(batch["tokens"]), maskable,
                                            t[:, None], CFG.mask_token_id)
    return corruption.uniform(k_t, (B,)), x_t, masked, maskable

  u, x_t, masked, maskable = (np.asarray(a) for a in replay(rng))
  assert masked.any() and not masked[batch["prompt_mask"] | ~batch["valid"]].any()
  assert masked[0, -3:].any()  # EOS padding is noised and trained
  logits = ref_forward(params, CFG, x_t, attention="bidirectional",
                       positions=batch["positions"], valid=batch["valid"])
  p_mask = np.repeat(((1 - eps) * u.astype(np.float64) + eps)[:, None], L, 1)
  token_loss = np_ce(logits, batch["tokens"])[masked] / p_mask[masked]
  answer_lengths = np.repeat(batch["loss_mask"].sum(1, keepdims=True), L, 1)
  want = np.sum(token_loss / answer_lengths[masked]) / B
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["masked_frac"]),
                             masked.sum() / maskable.sum(), rtol=1e-6)


def test_block_diffusion_loss_per_block_times(params):
  batch, eps, rng = make_batch(sft=True, seed=3), 1e-3, jax.random.key(6)
  loss, _ = run("block_diffusion", block_size=K, sft=True)(params, batch, rng)

  @fast_jit
  def replay(rng):
    k_t, k_mask, _ = jax.random.split(rng, 3)
    t_blocks = corruption.sample_times(k_t, (B, layout.num_blocks(L, K)), t_min=eps)
    blk = layout.block_index(batch, K)
    t_tok = jnp.where(blk >= 0, jnp.take_along_axis(t_blocks, jnp.maximum(blk, 0), 1), 1.0)
    maskable = corruption.trainable_positions(batch, sft=True)
    x_t, masked = corruption.mask_bernoulli(k_mask, jnp.asarray(batch["tokens"]), maskable,
                                            t_tok, CFG.mask_token_id)
    return blk, t_blocks, x_t, masked

  blk, t_blocks, x_t, masked = (np.asarray(a) for a in replay(rng))
  assert np.array_equal(blk[:, :P], np.full((B, P), -1)) and blk[:, P:].min() == 0
  t_tok = np.where(blk >= 0, np.take_along_axis(t_blocks.astype(np.float64),
                                                np.maximum(blk, 0), 1), 1.0)
  logits = ref_forward(params, CFG, x_t, attention="block_causal", prompt_len=P, block_size=K,
                       positions=batch["positions"], valid=batch["valid"])
  token_loss = np_ce(logits, batch["tokens"])[masked] / t_tok[masked]
  want = np.sum(token_loss / batch["loss_mask"].sum(1)[np.nonzero(masked)[0]]) / B
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_d2f_loss_matches_reference(params, lora_student):
  """Teacher = adapters off, bidirectional; student = LoRA, block-causal; same noisy input."""
  cfg, student = lora_student
  batch, rng = make_batch(sft=True, seed=4), jax.random.key(7)
  loss, metrics = run("d2f", cfg, block_size=K)(student, batch, rng)
  replay = fast_jit(lambda rng: corruption.d2f_corrupt(jax.random.split(rng)[0], batch, K,
                                                       CFG.mask_token_id))
  x_t, masked, ratio, ratios = (np.asarray(a) for a in replay(rng))
  ratio = ratio.astype(np.float64)
  assert masked.any() and not masked[batch["prompt_mask"] | ~batch["valid"]].any()
  t_logits = np.asarray(ref_forward(params, CFG, x_t, attention="bidirectional",
                                    positions=batch["positions"], valid=batch["valid"]),
                        np.float64)
  s_logits = np.asarray(ref_forward(student, cfg, x_t, attention="block_causal", prompt_len=P,
                                    block_size=K, positions=batch["positions"],
                                    valid=batch["valid"]), np.float64)
  log_t = t_logits - np.log(np.exp(t_logits).sum(-1, keepdims=True))
  log_s = s_logits - np.log(np.exp(s_logits).sum(-1, keepdims=True))
  ce = -(np.exp(log_t) * log_s).sum(-1)
  kl = (np.exp(log_t) * (log_t - log_s)).sum(-1)
  np.testing.assert_allclose(float(loss), (ce[masked] / ratio[masked]).mean(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["kl"]), kl[masked].mean(), rtol=1e-4)
  assert float(metrics["kl"]) > 1e-3  # the adapters make the student differ
  np.testing.assert_allclose(float(metrics["ratio_first_block"]), np.mean(ratios[:, 0]),
                             rtol=1e-6)


def test_d2f_student_attention_by_perturbation(lora_student):
  """Student logits of block b change with tokens of blocks c <= b only; prompt sees prompt."""
  cfg, student = lora_student
  batch = make_batch(sft=True, seed=5)

  def logits(tok):
    return np.asarray(ref_forward(student, cfg, jnp.asarray(tok), attention="block_causal",
                                  prompt_len=P, block_size=K, positions=batch["positions"],
                                  valid=batch["valid"]))

  base = logits(batch["tokens"])
  n_blocks = (L - P) // K
  for c in range(n_blocks):
    tok = batch["tokens"].copy()
    sl_c = slice(P + c * K, P + (c + 1) * K)
    tok[:, sl_c] = (tok[:, sl_c] + 7) % 60 + 4
    out = logits(tok)
    np.testing.assert_array_equal(out[:, :P], base[:, :P])
    for b in range(n_blocks):
      sl = slice(P + b * K, P + (b + 1) * K)
      changed = np.abs(out[:, sl] - base[:, sl]).max() > 1e-6
      assert changed == (c <= b), (b, c)


def motif_batch(b=8, length=16, seed=7):
  """Each row repeats its own 2-token motif: learnable in a few dozen steps."""
  rs = np.random.RandomState(seed)
  motifs = rs.randint(4, CFG.vocab_size, (b, 2))
  tokens = np.tile(motifs, (1, length // 2)).astype(np.int32)
  ones = np.ones((b, length), bool)
  return dict(tokens=tokens, valid=ones, prompt_mask=~ones, loss_mask=ones,
              positions=np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)))


@pytest.mark.parametrize("name", ["ar", "mdm"])
def test_a_few_adam_steps_learn(params, name):
  """40 Adam steps; the last 8 losses (on the first 8 noise keys again) fall below 60%."""
  batch, objective, opt = motif_batch(), make_objective(name, CFG), optax.adam(1e-2)

  @fast_jit
  def step(p, state, key):
    loss, grads = jax.value_and_grad(lambda q: objective(q, batch, key)[0])(p)
    updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, loss

  p, state, history = params, opt.init(params), []
  for i in range(40):
    p, state, loss = step(p, state, jax.random.key(i % 8))
    history.append(float(loss))
  assert np.mean(history[-8:]) < 0.6 * np.mean(history[:8]), history


def test_make_objective_errors(params):
  with pytest.raises(ValueError, match="available"):
    make_objective("diffusion", CFG)
  with pytest.raises(ValueError, match="does not take.*block_size"):
    make_objective("mdm", CFG, block_size=4)
  with pytest.raises(ValueError, match="needs option.*block_size"):
    make_objective("block_diffusion", CFG)
  with pytest.raises(ValueError, match="teacher_params"):
    make_objective("d2f", CFG)
  with pytest.raises(ValueError, match="noise schedule"):
    make_objective("mdm", CFG, schedule="sigmoid")
  with pytest.raises(ValueError, match="eps"):
    make_objective("mdm", CFG, eps=0.0)
  with pytest.raises(ValueError, match="mask_token_id"):
    make_objective("mdm", CFG.replace(mask_token_id=None))
  with pytest.raises(ValueError, match="block_size"):
    make_objective("d2f", CFG, teacher_params=params, block_size=0)
  with pytest.raises(ValueError, match="first_low"):
    make_objective("d2f", CFG, teacher_params=params, first_low=0.9)
  with pytest.raises(ValueError, match="missing key"):
    make_objective("ar", CFG)(params, {"tokens": np.zeros((1, 4), np.int32)}, jax.random.key(0))
  with pytest.raises(ValueError, match="dtype"):
    make_objective("ar", CFG)(params, dict(make_batch(), valid=np.ones((B, L), np.int32)),
                              jax.random.key(0))


def test_selfspec_loss_is_ar_plus_a_truncated_prefix_block(params):
  """The draft term equals, per row, a forward of only the clean prefix before the cut plus
  K masks (hiding the suffix as padding changes nothing), and draft_weight=0 is ar_loss."""
  from dllm_jax.models.transformer import Transformer
  batch = make_batch(sft=True)
  rng = jax.random.key(3)
  loss, metrics = make_objective("selfspec", CFG, block_size=K)(params, batch, rng)
  ar, _ = make_objective("ar", CFG)(params, batch, rng)
  ar_only, _ = make_objective("selfspec", CFG, block_size=K, draft_weight=0.0)(params, batch,
                                                                            rng)
  np.testing.assert_allclose(float(ar_only), float(ar), rtol=1e-6)
  np.testing.assert_allclose(float(metrics["ar_ce"]), float(ar), rtol=1e-6)

  u = np.asarray(jax.random.uniform(jax.random.split(rng, 3)[1], (B,)))
  ces, hits = [], []
  for r in range(B):
    valid = batch["valid"][r]
    lo = max(P, int(np.argmax(valid)) + 1)           # the answer starts at P in make_batch
    cut = min(lo + int(np.floor(u[r] * (L - lo))), L - 1)
    keep = np.arange(L)[valid & (np.arange(L) < cut)]
    pos = batch["positions"][r]
    tokens = np.concatenate([batch["tokens"][r, keep], np.full(K, CFG.mask_token_id)])
    positions = np.concatenate([pos[keep], pos[cut - 1] + 1 + np.arange(K)])
    ids = np.concatenate([pos[keep], np.full(K, 10_000)])
    logits = Transformer(CFG).apply({"params": params}, jnp.asarray(tokens[None], jnp.int32),
                                    block_ids=jnp.asarray(ids[None], jnp.int32),
                                    positions=jnp.asarray(positions[None], jnp.int32))
    block = np.asarray(logits[0, len(keep):])
    for i in range(K):
      j = cut + i
      if j < L and batch["loss_mask"][r, j] and valid[j]:
        ces.append(np_ce(block[i], batch["tokens"][r, j]))
        hits.append(float(np.argmax(block[i]) == batch["tokens"][r, j]))
  assert ces, "the cut left no trained block slot"
  np.testing.assert_allclose(float(metrics["draft_ce"]), np.mean(ces), rtol=2e-5)
  np.testing.assert_allclose(float(metrics["draft_accuracy"]), np.mean(hits), rtol=1e-6)
  np.testing.assert_allclose(float(loss), float(ar) + np.mean(ces), rtol=2e-5)
  assert int(metrics["draft_tokens"]) == len(ces)


def test_selfspec_objective_errors():
  with pytest.raises(ValueError, match="shift_logits"):
    make_objective("selfspec", CFG.replace(shift_logits=True))
  with pytest.raises(ValueError, match="draft_weight"):
    make_objective("selfspec", CFG, draft_weight=-1.0)
  with pytest.raises(ValueError, match="mask_token_id"):
    make_objective("selfspec", CFG.replace(mask_token_id=None))
  with pytest.raises(ValueError, match="block_size"):
    make_objective("selfspec", CFG, block_size=0)
