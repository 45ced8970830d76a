"""Model semantics: attention patterns by gradient, cache equivalence, padding, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.models import Transformer, forward, get_preset, init_cache, init_params
from dllm_jax.models import kv_cache, masks

CFG = get_preset("tiny")
T = 12


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(1), (2, T), 4, CFG.vocab_size)


@jax.jit
def _apply_jit(params, tokens, ids, kw):
  return Transformer(CFG).apply({"params": params}, tokens, block_ids=ids, **kw)


def _apply(params, tokens, ids, **kw):
  """Jitted apply (one compile instead of hundreds of eager ops)."""
  return _apply_jit(params, tokens, ids, kw)


_forward = jax.jit(forward, static_argnames=("cfg", "attention", "prompt_len", "block_size"))


@jax.jit
def _jacobian_jit(params, tokens, ids):
  """[T, T, D] (one module-level jit: the mask tests with [T] block ids share one compile)."""
  embeds = params["embed"]["embedding"][tokens]

  def f(x_row0):
    x = embeds.at[0].set(x_row0)
    logits = Transformer(CFG).apply({"params": params}, tokens, block_ids=ids,
                                    input_embeddings=x)
    return logits[0].sum(-1)

  return jax.jacrev(f)(embeds[0])


def _jacobian(params, tokens, ids):
  """[T, T]: |d logits[0, t] / d input_embedding[0, s]| summed over features and vocab."""
  return np.abs(np.asarray(_jacobian_jit(params, tokens, jnp.asarray(ids, jnp.int32)))).sum(-1)


def test_causal_mask_by_gradient(params, tokens):
  pos = jnp.broadcast_to(jnp.arange(T), (2, T))
  dep = _jacobian(params, tokens, masks.causal_ids(pos))
  upper = np.triu(np.ones((T, T), bool), k=1)
  assert np.all(dep[upper] == 0.0)
  assert np.all(dep[~upper] > 0.0)


def test_block_causal_mask_by_gradient(params, tokens):
  prompt, k = 4, 3
  ids = masks.block_causal_ids(T, prompt, k)
  dep = _jacobian(params, tokens, ids)
  ids = np.asarray(ids)
  visible = ids[None, :] <= ids[:, None]
  assert np.all(dep[~visible] == 0.0), "a token sees a later block"
  assert np.all(dep[visible] > 0.0), "a token misses its own or an earlier block"
  # Inside a block, an earlier token does depend on a later one (bidirectional within).
  assert dep[prompt, prompt + 2] > 0.0
  # The prompt sees only the prompt.
  assert np.all(dep[:prompt, prompt:] == 0.0)


def test_bidirectional_sees_everything(params, tokens):
  dep = _jacobian(params, tokens, jnp.zeros((T,), jnp.int32))
  assert np.all(dep > 0.0)


def test_forward_kinds_agree_with_ids(params, tokens):
  a = _forward(params, CFG, tokens, attention="block_causal", prompt_len=4, block_size=3)
  b = _apply(params, tokens, masks.block_causal_ids(T, 4, 3))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="attention kind"):
    forward(params, CFG, tokens, attention="sliding")


def test_prefill_then_decode_equals_full_causal(params, tokens):
  full = _forward(params, CFG, tokens, attention="causal")
  cache = init_cache(CFG, 2, 16)
  prompt = 5
  pos = jnp.broadcast_to(jnp.arange(prompt), (2, prompt))
  logits, cache = _apply(params, tokens[:, :prompt], masks.causal_ids(pos), cache=cache)
  outs = [logits]
  for t in range(prompt, T):
    pos = jnp.full((2, 1), t, jnp.int32)
    logits, cache = _apply(params, tokens[:, t:t + 1], pos, positions=pos, cache=cache)
    outs.append(logits)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(cache.length, [T, T])


def test_block_causal_chunks_with_cache_equal_full_forward(params, tokens):
  prompt, k = 4, 4
  full = _forward(params, CFG, tokens, attention="block_causal", prompt_len=prompt, block_size=k)
  ids = masks.block_causal_ids(T, prompt, k)
  cache = init_cache(CFG, 2, T)
  outs = []
  for start, stop in [(0, prompt), (prompt, prompt + k), (prompt + k, T)]:
    logits, cache = _apply(params, tokens[:, start:stop], ids[start:stop], cache=cache)
    outs.append(logits)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5, rtol=0)


def test_chunk_writes_only_first_n(params, tokens):
  """A chunk of two blocks writes only block 1; rerunning block 2 then matches."""
  prompt, k = 4, 4
  full = _forward(params, CFG, tokens, attention="block_causal", prompt_len=prompt, block_size=k)
  ids = masks.block_causal_ids(T, prompt, k)
  cache = init_cache(CFG, 2, T)
  _, cache = _apply(params, tokens[:, :prompt], ids[:prompt], cache=cache)
  both, cache = _apply(params, tokens[:, prompt:], ids[prompt:], cache=cache,
                       write_len=jnp.array([k, k]))
  np.testing.assert_allclose(both, full[:, prompt:], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(cache.length, [prompt + k] * 2)
  assert np.all(np.asarray(cache.block_ids)[:, prompt + k:] == masks.NO_KEY)
  last, _ = _apply(params, tokens[:, prompt + k:], ids[prompt + k:], cache=cache, write_len=0)
  np.testing.assert_allclose(last, full[:, prompt + k:], atol=1e-5, rtol=0)


def test_rows_advance_independently(params, tokens):
  """Per-row write lengths: row 0 caches more than row 1; each row matches its own run."""
  cache = init_cache(CFG, 2, T)
  ids = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))  # causal: prefixes agree
  _, cache = _apply(params, tokens[:, :6], ids, cache=cache, write_len=jnp.array([6, 3]))
  np.testing.assert_array_equal(cache.length, [6, 3])
  for row, n in [(0, 6), (1, 3)]:
    single = init_cache(CFG, 1, T)
    _, single = _apply(params, tokens[row:row + 1, :n], ids[:1, :n], cache=single)
    np.testing.assert_allclose(cache.k[:, row, :n], single.k[:, 0, :n], atol=1e-6)


@pytest.mark.parametrize("kind", ["causal", "bidirectional", "block_causal"])
def test_left_padded_rows_equal_single_prompts(params, kind):
  rng = np.random.default_rng(0)
  lens, width = [7, 4, 9], 9
  rows = [rng.integers(4, CFG.vocab_size, n) for n in lens]
  toks = np.zeros((3, width), np.int32)
  valid = np.zeros((3, width), bool)
  for i, r in enumerate(rows):
    toks[i, width - len(r):] = r
    valid[i, width - len(r):] = True
  opts = dict(prompt_len=width - 3, block_size=2) if kind == "block_causal" else {}
  batched = _forward(params, CFG, jnp.asarray(toks), attention=kind, valid=jnp.asarray(valid),
                    **opts)
  for i, r in enumerate(rows):
    n = len(r)
    single_opts = dict(prompt_len=n - 3, block_size=2) if kind == "block_causal" else {}
    single = _forward(params, CFG, jnp.asarray(r[None], jnp.int32), attention=kind,
                     **single_opts)
    np.testing.assert_allclose(batched[i, width - n:], single[0], atol=1e-5, rtol=0)


def test_bfloat16_compute_is_close(params, tokens):
  cfg16 = CFG.replace(dtype="bfloat16")
  ref = _forward(params, CFG, tokens, attention="causal")
  out = _forward(params, cfg16, tokens, attention="causal")
  assert out.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(out - ref))) < 0.05


def test_lora_zero_init_keeps_base_logits(params, tokens):
  cfg = CFG.replace(lora_rank=4, lora_alpha=8.0)
  lp = init_params(cfg, jax.random.key(0))
  assert lp["layers"]["attn"]["q"]["lora_a"].shape == (CFG.n_layers, CFG.d_model, 4)
  base = {k: v for k, v in lp.items()}
  # attention named as in the other tests: one jit cache entry for the causal forward
  ref = _forward(jax.tree.map(lambda x: x, _strip_lora(lp)), CFG, tokens, attention="causal")
  np.testing.assert_allclose(_forward(lp, cfg, tokens), ref, atol=1e-6)
  del base


def _strip_lora(tree):
  if isinstance(tree, dict):
    return {k: _strip_lora(v) for k, v in tree.items() if not k.startswith("lora_")}
  return tree


def test_scan_and_unrolled_and_remat_agree(params, tokens):
  ref = _forward(params, CFG, tokens, attention="causal")
  for cfg in (CFG.replace(scan_layers=False), CFG.replace(remat_policy="full")):
    np.testing.assert_allclose(_forward(params, cfg, tokens), ref, atol=1e-6)
  grad = jax.jit(jax.grad(lambda p: _forward(p, CFG.replace(remat_policy="dots"), tokens).sum()))(params)
  grad_ref = jax.jit(jax.grad(lambda p: _forward(p, CFG, tokens).sum()))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grad, grad_ref)


def test_presets_build_abstractly():
  from dllm_jax.models import abstract_params, PRESETS
  import flax.linen as nn
  for name, cfg in PRESETS.items():
    tree = nn.unbox(abstract_params(cfg))
    count = sum(x.size for x in jax.tree.leaves(tree))
    assert count == cfg.num_params(), name
  assert abs(PRESETS["llada_8b"].num_params() / 1e9 - 8.0) < 0.1


class TestBadInput:

  def test_sequence_longer_than_window(self, params):
    toks = jnp.zeros((1, CFG.max_seq_len + 1), jnp.int32)
    with pytest.raises(ValueError, match="max_seq_len"):
      forward(params, CFG, toks)

  def test_cache_overflow(self, params, tokens):
    cache = init_cache(CFG, 2, 8)
    _, cache = _apply(params, tokens[:, :6], jnp.zeros((6,), jnp.int32), cache=cache)
    with pytest.raises(ValueError, match="cache overflow"):
      Transformer(CFG).apply({"params": params}, tokens[:, :4],  # eager: lengths are concrete
                            block_ids=jnp.zeros((4,), jnp.int32), cache=cache)
    with pytest.raises(ValueError, match="capacity"):
      init_cache(CFG, 2, CFG.max_seq_len + 1)

  def test_wrong_dtypes(self, params, tokens):
    with pytest.raises(ValueError, match="integer ids"):
      forward(params, CFG, tokens.astype(jnp.float32))
    with pytest.raises(ValueError, match="dtype"):
      CFG.replace(dtype="float8")
    cache = init_cache(CFG, 2, 16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="cache dtype"):
      _apply(params, tokens, jnp.zeros((T,), jnp.int32), cache=cache)

  def test_config_errors(self):
    with pytest.raises(ValueError, match="Unknown ModelConfig field"):
      CFG.replace(d_modle=3)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
      CFG.replace(n_kv_heads=3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
      CFG.replace(mask_token_id=CFG.vocab_size)
    with pytest.raises(ValueError, match="Unknown model preset"):
      get_preset("llada8b")


def test_cache_truncate_hides_slots(params, tokens):
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  cache = init_cache(CFG, 2, T)
  _, cache = _apply(params, tokens, pos, cache=cache)
  short = kv_cache.truncate(cache, jnp.array([5, 5]))
  fresh = init_cache(CFG, 2, T)
  _, fresh = _apply(params, tokens[:, :5], pos[:, :5], cache=fresh)
  q, qpos = tokens[:, 5:7], pos[:, 5:7]
  a = _apply(params, q, qpos, positions=qpos, cache=short, write_len=0)[0]
  b = _apply(params, q, qpos, positions=qpos, cache=fresh, write_len=0)[0]
  np.testing.assert_allclose(a, b, atol=1e-6)


# ----------------------------------------------------------------------------- active vocab

def _favour_padded_ids(params, n):
  """lm_head columns >= n scaled up, so an unbounded model prefers the padded ids."""
  head = params["lm_head"]["kernel"]
  return {**params, "lm_head": {"kernel": head.at[:, n:].multiply(50.0)}}


def test_active_vocab_size_floors_padded_logits_only(params, tokens):
  n = 40
  bounded = CFG.replace(active_vocab_size=n)
  want = forward(params, CFG, tokens, attention="bidirectional")
  got = forward(params, bounded, tokens, attention="bidirectional")
  np.testing.assert_array_equal(got[..., :n], want[..., :n])
  assert bool(jnp.all(got[..., n:] == -1e9))
  # A teacher that gives the padded ids zero probability keeps the distillation loss finite.
  from dllm_jax.diffusion import losses
  assert bool(jnp.all(jnp.isfinite(losses.soft_ce(got, got))))
  assert bool(jnp.all(jax.nn.softmax(got)[..., n:] == 0.0))


def test_active_vocab_size_bounds_every_decoder(params):
  from dllm_jax import decoding
  n = 40
  strong = _favour_padded_ids(params, n)
  prompts = [[1, 5, 6, 7], [1, 9]]
  for method, opts in (("ar", {}), ("llada", {"steps": 8}),
                       ("fast_dllm", {"block_length": 4, "threshold": 0.9}),
                       ("d2f", {"block_length": 4})):
    free = decoding.generate(strong, CFG, prompts, method=method, gen_length=8, **opts)
    assert int(jnp.max(free.tokens)) >= n, method  # the test model does reach for them
    out = decoding.generate(strong, CFG.replace(active_vocab_size=n), prompts, method=method,
                            gen_length=8, **opts)
    assert int(jnp.max(out.tokens)) < n, method


@pytest.mark.parametrize("kw,match", [
    (dict(active_vocab_size=0), "active_vocab_size"),
    (dict(active_vocab_size=CFG.vocab_size + 1), "active_vocab_size"),
    (dict(active_vocab_size=CFG.eos_token_id), "could never stop"),
])
def test_active_vocab_size_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    CFG.replace(**kw)


def test_init_params_on_a_mesh_equals_the_plain_init(params):
  """One device: the jitted, sharded init gives the eager init's values (to float32 rounding:
  jit fuses the init's scaling), each leaf placed as `param_shardings` says (the 8-device
  case is in test_parallel_sharding.py)."""
  from dllm_jax.models import abstract_params
  from dllm_jax.parallel import make_mesh, mesh as mesh_lib
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  want = mesh_lib.param_shardings(abstract_params(CFG), mesh)
  sharded = init_params(CFG, jax.random.key(0), mesh=mesh)
  for x, ref, sharding in zip(jax.tree.leaves(sharded), jax.tree.leaves(params),
                              jax.tree.leaves(want)):
    assert x.sharding.is_equivalent_to(sharding, x.ndim)
    np.testing.assert_allclose(np.asarray(x), np.asarray(ref), rtol=1e-6, atol=0)


def test_visibility_with_branches_restates_the_rule():
  """masks.visibility against a loop over (query, key): id rule, NO_KEY, and a branch b > 0
  key seen only by its own branch's queries."""
  rng = np.random.default_rng(0)
  q_ids, k_ids = rng.integers(0, 6, (2, 7)), rng.integers(0, 6, (2, 9))
  k_ids[:, 3] = masks.NO_KEY
  q_br, k_br = rng.integers(0, 3, (2, 7)), rng.integers(0, 3, (2, 9))
  got = np.asarray(masks.visibility(jnp.asarray(q_ids), jnp.asarray(k_ids), jnp.asarray(q_br),
                                    jnp.asarray(k_br)))
  for b in range(2):
    for t in range(7):
      for s in range(9):
        want = (k_ids[b, s] != masks.NO_KEY and k_ids[b, s] <= q_ids[b, t]
                and (k_br[b, s] == 0 or k_br[b, s] == q_br[b, t]))
        assert got[b, t, s] == want, (b, t, s)
  np.testing.assert_array_equal(masks.visibility(jnp.asarray(q_ids), jnp.asarray(k_ids)),
                                got | ~got & (k_br[:, None, :] != 0) & (
                                    k_ids[:, None, :] <= q_ids[:, :, None]) & (
                                    k_ids[:, None, :] != masks.NO_KEY))


def test_sibling_branches_equal_separate_forwards(params, tokens):
  """A cached causal prefix, then one chunk of a trunk (causal) and two sibling blocks on
  branches 1 and 2, each seeing the prefix up to its own point and itself: every block's
  logits equal a forward of that block alone after its prefix; the trunk's equal the trunk
  alone; only the trunk is written to the cache."""
  prefix, trunk, block = 4, 3, 3
  cache = init_cache(CFG, 2, T + 8)
  pos = jnp.broadcast_to(jnp.arange(prefix), (2, prefix))
  _, cache = _apply(params, tokens[:, :prefix], masks.causal_ids(pos), cache=cache)
  trunk_tok = tokens[:, prefix:prefix + trunk]
  blocks = [tokens[:, 8:8 + block], tokens[:, 9:9 + block]]
  # Block j sees the prefix and the first j trunk tokens: it sits at positions after them.
  starts = [prefix + 1, prefix + 2]
  trunk_pos = prefix + jnp.arange(trunk)
  chunk = jnp.concatenate([trunk_tok] + blocks, 1)
  positions = jnp.concatenate([trunk_pos] + [s + jnp.arange(block) for s in starts])
  ids = jnp.concatenate([trunk_pos] + [jnp.full((block,), s - 1) for s in starts])
  branch = jnp.repeat(jnp.arange(3), jnp.array([trunk, block, block]),
                      total_repeat_length=trunk + 2 * block)
  both, written = _apply(params, chunk, jnp.broadcast_to(ids, (2, ids.size)),
                         positions=jnp.broadcast_to(positions, (2, ids.size)), cache=cache,
                         branch_ids=branch, write_len=trunk)
  alone_trunk, _ = _apply(params, trunk_tok, jnp.broadcast_to(trunk_pos, (2, trunk)),
                          positions=jnp.broadcast_to(trunk_pos, (2, trunk)), cache=cache)
  np.testing.assert_allclose(both[:, :trunk], alone_trunk, atol=1e-5, rtol=0)
  for j, (s, blk) in enumerate(zip(starts, blocks)):
    seen = s - prefix  # trunk tokens block j sees: cached first, then the block alone
    pos_j = jnp.broadcast_to(trunk_pos[:seen], (2, seen))
    _, cache_j = _apply(params, trunk_tok[:, :seen], pos_j, positions=pos_j, cache=cache)
    blk_pos = jnp.broadcast_to(s + jnp.arange(block), (2, block))
    alone, _ = _apply(params, blk, jnp.full((2, block), s - 1), positions=blk_pos,
                      cache=cache_j)
    got = both[:, trunk + j * block:trunk + (j + 1) * block]
    np.testing.assert_allclose(got, alone, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(written.length, [prefix + trunk] * 2)
