"""`Sampler`: text in, text out, the same tokens as `decoding.generate`, exact stop cuts and
streams whose deltas add up to the text."""

import jax
import numpy as np
import pytest

from dllm_jax import decoding
from dllm_jax.data import tasks, tokenizers
from dllm_jax.models import get_preset, init_params
from dllm_jax.sampler import Sampler, _held_back, cut_at_stop, decode_text, encode_text

G, BLOCK = 8, 4
# Options that make every method decode an 8-slot canvas in 4-slot blocks.
OPTIONS = {
    "ar": {},
    "llada": {"steps": 8, "block_length": BLOCK},
    "dream": {"steps": 8},
    "fast_dllm": {"block_length": BLOCK, "threshold": 0.5},
    "d2f": {"tau_conf": 0.5},
    "block_diffusion": {"steps_per_block": 2},
}
PROMPTS = ["12+34=", "7+5=", "99+99="]


def _options(method):
  opts = dict(OPTIONS[method], gen_length=G)
  if method in ("d2f", "block_diffusion"):
    opts["block_length"] = BLOCK
  return opts


@pytest.fixture(scope="module")
def model():
  """Random tiny weights with the synthetic tasks' character tokenizer (EOS never wins, so
  every method writes all G slots of varied characters)."""
  tok = tokenizers.CharTokenizer(tasks.TASK_ALPHABET)
  cfg = get_preset("tiny").replace(active_vocab_size=tok.vocab_size)
  params = init_params(cfg, jax.random.key(3))
  return params, cfg, tok


def _sampler(model, method, **extra):
  params, cfg, tok = model
  return Sampler(params, cfg, tok, method, **{**_options(method), **extra})


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_same_tokens_as_generate(model, method):
  params, cfg, tok = model
  sampler = _sampler(model, method)
  result = sampler.sample(PROMPTS, seed=5, return_output=True)
  tokens, valid = sampler.encode(PROMPTS)
  ref = decoding.generate(params, cfg, (tokens, valid), method=method, rng=jax.random.key(5),
                          **_options(method))
  np.testing.assert_array_equal(result.tokens, np.asarray(ref.tokens))
  np.testing.assert_array_equal(result.lengths, np.asarray(ref.lengths))
  assert result.nfe == int(ref.nfe)
  # The prompts are BOS + characters, left padded; the text is the ids before the first stop.
  for i, p in enumerate(PROMPTS):
    ids = [tok.bos_id] + tok.encode(p)
    assert tokens[i, -len(ids):].tolist() == ids and valid[i].sum() == len(ids)
    n = int(ref.lengths[i])
    assert result.text[i] == tok.decode(np.asarray(ref.tokens)[i, :n])


def test_batch_rows_equal_single_prompts(model):
  """batch_invariant=True (passed through to the decoder) ranks on the grid: a prompt's
  answer is the same alone and in a batch (the default ranks exact scores, as the reference
  decoders do, and these near-uniform random weights tie often)."""
  sampler = _sampler(model, "fast_dllm", prompt_len=7,  # one prompt shape: one compile
                     batch_invariant=True)
  batch = sampler.sample(PROMPTS)
  assert batch == [sampler.sample(p) for p in PROMPTS]
  assert isinstance(sampler.sample(PROMPTS[0]), str)


def test_prompt_len_pads_without_changing_tokens(model):
  """A run's fixed prompt region pads further on the left; the decode is unchanged."""
  plain, padded = _sampler(model, "llada"), _sampler(model, "llada").replace(prompt_len=12)
  assert padded.encode(PROMPTS)[0].shape == (3, 12)
  assert padded.sample(PROMPTS) == plain.sample(PROMPTS)


def test_stop_strings_cut_the_text(model):
  sampler = _sampler(model, "ar")
  full = sampler.sample(PROMPTS)
  stops = [text[3:5] for text in full]  # a piece from the middle of each answer
  assert all(len(s) == 2 for s in stops)
  cut = sampler.sample(PROMPTS, stop=stops)
  for text, c in zip(full, cut):
    first = min(i for i in (text.find(s) for s in stops) if i >= 0)
    assert c == text[:first] and len(c) <= 3
  assert sampler.sample(PROMPTS, stop=["not in any answer"]) == full


def test_cut_at_stop_and_held_back():
  assert cut_at_stop("ab=cd=ef", ["=", "cd"]) == ("ab", True)
  assert cut_at_stop("abcdef", ["de", "bc"]) == ("a", True)
  assert cut_at_stop("abc", ["x"]) == ("abc", False)
  assert _held_back("12 + 3", ["+ 4"]) == 0
  assert _held_back("12 +", ["+ 4"]) == 1          # "+" may start the stop string
  assert _held_back("12 + ", ["+ 4"]) == 2
  assert _held_back("ab\ufffd", []) == 1            # a cut multi-byte character


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_stream_deltas_add_up_to_the_text(model, method):
  sampler = _sampler(model, method)
  deltas = list(sampler.sample(PROMPTS, seed=2, stream=True))
  expected = sampler.sample(PROMPTS, seed=2)
  if method == "ar":  # one token per step, so the text arrives a piece per step
    assert len(deltas) >= G // 2
  assert all(len(d) == len(PROMPTS) for d in deltas)
  assert ["".join(d[i] for d in deltas) for i in range(len(PROMPTS))] == expected
  # A stop string cuts the stream where it cuts the text.
  stop = expected[0][4:6] or "0"
  cut = list(sampler.sample(PROMPTS, seed=2, stream=True, stop=[stop]))
  assert ["".join(d[i] for d in cut) for i in range(len(PROMPTS))] == sampler.sample(
      PROMPTS, seed=2, stop=[stop])
  if method == "ar":  # one prompt streams str deltas
    pieces = list(sampler.sample(PROMPTS[0], seed=2, stream=True, stop=[stop]))
    assert all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == sampler.sample(PROMPTS[0], seed=2, stop=[stop])


def test_speculative_sampler_gives_generate_tokens_and_streams(model):
  """A drafting method through the Sampler (the drafter as options): the tokens of
  `decoding.generate`, which greedy speculative decoding makes AR's; the stream adds up."""
  params, cfg, tok = model
  opts = dict(gen_length=G, drafter="ar", draft_length=3, drafter_params=params,
              drafter_cfg=cfg)
  sampler = Sampler(params, cfg, tok, "speculative", **opts)
  result = sampler.sample(PROMPTS, seed=5, return_output=True)
  tokens, valid = sampler.encode(PROMPTS)
  ref = decoding.generate(params, cfg, (tokens, valid), method="speculative",
                          rng=jax.random.key(5), **opts)
  np.testing.assert_array_equal(result.tokens, np.asarray(ref.tokens))
  np.testing.assert_array_equal(result.lengths, np.asarray(ref.lengths))
  assert result.nfe == int(ref.nfe)
  ar = decoding.generate(params, cfg, (tokens, valid), method="ar", gen_length=G)
  np.testing.assert_array_equal(result.tokens, np.asarray(ar.tokens))
  deltas = list(sampler.sample(PROMPTS, seed=5, stream=True))
  assert ["".join(d[i] for d in deltas) for i in range(len(PROMPTS))] == result.text
  for method in ("speculative", "adaptive"):
    with pytest.raises(ValueError, match=f"method '{method}' drafts with a second model.*"
                       "drafter_model"):
      Sampler(params, cfg, tok, method, gen_length=G)
  with pytest.raises(ValueError, match="drafter_model applies to .*speculative.*not 'llada'"):
    Sampler.load("unused", "llada", drafter_model="unused")


def test_chat_messages_without_a_template(model):
  sampler = _sampler(model, "ar")
  message = [{"role": "user", "content": "12+34="}]
  assert sampler.sample(message) == sampler.sample("12+34=")
  assert sampler.sample([message, message]) == [sampler.sample("12+34=")] * 2
  with pytest.raises(ValueError, match="no chat template"):
    sampler.encode([{"role": "system", "content": "x"}, {"role": "user", "content": "1+1="}])


def test_mistakes_are_named(model):
  params, cfg, tok = model
  with pytest.raises(ValueError, match="Unknown option"):
    Sampler(params, cfg, tok, "d2f", gen_length=8, tua_conf=0.5)
  with pytest.raises(ValueError, match="Unknown decoding method"):
    Sampler(params, cfg, tok, "beam")
  sampler = _sampler(model, "ar")
  with pytest.raises(ValueError, match="rng or seed"):
    sampler.sample("1+1=", rng=jax.random.key(0), seed=1)
  with pytest.raises(ValueError, match="prompts must be"):
    sampler.sample([1, 2, 3])
  with pytest.raises(ValueError, match="stop must be"):
    sampler.sample("1+1=", stop=[""])
  with pytest.raises(ValueError, match="exceeds the model window"):
    sampler.sample("1+1=" * 40)
  with pytest.raises(ValueError, match="'\\?'"):  # the character tokenizer names it
    sampler.sample("1?1=")


def test_encode_decode_helpers(model):
  _, _, tok = model
  ids = encode_text(tok, "12+3=")
  assert ids[0] == tok.bos_id and decode_text(tok, ids) == "12+3="
