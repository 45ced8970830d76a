"""Task-adaptive decoding against the decoders each of its modes must reproduce.

Forced VERIFY == speculative (d2f drafter) == AR greedy; forced AR == AR greedy; forced
PARALLEL == an uncached block-by-block decode of the drafter (and, at draft_length 1,
`block_diffusion_generate`); a batch mixing modes by task tag (through `generate`, which
pads the batch and the tags) == each row alone; the recorded modes == the rule re-stated in
NumPy on the recorded signals. Every fast test shares one compiled adaptive program per
batch shape: the thresholds and the tags are traced.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding import adaptive, api, ar, d2f, speculative
from dllm_jax.models import masks
from dllm_jax.models.transformer import Transformer
from test_decoding_speculative import CFG, COUNT_PROMPTS, G, K, PROMPTS, batch_of, \
    counting_model, random_params, same_tokens

INF = float("inf")
VERIFY = dict(parallel_confidence=INF, ar_confidence=0.0, min_acceptance=0.0, trust_streak=0)
AR = dict(VERIFY, ar_confidence=2.0)
PARALLEL = dict(VERIFY, parallel_confidence=0.0)
TAGS = {"copy": "parallel", "math": "verify", "short": "ar", "chat": "auto"}


@pytest.fixture(scope="module")
def models():
  return random_params(CFG, 0, 0.3), random_params(CFG, 1, 0.3)


def run(target, drafter, tokens, valid, **kw):
  kw = dict(gen_length=G, draft_length=K, return_stats=True) | kw
  return adaptive.adaptive_generate(target, CFG, tokens, valid, drafter_params=drafter,
                                    drafter_cfg=CFG, **kw)


def live_rounds(out):
  return np.asarray(out.round_modes) >= 0


def test_forced_verify_equals_speculative_and_ar(models):
  target, drafter = models
  tokens, valid = batch_of(PROMPTS)
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  sp, sst = speculative.speculative_generate(target, CFG, tokens, valid, drafter_params=drafter,
                                             drafter_cfg=CFG, drafter="d2f", gen_length=G,
                                             draft_length=K, return_stats=True)
  out, st = run(target, drafter, tokens, valid, **VERIFY)
  same_tokens(out, ref)
  same_tokens(out, sp)
  np.testing.assert_array_equal(np.asarray(out.committed), np.asarray(sp.committed))
  assert int(st.target_forwards) == int(sst.target_forwards)
  assert int(st.drafter_forwards) == int(sst.drafter_forwards) and int(out.nfe) == int(sp.nfe)
  np.testing.assert_array_equal(np.asarray(st.accepted), np.asarray(sst.accepted))
  np.testing.assert_array_equal(live_rounds(out).sum(1), np.asarray(sst.rounds))
  assert np.all(np.asarray(out.round_modes)[live_rounds(out)] == adaptive.VERIFY)
  np.testing.assert_array_equal(np.asarray(out.modes), adaptive.VERIFY)


def test_forced_ar_equals_ar(models):
  target, drafter = models
  tokens, valid = batch_of(PROMPTS)
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  out, st = run(target, drafter, tokens, valid, **AR)
  same_tokens(out, ref)
  rounds = int(out.steps)
  assert np.all(np.asarray(out.round_modes)[live_rounds(out)] == adaptive.AR)
  # Round 0's drafter forward measures c0; afterwards only the target runs, one token each.
  assert int(st.drafter_forwards) == 1 and int(st.target_forwards) == rounds
  np.testing.assert_array_equal(live_rounds(out).sum(1), np.asarray(out.committed))
  # Tagged AR rows need no confidence: no drafter forward at all. A greedy batch tagged AR
  # throughout runs ar_generate's program, with the loop's tokens, rounds and records.
  tagged, tst = run(target, drafter, tokens, valid, task_modes=TAGS, tasks=["short"] * 3)
  same_tokens(tagged, ref)
  assert int(tst.drafter_forwards) == 0 and int(tagged.nfe) == int(tst.target_forwards)
  assert int(tst.target_forwards) == int(st.target_forwards) == int(ref.nfe)
  for field in ("steps", "committed", "done", "finite", "modes", "round_modes"):
    np.testing.assert_array_equal(np.asarray(getattr(tagged, field)),
                                  np.asarray(getattr(out, field)), err_msg=field)
  for field in ("round_accepted", "round_committed", "drafted", "accepted"):
    np.testing.assert_array_equal(np.asarray(getattr(tst, field)),
                                  np.asarray(getattr(st, field)), err_msg=field)
  assert np.all(np.isnan(np.asarray(tst.round_confidence)))


def test_only_a_greedy_all_ar_batch_skips_the_loop(models, monkeypatch):
  """The plain-AR shortcut is greedy only (sampled rows keep the loop's per-row keys) and
  needs every row tagged AR."""
  target, drafter = models
  tokens, valid = batch_of(PROMPTS)
  calls = []
  monkeypatch.setattr(adaptive, "_plain_ar",
                      lambda *a, **k: calls.append(1) or pytest.fail("took the AR shortcut"))
  run(target, drafter, tokens, valid, task_modes=TAGS, tasks=["short"] * 3, temperature=0.8)
  run(target, drafter, tokens, valid, task_modes=TAGS, tasks=["short", "short", "math"])
  assert not calls


def test_a_greedy_all_verify_batch_runs_speculatives_loop(models, monkeypatch):
  """Every row tagged VERIFY, greedy, no stats asked (a prompt router's batch of one): the
  speculative decoder's own loop, with the adaptive loop's tokens, forwards, rounds and
  records. Sampled rows, a row in another mode, or the stats' per-round records keep the
  loop."""
  target, drafter = models
  tokens, valid = batch_of(PROMPTS)
  tokens, valid = tokens[:2], valid[:2]  # a batch shape no other test compiles this way
  kw = dict(task_modes=TAGS, return_stats=False)
  loop, _ = run(target, drafter, tokens, valid, task_modes=TAGS, tasks=["math"] * 2)
  real, calls = adaptive._plain_verify, []
  monkeypatch.setattr(adaptive, "_plain_verify",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  fast = run(target, drafter, tokens, valid, tasks=["math"] * 2, **kw)
  assert calls, "an all-VERIFY greedy batch did not take speculative's loop"
  assert int(fast.nfe) == int(loop.nfe) and int(fast.steps) == int(loop.steps)
  for field in ("tokens", "lengths", "committed", "done", "finite", "modes", "round_modes"):
    np.testing.assert_array_equal(np.asarray(getattr(fast, field)),
                                  np.asarray(getattr(loop, field)), err_msg=field)
  assert np.any(np.asarray(loop.round_modes)[:, 1] == adaptive.VERIFY)  # rounds after round 0
  monkeypatch.setattr(adaptive, "_plain_verify",
                      lambda *a, **k: pytest.fail("took the VERIFY shortcut"))
  run(target, drafter, tokens, valid, tasks=["math"] * 2, temperature=0.8, **kw)
  run(target, drafter, tokens, valid, tasks=["math", "short"], **kw)


def block_reference(params, tokens, valid, k):
  """Uncached PARALLEL reference: each round forwards prompt (id 0) + response (ids 1 + j)
  + k masks (id 1 + n) and commits the greedy block; cut at the first stop token."""
  b, p = tokens.shape
  width = p + G + k
  apply = jax.jit(lambda t, i, pos, v: Transformer(CFG).apply({"params": params}, t,
                                                              block_ids=i, positions=pos,
                                                              valid=v))
  prompt_len = valid.sum(1)
  response = np.zeros((b, 0), np.int32)
  while response.shape[1] < G:
    n = response.shape[1]
    canvas = np.zeros((b, width), np.int32)
    canvas[:, :p], canvas[:, p:p + n], canvas[:, p + n:p + n + k] = tokens, response, \
        CFG.mask_token_id
    ids = np.zeros((b, width), np.int32)
    ids[:, p:p + n] = 1 + np.arange(n)
    ids[:, p + n:] = 1 + n
    live = np.zeros((b, width), bool)
    live[:, :p], live[:, p:p + n + k] = valid, True
    pos = np.asarray(masks.left_pad_positions(jnp.asarray(live)))
    logits = np.asarray(apply(canvas, ids, pos, live))[:, p + n:p + n + k].copy()
    logits[..., CFG.mask_token_id] = -np.inf
    response = np.concatenate([response, logits.argmax(-1).astype(np.int32)], 1)
  response = response[:, :G]
  out = np.full((b, G), CFG.pad_token_id, np.int32)
  for r in range(b):
    stop = np.flatnonzero(response[r] == CFG.eos_token_id)
    end = stop[0] if len(stop) else G
    out[r, :end] = response[r, :end]
  assert np.all(prompt_len > 0)
  return out


def test_forced_parallel_equals_block_decode_of_the_drafter(models):
  target, drafter = models
  tokens, valid = batch_of(PROMPTS)
  out, st = run(target, drafter, tokens, valid, **PARALLEL)
  np.testing.assert_array_equal(np.asarray(out.tokens), block_reference(drafter, tokens, valid,
                                                                          K))
  assert int(st.target_forwards) == 0 and int(st.drafter_forwards) == int(out.steps)
  assert int(out.steps) == -(-G // K)  # k tokens a round (rows cut at a stop end earlier)


@pytest.mark.slow
def test_forced_parallel_at_draft_length_one_is_block_diffusion(models):
  target, drafter = models
  tokens, valid = batch_of(PROMPTS)
  out, st = run(target, drafter, tokens, valid, draft_length=1, **PARALLEL)
  bd = d2f.block_diffusion_generate(drafter, CFG, tokens, valid, gen_length=G, block_length=1)
  same_tokens(out, bd)
  assert int(out.nfe) == int(st.drafter_forwards) == int(bd.nfe)


def test_mixed_batch_rows_equal_their_modes_alone(models):
  """Through `generate`: 3 rows padded to a batch of 4 (the tags padded with them), each row
  forced to another mode by its tag, equal to that row decoded alone in its mode."""
  target, drafter = models
  tasks = ["copy", "math", "short"]
  out = api.generate(target, CFG, PROMPTS, method="adaptive", drafter_params=drafter,
                     drafter_cfg=CFG, gen_length=G, draft_length=K, task_modes=TAGS,
                     tasks=tasks, **VERIFY)
  assert isinstance(out, adaptive.AdaptiveOutput) and out.round_modes.shape == (3, G)
  np.testing.assert_array_equal(np.asarray(out.modes), [adaptive.PARALLEL, adaptive.VERIFY,
                                                        adaptive.AR])
  tokens, valid = batch_of(PROMPTS, 16)
  for r, (tag, forced) in enumerate(zip(tasks, (PARALLEL, VERIFY, AR))):
    alone, _ = run(target, drafter, tokens[r:r + 1], valid[r:r + 1], **forced)
    np.testing.assert_array_equal(np.asarray(out.tokens[r]), np.asarray(alone.tokens[0]))
    modes = np.asarray(out.round_modes[r])
    assert np.all(modes[modes >= 0] == adaptive.MODE_CODES[TAGS[tag]])


def numpy_rule(stats, out, opts):
  """The rule re-stated: the mode of every round from the recorded signals."""
  c0 = np.asarray(stats.first_confidence)
  acc = np.asarray(stats.round_accepted)
  live = live_rounds(out)
  modes = np.full(acc.shape, -1)
  for r in range(len(c0)):
    mode = (2 if c0[r] < np.float32(opts["ar_confidence"]) else
            0 if c0[r] >= np.float32(opts["parallel_confidence"]) else 1)
    drafted = accepted = streak = 0
    for s in np.flatnonzero(live[r]):
      modes[r, s] = mode
      if mode == 1:
        drafted, accepted = drafted + K, accepted + acc[r, s]
        streak = streak + 1 if acc[r, s] == K else 0
        if accepted < np.float32(opts["min_acceptance"]) * np.float32(drafted):
          mode = 2
        elif opts["trust_streak"] and streak >= opts["trust_streak"]:
          mode = 0
  return modes


def test_recorded_modes_follow_the_rule(models):
  """Thresholds between the rows' measured c0 put the rows in different modes; a verified
  row whose acceptance falls below min_acceptance drops to AR."""
  target, drafter = models
  tokens, valid = batch_of(PROMPTS)
  _, st = run(target, drafter, tokens, valid, **VERIFY)
  c0 = np.sort(np.asarray(st.first_confidence))
  assert c0[0] < c0[1] < c0[2], c0
  opts = dict(ar_confidence=float(c0[:2].mean()), parallel_confidence=float(c0[1:].mean()),
              min_acceptance=0.5, trust_streak=1)
  out, st = run(target, drafter, tokens, valid, **opts)
  expected = numpy_rule(st, out, opts)
  np.testing.assert_array_equal(np.asarray(out.round_modes), expected)
  assert sorted(np.asarray(out.modes).tolist()) == [0, 1, 2]
  verified = np.asarray(out.modes) == adaptive.VERIFY  # rejected at once: AR from round 1
  assert np.all(np.asarray(out.round_modes)[verified, 1] == adaptive.AR)
  # The verified and AR rows write AR's greedy tokens, also after the PARALLEL row is done
  # and the loop has moved on to its AR-only rounds.
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  exact = np.asarray(out.modes) != adaptive.PARALLEL
  np.testing.assert_array_equal(np.asarray(out.tokens)[exact], np.asarray(ref.tokens)[exact])
  parallel_rounds = int((np.asarray(out.round_modes)[~exact] >= 0).sum())
  assert parallel_rounds < int(out.steps), "no round ran after the PARALLEL row finished"
  # Round confidences are recorded where the row drafted (NaN for AR rounds).
  drafted = np.asarray(out.modes) != adaptive.AR
  np.testing.assert_array_equal(np.asarray(st.round_confidence)[drafted, 0],
                                np.asarray(st.first_confidence)[drafted])
  assert np.all(np.isnan(np.asarray(st.round_confidence)[np.asarray(out.round_modes) == 2]))
  assert int(out.nfe) == int(st.target_forwards) + int(st.drafter_forwards)
  np.testing.assert_array_equal(np.asarray(st.round_committed).sum(1),
                                np.asarray(out.committed))


@pytest.mark.slow
def test_trained_models_verified_rows_earn_trust_and_match_ar(run_cache):
  """Trained tiny models (the speculative tests' counting task): verified drafts are
  accepted whole, so rows move to PARALLEL, and the output still equals AR greedy."""
  target, _ = counting_model(run_cache, "selfspec", 0, block_size=K + 1)
  drafter, _ = counting_model(run_cache, "block_diffusion", 1, block_size=K + 1, sft=True)
  tokens, valid = batch_of(COUNT_PROMPTS, 7)
  ref = ar.ar_generate(target, CFG, tokens, valid, gen_length=G)
  out, st = run(target, drafter, tokens, valid, **VERIFY)
  same_tokens(out, ref)
  opts = dict(parallel_confidence=INF, ar_confidence=0.0, min_acceptance=0.5, trust_streak=1)
  out, st = run(target, drafter, tokens, valid, **opts)
  np.testing.assert_array_equal(np.asarray(out.round_modes), numpy_rule(st, out, opts))
  assert (np.asarray(out.round_modes) == adaptive.PARALLEL).any()
  same_tokens(out, ref)
  # The target runs exactly in the rounds where some row verifies or decodes AR (a round
  # whose live rows are all PARALLEL skips it; forced PARALLEL checks that case alone).
  rm = np.asarray(out.round_modes)
  assert int(st.target_forwards) == int(((rm == adaptive.VERIFY) | (rm == adaptive.AR))
                                         .any(0).sum())


def test_bad_options_are_named_errors(models):
  target, drafter = models
  tokens, valid = batch_of(PROMPTS)
  cases = [
      (dict(tasks=["copy", "poetry", None], task_modes=TAGS), "unknown task tag 'poetry'"),
      (dict(tasks=["copy"], task_modes=TAGS), "tasks has 1 entries for 3 prompts"),
      (dict(task_modes={"copy": "fast"}), r"task_modes\['copy'\]='fast'"),
      (dict(parallel_confidence=float("nan")), "parallel_confidence=nan"),
      (dict(ar_confidence=-0.1), "ar_confidence must be >= 0.0"),
      (dict(min_acceptance=1.5), "min_acceptance must be <= 1.0"),
      (dict(trust_streak=-1), "trust_streak must be an int >= 0"),
      (dict(draft_steps=K + 1), "draft_steps"),
      (dict(draft_length=0), "draft_length"),
  ]
  for kw, message in cases:
    with pytest.raises(ValueError, match=message):
      run(target, drafter, tokens, valid, **kw)
  with pytest.raises(ValueError, match="needs a diffusion drafter"):
    adaptive.adaptive_generate(target, CFG, tokens, valid, gen_length=G)
  with pytest.raises(ValueError, match="mask_token_id"):
    adaptive.adaptive_generate(target, CFG, tokens, valid, drafter_params=drafter,
                               drafter_cfg=CFG.replace(mask_token_id=None), gen_length=G)
  with pytest.raises(speculative.VocabMismatchError):
    adaptive.adaptive_generate(target, CFG, tokens, valid, drafter_params=drafter,
                               drafter_cfg=CFG.replace(vocab_size=80), gen_length=G)
  with pytest.raises(ValueError, match="one entry per prompt"):
    api.generate(target, CFG, PROMPTS, method="adaptive", drafter_params=drafter,
                 drafter_cfg=CFG, gen_length=G, tasks=["copy"], task_modes=TAGS)
  assert {"parallel_confidence", "ar_confidence", "min_acceptance", "trust_streak", "tasks",
          "task_modes", "on_nonfinite"} <= set(api.option_names("adaptive"))
