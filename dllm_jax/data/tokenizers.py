"""Tokenizers behind one small protocol: built-in byte and character vocabularies, and HF files.

Every tokenizer maps `str -> list[int]` and back and names its special ids, so the pipeline,
the trainers and the decoders never hard-code an id:

  pad_id    fills unused positions            mask_id  the diffusion [MASK] token
  bos_id    optional start of sequence         eos_id   end of sequence (also the LLaDA pad)
  eot_id    end of a chat turn (may equal eos_id)

`ByteTokenizer` (260 ids) and `CharTokenizer` (4 + len(alphabet) ids) share a fixed layout:
PAD=0, BOS=1, EOS=2, MASK=3, then the symbols. `HFTokenizer` wraps a local `tokenizer.json`
and looks its special ids up by name. Decoding never stops at EOS: stop handling belongs to
the caller, who knows where the response starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3
NUM_SPECIAL = 4
_SPECIAL_NAMES = ("<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>")


class Tokenizer(Protocol):
  """What the data pipeline and the decoders need from a tokenizer (a static type only:
  `HFTokenizer.mask_id` raises when there is no mask token, so isinstance checks would too)."""

  @property
  def vocab_size(self) -> int: ...
  @property
  def pad_id(self) -> int: ...
  @property
  def bos_id(self) -> int | None: ...
  @property
  def eos_id(self) -> int: ...
  @property
  def eot_id(self) -> int: ...
  @property
  def mask_id(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...
  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...
  def batch_encode(self, texts: Sequence[str]) -> list[list[int]]: ...


def _as_int_list(ids: Iterable[int]) -> list[int]:
  """Accepts lists, tuples and numpy/JAX integer arrays (1-D)."""
  arr = np.asarray(ids)
  if arr.ndim != 1:
    raise ValueError(f"decode expects a 1-D sequence of ids, got shape {arr.shape}; "
                     "decode one row at a time (e.g. [tok.decode(r) for r in tokens_BxL])")
  if arr.size and not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"decode expects integer ids, got dtype {arr.dtype}")
  return [int(i) for i in arr]


def _check_range(ids: list[int], vocab_size: int, name: str) -> None:
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"{name}.decode got id {bad[0]} outside [0, {vocab_size}); if the model's "
                     "vocabulary is padded past the tokenizer's, mask those logits before sampling")


class _FixedSpecials:
  """Special ids of the built-in vocabularies (PAD=0, BOS=1, EOS=2, MASK=3)."""

  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID
  eot_id = EOS_ID
  mask_id = MASK_ID

  def batch_encode(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]


@dataclasses.dataclass(frozen=True)
class ByteTokenizer(_FixedSpecials):
  """UTF-8 bytes as tokens: id = byte + 4, so `vocab_size == 260`; encodes any text."""

  @property
  def vocab_size(self) -> int:
    return NUM_SPECIAL + 256

  def encode(self, text: str) -> list[int]:
    return [b + NUM_SPECIAL for b in text.encode("utf-8")]

  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
    """Bytes back to text; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
    ids = _as_int_list(ids)
    _check_range(ids, self.vocab_size, "ByteTokenizer")
    out, run = [], bytearray()
    for i in ids:
      if i >= NUM_SPECIAL:
        run.append(i - NUM_SPECIAL)
        continue
      if not skip_special:
        out.append(run.decode("utf-8", errors="replace"))
        out.append(_SPECIAL_NAMES[i])
        run = bytearray()
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class CharTokenizer(_FixedSpecials):
  """One id per character of `alphabet` (id = position + 4): tiny vocabularies learn fastest.

  Unknown characters raise ValueError naming the character; build the alphabet from the data
  (e.g. `dllm_jax.data.tasks.TASK_ALPHABET` covers every synthetic task).
  """

  alphabet: str
  _index: dict[str, int] = dataclasses.field(init=False, repr=False, compare=False, hash=False)

  def __post_init__(self):
    if not isinstance(self.alphabet, str) or not self.alphabet:
      raise ValueError(f"CharTokenizer needs a non-empty alphabet string, got {self.alphabet!r}")
    index = {}
    for pos, ch in enumerate(self.alphabet):
      if ch in index:
        raise ValueError(f"CharTokenizer alphabet repeats {ch!r} (positions {index[ch] - 4} "
                         f"and {pos}); list each character once")
      index[ch] = pos + NUM_SPECIAL
    object.__setattr__(self, "_index", index)

  @property
  def vocab_size(self) -> int:
    return NUM_SPECIAL + len(self.alphabet)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._index[ch] for ch in text]
    except KeyError as e:
      raise ValueError(f"CharTokenizer cannot encode {e.args[0]!r} (in {text[:40]!r}): it is not "
                       f"in the alphabet {self.alphabet!r}; add it to the alphabet") from None

  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
    ids = _as_int_list(ids)
    _check_range(ids, self.vocab_size, "CharTokenizer")
    out = []
    for i in ids:
      if i >= NUM_SPECIAL:
        out.append(self.alphabet[i - NUM_SPECIAL])
      elif not skip_special:
        out.append(_SPECIAL_NAMES[i])
    return "".join(out)


# Names seen in public checkpoints, tried in order when tokenizer_config.json is silent.
_CANDIDATES = {
    "eos": ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]"),
    "bos": ("<|startoftext|>", "<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "[CLS]"),
    "pad": ("<|pad|>", "<pad>", "[PAD]", "<|padding|>"),
    "mask": ("<|mdm_mask|>", "<|mask|>", "<mask>", "[MASK]"),
    "eot": ("<|eot_id|>", "<|im_end|>", "<end_of_turn>"),
}


def _config_token(config: dict, kind: str) -> str | None:
  value = config.get(f"{kind}_token")
  if isinstance(value, dict):  # {"content": "<|endoftext|>", ...} in older files
    value = value.get("content")
  return value if isinstance(value, str) else None


class HFTokenizer:
  """A local `tokenizer.json` (Hugging Face `tokenizers`) with special ids looked up by name.

  Each special token comes from, in order: the keyword given to `from_file`, the
  `tokenizer_config.json` next to the file, then common names (`<|endoftext|>`, `<|mdm_mask|>`,
  ...). EOS is required. PAD falls back to EOS (as for Llama-style models), EOT to EOS, BOS may
  be absent (`bos_id is None`), and reading `mask_id` without a mask token raises.
  """

  def __init__(self, tokenizer, *, eos_token: str, pad_token: str | None = None,
               bos_token: str | None = None, mask_token: str | None = None,
               eot_token: str | None = None, source: str = "<tokenizer>"):
    self._tok = tokenizer
    self.source = source
    self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
    self.mask_token, self.eot_token = mask_token, eot_token
    self._eos = self._require(eos_token, "eos")
    self._pad = self._require(pad_token, "pad") if pad_token is not None else self._eos
    self._bos = self._require(bos_token, "bos") if bos_token is not None else None
    self._mask = self._require(mask_token, "mask") if mask_token is not None else None
    self._eot = self._require(eot_token, "eot") if eot_token is not None else self._eos

  @classmethod
  def from_file(cls, path: str | os.PathLike, *, mask_token: str | None = None,
                eos_token: str | None = None, pad_token: str | None = None,
                bos_token: str | None = None, eot_token: str | None = None) -> "HFTokenizer":
    """Loads `path` (a tokenizer.json, or a folder holding one) and resolves special tokens."""
    from tokenizers import Tokenizer as _RawTokenizer

    path = os.fspath(path)
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no tokenizer file at {path!r}; pass the path of a tokenizer.json "
                              "or of the checkpoint folder that holds it")
    raw = _RawTokenizer.from_file(path)
    config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
      with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    vocab = raw.get_vocab(with_added_tokens=True)

    def resolve(kind: str, given: str | None) -> str | None:
      if given is not None:
        return given
      named = _config_token(config, kind)
      if named is not None and named in vocab:
        return named
      return next((c for c in _CANDIDATES[kind] if c in vocab), None)

    eos = resolve("eos", eos_token)
    if eos is None:
      raise ValueError(f"{path}: found no EOS token (tried tokenizer_config.json and "
                       f"{_CANDIDATES['eos']}); pass eos_token='...' to HFTokenizer.from_file")
    return cls(raw, eos_token=eos, pad_token=resolve("pad", pad_token),
               bos_token=resolve("bos", bos_token), mask_token=resolve("mask", mask_token),
               eot_token=resolve("eot", eot_token), source=path)

  def _require(self, token: str, kind: str) -> int:
    idx = self._tok.token_to_id(token)
    if idx is None:
      raise ValueError(f"{self.source}: {kind} token {token!r} is not in the vocabulary; pass "
                       f"{kind}_token= with a token the tokenizer knows")
    return idx

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def bos_id(self) -> int | None:
    return self._bos

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def eot_id(self) -> int:
    return self._eot

  @property
  def mask_id(self) -> int:
    if self._mask is None:
      raise ValueError(f"{self.source} has no mask token, which diffusion models need; pass "
                       "mask_token='<|mdm_mask|>' (LLaDA) or the model's mask token to from_file")
    return self._mask

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def batch_encode(self, texts: Sequence[str]) -> list[list[int]]:
    return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
    ids = _as_int_list(ids)
    _check_range(ids, self.vocab_size, "HFTokenizer")
    return self._tok.decode(ids, skip_special_tokens=skip_special)

  def __repr__(self) -> str:
    return (f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size}, eos={self.eos_token!r}, "
            f"pad={self.pad_token!r}, bos={self.bos_token!r}, mask={self.mask_token!r})")
