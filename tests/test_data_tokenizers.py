"""Tests for dllm_jax.data.tokenizers: round trips, special ids, errors, HF files."""

import json

import numpy as np
import pytest

from dllm_jax.data.tasks import TASK_ALPHABET
from dllm_jax.data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer

TEXTS = ["", "hello world", "37+48=85\n", "naïve café ☃ 日本語", "tab\tand\x00nul"]


# -- ByteTokenizer --------------------------------------------------------------------------


def test_byte_layout_and_specials():
  tok = ByteTokenizer()
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.eot_id) == (0, 1, 2, 3, 2)
  assert tok.vocab_size == 260
  assert tok.encode("A\x00\xff") == [65 + 4, 4, 0xC3 + 4, 0xBF + 4]  # \xff is 2 UTF-8 bytes


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert all(4 <= i < 260 for i in ids)
  assert tok.decode(ids) == text
  assert tok.decode(np.asarray(ids, np.int32)) == text


def test_byte_decode_specials_and_invalid_utf8():
  tok = ByteTokenizer()
  ids = [tok.bos_id] + tok.encode("ab") + [tok.mask_id, tok.eos_id, tok.pad_id]
  assert tok.decode(ids) == "ab"
  assert tok.decode(ids, skip_special=False) == "<|bos|>ab<|mask|><|eos|><|pad|>"
  cut = tok.encode("é")[:1] + tok.encode("x")  # first byte of a 2-byte char
  assert tok.decode(cut) == "\ufffdx"


def test_byte_decode_errors():
  tok = ByteTokenizer()
  with pytest.raises(ValueError, match="outside"):
    tok.decode([5, 260])
  with pytest.raises(ValueError, match="outside"):
    tok.decode([-1])
  with pytest.raises(ValueError, match="1-D"):
    tok.decode(np.zeros((2, 3), np.int32))
  with pytest.raises(ValueError, match="integer"):
    tok.decode(np.array([4.0, 5.0]))


def test_byte_batch_encode_and_hashable():
  tok = ByteTokenizer()
  assert tok.batch_encode(["a", "bc"]) == [[97 + 4], [98 + 4, 99 + 4]]
  assert hash(tok) == hash(ByteTokenizer()) and tok == ByteTokenizer()


# -- CharTokenizer --------------------------------------------------------------------------


def test_char_layout_and_round_trip():
  tok = CharTokenizer("ab=")
  assert tok.vocab_size == 7
  assert tok.encode("ba=a") == [5, 4, 6, 4]
  assert tok.decode([1, 5, 4, 3, 2, 0]) == "ba"
  assert tok.decode([1, 5, 3], skip_special=False) == "<|bos|>b<|mask|>"
  full = CharTokenizer(TASK_ALPHABET)
  text = "12*34=12*30+12*4=360+48=408\nsort zyx=xyz #"
  assert full.decode(full.encode(text)) == text


def test_char_errors():
  tok = CharTokenizer("0123456789")
  with pytest.raises(ValueError, match="'x'"):
    tok.encode("12x")
  with pytest.raises(ValueError, match="outside"):
    tok.decode([14])
  with pytest.raises(ValueError, match="repeats 'a'"):
    CharTokenizer("abca")
  with pytest.raises(ValueError, match="non-empty"):
    CharTokenizer("")


def test_char_is_hashable_by_alphabet():
  assert hash(CharTokenizer("ab")) == hash(CharTokenizer("ab"))
  assert CharTokenizer("ab") == CharTokenizer("ab") != CharTokenizer("ba")


# -- HFTokenizer ----------------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|mdm_mask|>", "<|pad|>", "<|eot_id|>"]


def _train_bpe(path, specials):
  import pydoc_data.topics
  from tokenizers import Tokenizer as RawTokenizer
  from tokenizers import decoders, models, pre_tokenizers, trainers

  raw = RawTokenizer(models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  raw.train_from_iterator(list(pydoc_data.topics.topics.values())[:20], trainer)
  raw.save(str(path))
  return raw


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("bpe")
  _train_bpe(folder / "tokenizer.json", SPECIALS)
  return folder


def test_hf_resolves_specials_by_name(bpe_dir):
  tok = HFTokenizer.from_file(bpe_dir / "tokenizer.json")
  assert (tok.eos_id, tok.mask_id, tok.pad_id, tok.eot_id) == (0, 1, 2, 3)
  assert tok.bos_id is None
  assert tok.vocab_size == 400
  _check_protocol(tok)
  assert HFTokenizer.from_file(bpe_dir).eos_id == 0  # a folder works too


@pytest.mark.parametrize("text", TEXTS)
def test_hf_round_trip(bpe_dir, text):
  tok = HFTokenizer.from_file(bpe_dir)
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.batch_encode([text, "x"]) == [ids, tok.encode("x")]


def test_hf_decode_skips_specials(bpe_dir):
  tok = HFTokenizer.from_file(bpe_dir)
  ids = tok.encode("hi") + [tok.eos_id, tok.mask_id]
  assert tok.decode(ids) == "hi"
  assert tok.decode(ids, skip_special=False) == "hi<|endoftext|><|mdm_mask|>"
  with pytest.raises(ValueError, match="outside"):
    tok.decode([tok.vocab_size])


def test_hf_explicit_and_config_tokens(bpe_dir, tmp_path):
  tok = HFTokenizer.from_file(bpe_dir, eos_token="<|eot_id|>", pad_token="<|endoftext|>")
  assert (tok.eos_id, tok.pad_id) == (3, 0)
  (tmp_path / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(
      json.dumps({"eos_token": {"content": "<|eot_id|>"}, "pad_token": "<|mdm_mask|>"}))
  tok = HFTokenizer.from_file(tmp_path)
  assert (tok.eos_id, tok.pad_id) == (3, 1)


def test_hf_missing_tokens(tmp_path, bpe_dir):
  with pytest.raises(ValueError, match="bos token '<s>' is not in the vocabulary"):
    HFTokenizer.from_file(bpe_dir, bos_token="<s>")
  _train_bpe(tmp_path / "tokenizer.json", ["<|pad|>"])
  with pytest.raises(ValueError, match="found no EOS token"):
    HFTokenizer.from_file(tmp_path)
  tok = HFTokenizer.from_file(tmp_path, eos_token="<|pad|>")
  assert tok.pad_id == 0 and tok.eot_id == tok.eos_id == 0
  with pytest.raises(ValueError, match="has no mask token"):
    _ = tok.mask_id
  with pytest.raises(FileNotFoundError, match="no tokenizer file"):
    HFTokenizer.from_file(tmp_path / "missing.json")


def _check_protocol(tok):
  members = [m for m in Tokenizer.__dict__ if not m.startswith("_")]
  assert {"vocab_size", "mask_id", "encode", "decode", "batch_encode"} <= set(members)
  for member in members:
    assert hasattr(tok, member), member


def test_protocol_is_satisfied_by_builtins():
  _check_protocol(ByteTokenizer())
  _check_protocol(CharTokenizer("ab"))
