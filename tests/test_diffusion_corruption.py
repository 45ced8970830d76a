"""Forward process: time sampling, masking, D2F's monotone block ratios, the answer layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.diffusion import corruption, layout
from dllm_jax.models import masks

MASK_ID = 3
# Tiny programs: compile them without XLA's backend optimisations (compiling dominates).
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def sft_batch(b=3, length=21, prompt=5, seed=0):
  """Prompts left-padded to `prompt`; row r has r padding slots; answers fill the rest."""
  rs = np.random.RandomState(seed)
  tokens = rs.randint(4, 60, (b, length)).astype(np.int32)
  valid = np.ones((b, length), bool)
  for r in range(b):
    valid[r, :min(r, prompt - 1)] = False
  prompt_mask = np.zeros((b, length), bool)
  prompt_mask[:, :prompt] = True
  prompt_mask &= valid
  positions = np.maximum(np.cumsum(valid, 1) - 1, 0).astype(np.int32)
  return dict(tokens=tokens, valid=valid, prompt_mask=prompt_mask,
              loss_mask=valid & ~prompt_mask, positions=positions)


def test_uniform_antithetic_is_stratified():
  u, t = fast_jit(lambda k: (corruption.uniform(k, (4, 8), antithetic=True),
                             corruption.sample_times(k, (1000,), t_min=0.25)))(jax.random.key(3))
  u, t = np.sort(np.asarray(u).ravel()), np.asarray(t)
  assert np.all((u >= 0) & (u < 1))
  np.testing.assert_allclose(np.diff(u), 1.0 / 32, atol=1e-6)  # one sample per stratum
  assert t.min() >= 0.25 and t.max() < 1.0
  with pytest.raises(ValueError, match="t_min"):
    corruption.sample_times(jax.random.key(0), (2,), t_min=1.0)


def test_bernoulli_masks_only_maskable_at_rate():
  batch = sft_batch(b=64, length=64)
  maskable = np.asarray(corruption.trainable_positions(batch, sft=True))
  x_t, masked = fast_jit(lambda k: corruption.mask_bernoulli(
      k, jnp.asarray(batch["tokens"]), maskable, 0.3, MASK_ID))(jax.random.key(0))
  x_t, masked = np.asarray(x_t), np.asarray(masked)
  assert not masked[~maskable].any()
  np.testing.assert_array_equal(x_t, np.where(masked, MASK_ID, batch["tokens"]))
  assert abs(masked.sum() / maskable.sum() - 0.3) < 0.02


def test_layout_matches_fixed_prompt_canvas():
  batch = sft_batch(b=3, length=21, prompt=5)
  k = 4
  # Pretraining text (no prompt): blocks start at the first valid token.
  text = dict(batch, prompt_mask=np.zeros_like(batch["valid"]))
  start, ids, n_blocks, ref_ids, text_start, text_blk = (np.asarray(a) for a in fast_jit(
      lambda bt, tx: (layout.answer_start(bt), layout.block_causal_ids(bt, k),
                      layout.row_num_blocks(bt, k), masks.block_causal_ids(21, 5, k),
                      layout.answer_start(tx), layout.block_index(tx, k)))(batch, text))
  np.testing.assert_array_equal(start, [5, 5, 5])
  np.testing.assert_array_equal(ids, np.broadcast_to(ref_ids, ids.shape))
  np.testing.assert_array_equal(n_blocks, [4, 4, 4])
  np.testing.assert_array_equal(text_start, [0, 1, 2])
  np.testing.assert_array_equal(text_blk[2, :7], [-1, -1, 0, 0, 0, 0, 1])


def test_d2f_student_visibility_is_reference_layout():
  """Prompt sees only the prompt; block b sees the prompt, blocks < b and itself."""
  batch = sft_batch(b=2, length=15, prompt=3)
  k, p, length = 4, 3, 15
  def visible(bt):
    ids = layout.block_causal_ids(bt, k)
    return masks.visibility(ids, masks.key_ids(ids, bt["valid"]))

  vis = np.asarray(fast_jit(visible)(batch))
  expected = np.zeros((length, length), bool)
  expected[:, :p] = True  # everyone sees the prompt
  for q in range(p, length):
    expected[q, p:p + ((q - p) // k + 1) * k] = True
  for r in range(2):
    np.testing.assert_array_equal(vis[r], expected & batch["valid"][r][None, :])


def test_d2f_ratios_monotone_and_bounded_over_many_seeds():
  n_rows, n_max = 4096, 9
  row_blocks = jnp.asarray(np.random.RandomState(0).randint(1, n_max + 1, n_rows))
  ratios = fast_jit(corruption.d2f_block_ratios, static_argnums=2,
                    static_argnames=("first_low", "first_high", "max_ratio"))
  for seed in range(3):
    r = np.asarray(ratios(jax.random.key(seed), row_blocks, n_max))
    assert r.shape == (n_rows, n_max)
    assert np.all(np.diff(r, axis=1) >= 0)
    assert r.min() >= 0.2 and r.max() <= 0.7 + 1e-7
    assert r[:, 0].max() < 0.7
    assert abs(r[:, 0].mean() - 0.45) < 0.01  # U[0.2, 0.7)
    nb = np.asarray(row_blocks)
    step = (0.7 - r[:, :1]) / np.maximum(nb[:, None] - 1, 1)
    assert np.all(np.diff(r, axis=1) < step + 1e-6)
    last = r[np.arange(n_rows), nb - 1]  # the answer's last block stays under the cap
    assert np.all(last <= 0.7 + 1e-7)
  custom = np.asarray(ratios(jax.random.key(9), row_blocks, n_max, first_low=0.1,
                             first_high=0.3, max_ratio=0.9))
  assert custom[:, 0].min() >= 0.1 and custom[:, 0].max() < 0.3 and custom.max() <= 0.9 + 1e-7
  assert np.all(np.diff(custom, axis=1) >= 0)
  with pytest.raises(ValueError, match="first_low"):
    corruption.d2f_block_ratios(jax.random.key(0), row_blocks, n_max, first_low=0.8)


@pytest.mark.parametrize("exact", [False, True])
def test_d2f_corrupt_never_masks_prompt(exact):
  batch = sft_batch(b=4, length=27, prompt=6, seed=1)
  k = 4
  corrupt = fast_jit(lambda key: corruption.d2f_corrupt(key, batch, k, MASK_ID, exact=exact))
  blk = np.asarray(fast_jit(lambda bt: layout.block_index(bt, k))(batch))
  for seed in range(4):
    x_t, masked, token_ratio, ratios = (np.asarray(a) for a in corrupt(jax.random.key(seed)))
    assert not masked[batch["prompt_mask"] | ~batch["valid"]].any()
    np.testing.assert_array_equal(x_t, np.where(masked, MASK_ID, batch["tokens"]))
    for r in range(4):
      for j in range(ratios.shape[1]):
        sel = blk[r] == j
        if not sel.any():
          continue
        np.testing.assert_array_equal(token_ratio[r, sel], ratios[r, j])  # one ratio per block
        if exact:
          assert masked[r, sel].sum() == np.round(ratios[r, j] * sel.sum())
    assert np.all(token_ratio[blk < 0] == 0)


def test_exact_count_masking_counts_only_maskable():
  tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) + 4
  blk = jnp.asarray(np.tile(np.r_[[-1, -1], np.repeat(np.arange(3), 4)[:10]], (2, 1)))
  maskable = (blk >= 0) & (jnp.arange(12)[None, :] != 5)  # one hole in block 0
  ratios = jnp.asarray([[0.5, 0.25, 1.0], [0.0, 0.75, 0.5]])
  _, masked = fast_jit(corruption.mask_exact_per_block, static_argnums=5)(
      jax.random.key(1), tokens, maskable, blk, ratios, MASK_ID)
  masked, blk_np, mk = np.asarray(masked), np.asarray(blk), np.asarray(maskable)
  assert not masked[~mk].any()
  ratios = np.asarray(ratios, np.float64)
  for r in range(2):
    for j in range(3):
      m = (mk[r] & (blk_np[r] == j)).sum()
      assert masked[r, blk_np[r] == j].sum() == np.round(ratios[r, j] * m)


def test_per_block_times_constant_within_block():
  batch = sft_batch(b=3, length=21, prompt=5)
  k = 4
  # Two programs: XLA may recompute t_blocks inside a consumer fusion (1 ulp apart under
  # some CPU emitters), so per_token gets the materialised t_blocks it must copy exactly.
  @fast_jit
  def times(key, bt):
    blk = layout.block_index(bt, k)
    return blk, corruption.sample_times(key, (3, layout.num_blocks(21, k)), t_min=1e-3)

  blk, t_blocks = times(jax.random.key(0), batch)
  t_tok = fast_jit(lambda t, b: corruption.per_token(t, b, fill=1.0))(t_blocks, blk)
  blk, t_blocks, t_tok = np.asarray(blk), np.asarray(t_blocks), np.asarray(t_tok)
  for r in range(3):
    for j in range(blk.max() + 1):
      vals = t_tok[r, blk[r] == j]
      assert vals.size and np.all(vals == vals[0]) and vals[0] == float(t_blocks[r, j])
  assert np.all(t_tok[blk < 0] == 1.0)
