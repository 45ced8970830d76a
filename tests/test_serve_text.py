"""Streamed text with stop strings: the deltas of any chunking of a choice's tokens
concatenate to `cut_at_stop(decode_text(tokens), stop)`, the text `Sampler` returns.

Reference: the sampler's own functions on the whole token list. Tokens are random ids of
the tiny byte-level BPE tokenizer (`tiny_llada.train_bpe`), so decodes of prefixes often end
in a cut UTF-8 character (U+FFFD) right after the start of a stop string.
"""

import random

import pytest

import tiny_llada
from dllm_jax.checkpoints.tokenizer import load_tokenizer
from dllm_jax.sampler import cut_at_stop, decode_text
from dllm_jax.serve.text import StopText, held_back


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  return load_tokenizer(tiny_llada.write_llada_instruct(tmp_path_factory.mktemp("tok") / "m"))


def test_held_back_keeps_a_stop_prefix_before_a_cut_character():
  assert held_back("ab\ufffd", ["bx"]) == 2
  assert held_back("ab", ["bx"]) == 1 and held_back("ab", ["zz"]) == 0
  assert held_back("a\ufffd\ufffd", []) == 2


def test_deltas_concatenate_to_the_samplers_text(tokenizer):
  rng = random.Random(0)
  for _ in range(300):
    tokens = [rng.randrange(6, 300) for _ in range(rng.randint(1, 16))]
    full = decode_text(tokenizer, tokens)
    start = rng.randrange(max(1, len(full) - 1))
    piece = full[start:start + rng.randint(1, 3)].replace("\ufffd", "")
    stop = [piece or "x", "never there"]  # (a stop string holding U+FFFD is not stable)
    want, stopped = cut_at_stop(full, stop)
    text, parts, i = StopText(tokenizer, stop), [], 0
    while i < len(tokens) and not text.stopped:
      k = rng.randint(1, 4)
      parts.append(text.add(tokens[i:i + k]))
      i += k
    parts.append(text.finish(tokens))
    assert "".join(parts) == want and text.text == want, (tokens, stop)
    assert text.stopped == stopped
