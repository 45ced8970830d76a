"""What every decoding method promises alike: streaming, one option vocabulary, traced options
(one compile per sweep; a temperature of 0 is its own program, with no random draws), NaN
options rejected, non-finite logits flagged, batch-invariant ranking and params left in place
on a mesh.

Each test runs every method on the tiny model with short answers (G = 8 or 16). The hybrids
(speculative, adaptive) draft with a second random tiny model (`drafter`); selfspec drafts
with the model itself.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import decoding
from dllm_jax.decoding import (api, ar, base, buckets, compaction, d2f, drafters, fast_dllm,
                               llada, protocol, registry, streaming)
from dllm_jax.models import get_preset, init_params
from dllm_jax.models.transformer import abstract_params
from dllm_jax.parallel import mesh as mesh_lib
from dllm_jax.parallel import sharding
from test_decoding_llada import PROMPTS, random_params

# One setting per method, with sampling on where it is cheap so keys are exercised too.
RUNS = {
    "ar": dict(gen_length=8, temperature=0.8, top_k=10),
    "llada": dict(gen_length=16, block_length=8, steps=8, temperature=0.5),
    "dream": dict(gen_length=16, block_length=8, steps=8),
    "fast_dllm": dict(gen_length=16, block_length=8, threshold=0.5, cache="dual"),
    "d2f": dict(gen_length=16, block_length=4, tau_add=0.5, tau_act=0.5, tau_conf=0.7),
    "block_diffusion": dict(gen_length=16, block_length=4, steps_per_block=2),
    # Greedy, so a padded batch equals each prompt alone (sampling keys follow the row index).
    "speculative": dict(gen_length=8, drafter="ar", draft_length=4),
    "selfspec": dict(gen_length=8, draft_length=3),
    # The three prompts' first-block confidences are 0.67, 0.65 and 0.50: one row per mode.
    "adaptive": dict(gen_length=8, draft_length=3, parallel_confidence=0.66,
                     ar_confidence=0.55),
}
HYBRIDS = ("speculative", "selfspec", "adaptive")
DRAFTED = ("speculative", "adaptive")  # the methods that take drafter_params / drafter_cfg
CORE = [m for m in registry.names() if m not in HYBRIDS]
FIELDS = ("tokens", "lengths", "nfe", "steps", "committed", "done", "finite")


@pytest.fixture(scope="module")
def model():
  cfg = get_preset("tiny").replace(eos_token_id=None)
  return cfg, random_params(cfg)


@pytest.fixture(scope="module")
def init_model():
  """The model's own random init: logits near uniform, so confidences nearly tie."""
  cfg = get_preset("tiny").replace(eos_token_id=None)
  return cfg, nn.unbox(init_params(cfg, jax.random.key(0)))


@pytest.fixture(scope="module")
def drafter(model):
  """A second random tiny model (the same tokenizer): its drafts are often rejected."""
  cfg, _ = model
  return random_params(cfg, seed=1)


def run_options(method, cfg, drafter_params, **overrides):
  """RUNS[method] with the drafter added for the methods that take one."""
  extra = dict(drafter_params=drafter_params, drafter_cfg=cfg) if method in DRAFTED else {}
  return {**RUNS[method], **extra, **overrides}


def assert_same_output(a, b, msg=""):
  for f in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)),
                                  err_msg=f"{msg} {f}")


# ----------------------------------------------------------------------------- streaming

@pytest.mark.parametrize("method", list(RUNS))
def test_stream_replays_generate_for_every_method(model, drafter, method):
  cfg, params = model
  rng = jax.random.key(4)
  options = run_options(method, cfg, drafter)
  events = list(streaming.stream(params, cfg, PROMPTS, method=method, rng=rng, **options))
  fused = api.generate(params, cfg, PROMPTS, method=method, rng=rng, **options)
  assert all(e.output is None for e in events[:-1])
  assert_same_output(events[-1].output, fused, method)
  new = np.stack([e.new for e in events]).astype(int)
  assert new.sum(0).max() <= 1, "a slot was committed twice"
  np.testing.assert_array_equal(new.sum(0).astype(bool), events[-1].decided)
  for e in events:  # one event per forward, each committing something in a live row
    assert e.new.any(), (method, e.step)
  # A hybrid's event is a round (drafter forwards + one verifying forward): steps, not nfe.
  assert len(events) == int(fused.steps if method in HYBRIDS else fused.nfe)
  first = 0 if registry.get(method).init_forwards else 1  # the init committed tokens
  assert [e.step for e in events] == list(range(first, first + len(events)))
  if method == "adaptive":
    np.testing.assert_array_equal(fused.modes, [0, 1, 2])  # parallel, verify, AR


def test_stream_lists_every_method():
  assert set(registry.names()) == set(RUNS)


# ----------------------------------------------------------------------------- vocabulary

def test_every_block_method_calls_it_block_length():
  """Every method shares gen_length, temperature and on_nonfinite; the block methods call
  their block block_length (a hybrid's block is its draft: draft_length)."""
  for method in registry.names():
    names = api.option_names(method)
    assert "gen_length" in names and "temperature" in names and "on_nonfinite" in names
    assert "block_size" not in names
    assert ("block_length" in names) == (method not in ("ar",) + HYBRIDS), method
    assert ("draft_length" in names) == (method in HYBRIDS), method


@pytest.mark.parametrize("method", ["d2f", "block_diffusion", "llada", "fast_dllm"])
def test_old_block_size_spelling_says_use_block_length(method):
  with pytest.raises(ValueError, match="block_size.*block_length"):
    api.generate(None, get_preset("tiny"), [[5, 6]], method=method, gen_length=8, block_size=4)
  with pytest.raises(ValueError, match="block_size.*block_length"):
    next(streaming.stream(None, get_preset("tiny"), [[5, 6]], method=method, block_size=4))
  if method in ("d2f", "block_diffusion"):
    fn = d2f.d2f_generate if method == "d2f" else d2f.block_diffusion_generate
    with pytest.raises(ValueError, match="block_size.*pass block_length"):
      fn(None, get_preset("tiny"), *base.pad_prompts([[5, 6]], 0), gen_length=8, block_size=4)


@pytest.mark.parametrize("method", list(RUNS))
def test_shared_defaults_and_one_window_check(method):
  """Defaults: gen_length 128 and block_length 32 everywhere; the one window check names
  the largest gen_length that fits (a multiple of block_length; a hybrid has none)."""
  tokenwise = method == "ar" or method in HYBRIDS
  fix = (r"pass gen_length=122 or less\." if tokenwise else
         r"pass gen_length=120 or less \(a multiple of block_length=8\)")
  extra = ({} if method == "ar" else dict(drafter_params={}, drafter_cfg=get_preset("tiny"))
           if method in DRAFTED else {} if tokenwise else {"block_length": 8})
  with pytest.raises(ValueError, match=r"\(6\) \+ gen_length \(128\).*max_seq_len=128.*" + fix):
    api.generate(None, get_preset("tiny"), [[5] * 6], method=method, **extra)
  if not tokenwise:  # the default block_length 32
    with pytest.raises(ValueError, match=r"pass gen_length=96 or less"):
      api.generate(None, get_preset("tiny"), [[5] * 6], method=method)


def test_block_length_defaults_to_32_capped_at_gen_length():
  assert llada.LLaDAOptions(gen_length=64).block_length == 32
  assert llada.LLaDAOptions(gen_length=16).block_length == 16
  assert fast_dllm.FastDLLMOptions(gen_length=16).block_length == 16
  cfg = get_preset("tiny")
  assert d2f.d2f_options(cfg, gen_length=64)[0].block_length == 32
  spec, _ = d2f.block_diffusion_options(cfg, gen_length=16)
  assert spec.block_length == 16 and spec.steps_per_block == 16


# ----------------------------------------------------------------------------- NaN options

NAN_OPTIONS = {
    "ar": ["temperature", "top_p"],
    "llada": ["temperature", "alg_temp", "cfg_scale"],
    "dream": ["temperature", "alg_temp", "cfg_scale"],
    "fast_dllm": ["temperature", "threshold", "factor"],
    "d2f": ["temperature", "tau_add", "tau_act", "tau_conf"],
    "block_diffusion": ["temperature"],
    "speculative": ["temperature", "top_p"],
    "selfspec": ["temperature", "top_p"],
    "adaptive": ["temperature", "top_p", "parallel_confidence", "ar_confidence",
                 "min_acceptance"],
}
INF_OPTIONS = {
    "ar": ["temperature"], "llada": ["temperature", "alg_temp", "cfg_scale"],
    "dream": ["alg_temp"], "fast_dllm": ["temperature", "factor"],
    "d2f": ["temperature", "tau_add", "tau_act"], "block_diffusion": ["temperature"],
    "speculative": ["temperature"], "selfspec": ["temperature"],
    "adaptive": ["temperature", "min_acceptance"],
}


@pytest.mark.parametrize("method,option", [(m, o) for m, os in NAN_OPTIONS.items() for o in os])
def test_nan_option_is_a_named_error(method, option):
  with pytest.raises(ValueError, match=f"{option}=nan is not a finite number"):
    api.generate(None, get_preset("tiny"), [[5, 6]], method=method, gen_length=8,
                 **{option: float("nan")})


@pytest.mark.parametrize("method,option", [(m, o) for m, os in INF_OPTIONS.items() for o in os])
def test_meaningless_inf_option_is_a_named_error(method, option):
  with pytest.raises(ValueError, match=f"{option}=inf"):
    api.generate(None, get_preset("tiny"), [[5, 6]], method=method, gen_length=8,
                 **{option: float("inf")})


# ----------------------------------------------------------------------------- traced options

SWEEPS = {  # method -> (fixed options, {traced option: >= 3 values})
    "ar": (dict(gen_length=6),
           {"temperature": [0.5, 1.3, 3.0], "top_k": [0, 3, 10], "top_p": [1.0, 0.9, 0.5]}),
    "llada": (dict(gen_length=8, block_length=4, steps=4, cfg_scale=0.5),
              {"temperature": [0.5, 1.3, 3.0], "alg_temp": [0.3, 1.0, 3.0],
               "cfg_scale": [0.5, 1.0, 2.0]}),
    "dream": (dict(gen_length=8, block_length=4, steps=4),
              {"temperature": [0.5, 1.3, 3.0], "alg_temp": [0.3, 1.0, 3.0]}),
    "fast_dllm": (dict(gen_length=8, block_length=4),
                  {"threshold": [0.9, 0.5, 0.1, 2.0], "temperature": [0.5, 1.3, 3.0]}),
    "fast_dllm_factor": (dict(gen_length=8, block_length=4, rule="factor"),
                         {"factor": [1.0, 0.5, 3.0]}),
    "d2f": (dict(gen_length=8, block_length=4),
            {"tau_conf": [0.9, 0.5, 0.1], "tau_add": [0.1, 0.5, 1.0],
             "tau_act": [0.95, 0.5, 0.0], "temperature": [0.5, 1.3, 3.0]}),
    "block_diffusion": (dict(gen_length=8, block_length=4),
                        {"temperature": [0.5, 1.3, 3.0]}),
}
# Every method runs as `protocol.run_batch`: one whole-decode program (or first stage) per
# decoder and shape, and each later stage at most once (`protocol.compiled_programs`).
STAGES = len(compaction.stage_sizes(buckets.batch_size(len(PROMPTS)))) - 1


@pytest.mark.parametrize("name", list(SWEEPS))
def test_sweeping_traced_options_compiles_once(model, name):
  """Each sweep of a traced option compiles nothing new. A temperature (Dream's alg_temp) of
  0 is its own program (base.ZERO_IS_STATIC): a sweep over positive values compiles the
  sampling program at its first value, then nothing."""
  cfg, params = model
  cfg = cfg.replace(max_seq_len=120)  # a config no other test compiles for
  method = name.removesuffix("_factor")
  fixed, sweeps = SWEEPS[name]
  rng = jax.random.key(1)
  for option, values in sweeps.items():
    api.generate(params, cfg, PROMPTS, method=method, rng=rng, **{**fixed, option: values[0]})
    compiled, later = protocol.compiled_programs()
    outs = [api.generate(params, cfg, PROMPTS, method=method, rng=rng,
                         **{**fixed, option: v}) for v in values]
    assert protocol.compiled_programs()[0] == compiled, f"{option} recompiled"
    # A later stage compiles once per stage shape, when a value first reaches it.
    assert protocol.compiled_programs()[1] - later <= 2 * STAGES, f"{option} recompiled"
    if option in ("temperature", "threshold", "tau_conf"):  # the knob really reaches the loop
      assert len({np.asarray(o.tokens).tobytes() + np.asarray(o.nfe).tobytes()
                  for o in outs}) > 1, option


class _Captured(Exception):
  """Raised by `_program`'s spy once it holds the decode program's arguments."""


def _program(monkeypatch, params, cfg, method: str, **options) -> str:
  """The jaxpr (text) of the whole-decode program (`protocol.run`: the init and step the
  staged decode runs too) for the arguments `api.generate` passes with these options.

  The spy records the arguments and stops `generate` there: tracing needs no compile."""
  calls = []

  def spy(*args, **kwargs):
    calls.append((args, kwargs))
    raise _Captured
  monkeypatch.setattr(protocol, "run_batch", spy)
  with pytest.raises(_Captured):
    api.generate(params, cfg, PROMPTS, method=method, rng=jax.random.key(1), **options)
  monkeypatch.undo()
  (args, kwargs), = calls
  return str(protocol.run.trace(*args, **kwargs).jaxpr)


@pytest.mark.parametrize("name", ["ar", "llada", "dream", "fast_dllm", "d2f", "block_diffusion"])
def test_a_greedy_program_draws_no_random_numbers(model, monkeypatch, name):
  """Temperature 0 compiles a loop with no sampling in it (no conditional on the traced
  temperature, no draws), and a positive temperature the sampling program; the deterministic
  ranking (remasking by probability, alg_temp 0) keeps the greedy program draw-free."""
  cfg, params = model
  fixed, _ = SWEEPS[name]
  greedy = _program(monkeypatch, params, cfg, name, **fixed, temperature=0.0)
  sampled = _program(monkeypatch, params, cfg, name, **fixed, temperature=0.7)
  assert "random_bits" not in greedy, f"{name}: the greedy program draws random numbers"
  assert "random_bits" in sampled, f"{name}: the sampling program draws nothing"


def test_traced_temperature_zero_is_exactly_greedy(model):
  """At a traced temperature of 0 every method's first choice is the logits' argmax."""
  cfg, params = model
  # RUNS["ar"]'s gen_length: the program the streaming test compiled (temperature is traced).
  out = api.generate(params, cfg, PROMPTS, method="ar", gen_length=RUNS["ar"]["gen_length"],
                     temperature=0.0)
  tokens, valid = base.pad_prompts(PROMPTS, 0)
  from dllm_jax.models import forward, masks
  pos = masks.left_pad_positions(valid)
  logits = forward(params, cfg, tokens, positions=pos, valid=valid)[:, -1]
  logits = logits.at[:, cfg.mask_token_id].set(-jnp.inf)
  np.testing.assert_array_equal(out.tokens[:, 0], np.argmax(np.asarray(logits), -1))


# ----------------------------------------------------------------------------- non-finite

def _nan_params(params):
  """The params with one NaN in layer 0's q kernel (every row's logits become NaN)."""
  def poison(path, x):
    return x.at[0, 0, 0].set(jnp.nan) if "'q'" in jax.tree_util.keystr(path) else x
  return jax.tree_util.tree_map_with_path(poison, params)


# Adaptive: no row may commit in parallel from round 0 on (such a row never runs the target).
# The thresholds are traced: the same program as RUNS["adaptive"].
TARGET_USED = {"adaptive": dict(parallel_confidence=2.0)}


@pytest.mark.parametrize("method", list(RUNS))
def test_nonfinite_logits_raise_a_named_error_or_flag_the_rows(model, drafter, method):
  cfg, params = model
  bad = _nan_params(params)
  options = run_options(method, cfg, drafter, **TARGET_USED.get(method, {}))
  with pytest.raises(decoding.NonFiniteLogitsError, match=r"row\(s\) \[0, 1, 2\]"):
    api.generate(bad, cfg, PROMPTS, method=method, **options)
  out = api.generate(bad, cfg, PROMPTS, method=method, on_nonfinite="flag", **options)
  np.testing.assert_array_equal(out.finite, False)
  np.testing.assert_array_equal(out.lengths, 0)
  np.testing.assert_array_equal(out.tokens, base.output_pad_id(cfg))
  with pytest.raises(decoding.NonFiniteLogitsError):
    list(streaming.stream(bad, cfg, PROMPTS, method=method, **options))
  good = api.generate(params, cfg, PROMPTS, method=method, **options)
  np.testing.assert_array_equal(good.finite, True)


@pytest.mark.parametrize("method", DRAFTED)
def test_a_nonfinite_drafter_flags_the_rows_it_drafted_for(model, drafter, method):
  """A drafter's NaN logits flag the rows like the target's (its drafts mean nothing)."""
  cfg, params = model
  options = run_options(method, cfg, _nan_params(drafter))
  with pytest.raises(decoding.NonFiniteLogitsError, match=r"row\(s\) \[0, 1, 2\]"):
    api.generate(params, cfg, PROMPTS, method=method, **options)
  out = api.generate(params, cfg, PROMPTS, method=method, on_nonfinite="flag", **options)
  np.testing.assert_array_equal(out.finite, False)
  np.testing.assert_array_equal(out.lengths, 0)
  np.testing.assert_array_equal(out.tokens, base.output_pad_id(cfg))
  if method == "adaptive":  # rows told to decode plain AR never run the drafter
    out = api.generate(params, cfg, PROMPTS, method=method, on_nonfinite="flag",
                       **{**options, "task_modes": {"math": "ar", "chat": "auto"},
                          "tasks": ["math", "chat", "math"]})
    np.testing.assert_array_equal(out.finite, [True, False, True])
    good = api.generate(params, cfg, PROMPTS, method="ar", gen_length=8)
    np.testing.assert_array_equal(out.tokens[::2], good.tokens[::2])


def test_bad_on_nonfinite_value():
  with pytest.raises(ValueError, match="on_nonfinite"):
    api.generate(None, get_preset("tiny"), [[5]], method="llada", on_nonfinite="ignore")


# ----------------------------------------------------------------------------- invariance

FOUR = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20, 21, 22, 23]]
# llada, dream, fast_dllm (dual cache) and block_diffusion (entropy) with exactly these
# options, this init model and these four prompts are checked row by row, alone against the
# batch of four on one device, by test_decoding_multidevice's near-ties test (in the default
# run: `slow` still runs in CI), which needs those programs for its mesh comparison anyway;
# compiling them here again doubled the cost. The settings below are the ones only this
# test covers (AR at gen_length 8, Dream's margin ranking, D2F's two rankings). The
# diffusion methods rank batch-invariantly only when asked (`batch_invariant=True`; the
# default ranks exact scores, as the references do, and d2f_entropy then differs here).
INVARIANCE = {
    "ar": dict(gen_length=8),
    "dream_margin": dict(gen_length=16, block_length=8, steps=8, remasking="topk_margin",
                         batch_invariant=True),
    "d2f": dict(gen_length=16, block_length=4, tau_add=0.5, tau_act=0.5, tau_conf=0.7,
                batch_invariant=True),
    "d2f_entropy": dict(gen_length=16, block_length=4, remasking="entropy", tau_conf=2.0,
                        batch_invariant=True),
}


@pytest.mark.parametrize("name", list(INVARIANCE))
def test_a_row_alone_equals_the_row_in_a_batch_of_four(init_model, name):
  """On the near-uniform init model, confidences nearly tie; with batch_invariant, ranking
  on a grid with lowest-slot ties gives a row the same tokens alone and in a batch."""
  cfg, params = init_model
  method = name if name in registry.names() else name.rsplit("_", 1)[0]
  many = np.asarray(api.generate(params, cfg, FOUR, method=method, **INVARIANCE[name]).tokens)
  for i, prompt in enumerate(FOUR):
    one = api.generate(params, cfg, [prompt], method=method, **INVARIANCE[name])
    np.testing.assert_array_equal(np.asarray(one.tokens)[0], many[i], err_msg=f"row {i}")


@pytest.mark.parametrize("method", HYBRIDS)
def test_a_padded_batch_equals_each_prompt_alone(model, drafter, method):
  """generate pads three prompts to the batch bucket of four (the padding row flagged and
  dropped); each row equals its prompt decoded alone."""
  cfg, params = model
  options = run_options(method, cfg, drafter)
  many = api.generate(params, cfg, PROMPTS, method=method, **options)
  assert many.tokens.shape == (3, options["gen_length"])
  np.testing.assert_array_equal(many.finite, True)
  for i, prompt in enumerate(PROMPTS):
    one = api.generate(params, cfg, [prompt], method=method, **options)
    for f in ("tokens", "lengths", "committed", "done", "finite"):
      np.testing.assert_array_equal(np.asarray(getattr(one, f))[0],
                                    np.asarray(getattr(many, f))[i], err_msg=f"row {i} {f}")


def test_rank_scores_break_near_ties_by_slot_only_when_invariant():
  """batch_invariant ranks on the grid (near-ties go to the lowest slot); the default ranks
  the exact scores (exact ties to the lowest slot), as torch.topk / argmax do."""
  sampling = decoding.sampling
  scores = jnp.asarray([[0.5, 0.5 + 1e-6, 0.2, 0.5 - 1e-6]])
  for invariant in (False, True):
    np.testing.assert_array_equal(
        sampling.top_k_mask(scores, jnp.asarray([2]), invariant=invariant),
        [[True, True, False, False]])
  rev = scores[:, ::-1]  # [0.5 - 1e-6, 0.2, 0.5 + 1e-6, 0.5]
  np.testing.assert_array_equal(sampling.best_mask(rev, rev > 0, invariant=True),
                                [[True, False, False, False]])
  np.testing.assert_array_equal(sampling.best_mask(rev, rev > 0), [[False, False, True, False]])
  np.testing.assert_array_equal(sampling.top_k_mask(rev, jnp.asarray([1])),
                                [[False, False, True, False]])
  np.testing.assert_array_equal(sampling.top_k_mask(rev, jnp.asarray([1]), invariant=True),
                                [[True, False, False, False]])
  tied = jnp.asarray([[0.3, 0.7, 0.3, 0.7]])  # exact ties: the lowest slot in either mode
  for invariant in (False, True):
    np.testing.assert_array_equal(sampling.best_mask(tied, tied > 0, invariant=invariant),
                                  [[False, True, False, False]])
    np.testing.assert_array_equal(
        sampling.top_k_mask(tied, jnp.asarray([3]), invariant=invariant),
        [[True, True, False, True]])
  np.testing.assert_array_equal(sampling.rank_scores(scores, False), scores)
  with pytest.raises(TypeError, match="static Python bool"):
    jax.jit(lambda s, f: sampling.rank_scores(s, f))(scores, True)


def test_sort_descending_filters_as_the_reversed_sort_did():
  """The filters' descending sort negates instead of reversing (a reversed tensor-sharded
  vocabulary is a collective permute: tests/test_decoding_multidevice.py). On NaN-free rows
  its values are `jnp.sort(x)[..., ::-1]`'s (signed zeros, infinities, ties), and top-k,
  top-p and the drafters' per-row filter give the same logits, bit for bit, as the reversed
  sort they used before."""
  sampling = decoding.sampling
  special = np.asarray([[0.0, -0.0, np.inf, -np.inf, 1.5, 1.5, -2.0, 3e-38, 1.5, 0.0]],
                       np.float32)
  rows = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
  for x in (special, rows, np.round(rows, 1)):
    np.testing.assert_array_equal(sampling.sort_descending(jnp.asarray(x)),
                                  jnp.sort(jnp.asarray(x), axis=-1)[..., ::-1])

  def reversed_sort_filters(logits, top_k, top_p):  # the filters before, per row
    v = logits.shape[-1]
    desc = jnp.sort(logits, axis=-1)[..., ::-1]
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)
    logits = jnp.where(((top_k <= 0) | (top_k >= v))[:, None] | (logits >= kth), logits,
                       sampling.NEG_INF)
    desc = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(desc, axis=-1)
    idx = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p[:, None], -1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(desc, idx, axis=-1)
    return jnp.where((top_p >= 1.0)[:, None] | (logits >= cutoff), logits, sampling.NEG_INF)

  logits = jnp.asarray(np.round(rows * 3, 0))  # many exact ties at the cutoffs
  top_k, top_p = jnp.asarray([0, 5, 12], jnp.int32), jnp.asarray([0.5, 0.9, 1.0])
  want = reversed_sort_filters(logits, top_k, top_p)
  np.testing.assert_array_equal(drafters.filtered_logits(logits, jnp.ones(3), top_k, top_p, ()),
                                want)
  for k, p in ((5, 0.9), (0, 0.5), (12, 1.0)):  # one value for every row: traced, static
    want = reversed_sort_filters(logits, jnp.full(3, k), jnp.full(3, p))
    for k_, p_ in ((jnp.int32(k), jnp.float32(p)), (k, p)):
      got = sampling.filter_top_p(sampling.filter_top_k(logits, k_), p_)
      np.testing.assert_array_equal(got, want, err_msg=f"top_k={k!r} top_p={p!r}")


def test_batch_invariant_is_a_checked_option_of_the_ranking_methods():
  """Every method that ranks takes batch_invariant (a bool, checked before compiling); ar
  and selfspec never rank and refuse it as unknown."""
  cfg = get_preset("tiny")
  for method in registry.names():
    names = api.option_names(method)
    assert ("batch_invariant" in names) == (method not in ("ar", "selfspec")), method
    if method in ("ar", "selfspec"):
      with pytest.raises(ValueError, match="Unknown option"):
        api.generate(None, cfg, [[5, 6]], method=method, gen_length=8, batch_invariant=True)
      continue
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
      api.generate(None, cfg, [[5, 6]], method=method, gen_length=8, batch_invariant=1)


# ----------------------------------------------------------------------------- placement

def test_params_already_on_the_mesh_are_not_copied(model, monkeypatch):
  cfg, params = model
  mesh = mesh_lib.make_mesh({"data": 1})
  abstract = lambda: abstract_params(cfg)
  placed = sharding.place_params(params, mesh, abstract=abstract)
  again = sharding.place_params(placed, mesh, abstract=abstract)
  for a, b in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(again)):
    assert a is b
  seen = []
  real = jax.device_put
  monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: (seen.append(x), real(x, *a, **k))[1])
  for method in ("fast_dllm", "d2f"):
    out = api.generate(placed, cfg, PROMPTS, method=method, mesh=mesh, **RUNS[method])
    ref = api.generate(params, cfg, PROMPTS, method=method, **RUNS[method])
    np.testing.assert_array_equal(out.tokens, ref.tokens)
  leaves = {id(x) for x in jax.tree_util.tree_leaves(placed)}
  for x in seen:
    assert not any(id(leaf) in leaves for leaf in jax.tree_util.tree_leaves(x)), \
        "already placed params were put again"
