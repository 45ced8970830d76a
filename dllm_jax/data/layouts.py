"""Token layouts: how a record becomes one fixed-length row of a training batch.

Shape legend: L sequence length (`seq_len`), P fixed prompt length (`prompt_len`).

Every row is a dict of 1-D numpy arrays of length L:

  tokens       int32  token ids
  positions    int32  RoPE positions (see below)
  valid        bool   True on tokens that may be attended to (False on padding to ignore)
  segment_ids  int32  0 on ignored padding; 1 on an SFT example; 1, 2, ... per packed document
  prompt_mask  bool   BOS and prompt tokens (never noised, never trained on)
  answer_mask  bool   answer tokens and the terminator that ends them
  loss_mask    bool   tokens to predict: answer_mask plus, with pad="eos", the EOS padding

`SFTLayout` (prompt/answer pairs):

  free prompt:   BOS prompt answer EOS | pad ... pad                   answer starts per row
  prompt_len=P:  PAD ... PAD BOS prompt | answer EOS pad ... pad       answer starts at P

Fixing P left-pads every prompt into [0, P) so the answer always occupies [P, L): block
diffusion and D2F train and decode on that canvas. `pad="eos"` (the default) pads the right
end with EOS tokens that are valid and trained on, as LLaDA's SFT does, so the model learns to
fill unused answer slots with EOS; `pad="pad"` pads with PAD, which is ignored. Left padding is
always PAD and ignored. Positions count real tokens from the first one (padding on the left gets
0), i.e. `masks.left_pad_positions(valid)`, the rule decoders use for left-padded prompts.
Diffusion objectives corrupt exactly the `loss_mask` positions; an AR loss predicts token t+1
at position t and weights it by `loss_mask[t+1]`.

`PackedLayout` (plain text): documents, each followed by EOS (and preceded by BOS if asked),
are concatenated and cut into rows of L tokens; a document may continue on the next row.
Positions are 0..L-1 and every token is valid and trained on; `segment_ids` number the pieces
for models that want document masking.

Examples that do not fit raise `TooLongError` (a ValueError); nothing is silently truncated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from dllm_jax.data.tasks import TaskSuite
from dllm_jax.data.tokenizers import Tokenizer

Row = dict[str, np.ndarray]
ROW_KEYS = ("tokens", "positions", "valid", "segment_ids", "prompt_mask", "answer_mask",
            "loss_mask")
PAD_MODES = ("eos", "pad")
TERMINATORS = ("eos", "eot")


class Spans(NamedTuple):
  """One SFT record placed on the canvas: ids fill [left, end); the answer starts at start."""
  ids: list[int]
  left: int
  start: int
  end: int


class TooLongError(ValueError):
  """A record does not fit the layout (pass drop_long=True to the iterator to skip it)."""


def left_pad_positions(valid: np.ndarray) -> np.ndarray:
  """[..., L] bool -> int32 positions: real tokens count 0, 1, ...; leading padding gets 0."""
  return np.maximum(np.cumsum(valid.astype(np.int32), axis=-1) - 1, 0).astype(np.int32)


def _text(record: Mapping[str, Any], key: str) -> str:
  try:
    value = record[key]
  except KeyError:
    raise KeyError(f"record has no field {key!r} (fields: {sorted(record)}); set the layout's "
                   f"key arguments to the source's field names") from None
  return value.decode("utf-8") if isinstance(value, bytes) else value


def _check_len(name: str, value: int | None, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SFTLayout:
  """Prompt/answer records -> rows `[BOS] prompt answer terminator` padded to `seq_len`."""

  tokenizer: Tokenizer
  seq_len: int
  prompt_len: int | None = None
  add_bos: bool = True
  pad: str = "eos"
  terminator: str = "eos"
  prompt_key: str = "prompt"
  answer_key: str = "answer"

  def __post_init__(self):
    _check_len("seq_len", self.seq_len)
    _check_len("prompt_len", self.prompt_len, allow_none=True)
    if self.prompt_len is not None and self.prompt_len >= self.seq_len:
      raise ValueError(f"prompt_len={self.prompt_len} leaves no room for the answer in "
                       f"seq_len={self.seq_len}; make seq_len larger than prompt_len")
    if self.pad not in PAD_MODES:
      raise ValueError(f"pad must be one of {PAD_MODES}, got {self.pad!r}")
    if self.terminator not in TERMINATORS:
      raise ValueError(f"terminator must be one of {TERMINATORS}, got {self.terminator!r}")
    if self.add_bos and self.tokenizer.bos_id is None:
      raise ValueError(f"{self.tokenizer!r} has no BOS token; use add_bos=False")

  @classmethod
  def for_suite(cls, tokenizer: Tokenizer, suite: TaskSuite, *, fixed_prompt: bool = True,
                block_size: int | None = None, gen_length: int | None = None,
                **kwargs) -> "SFTLayout":
    """A layout every example of `suite` fits (task lengths bound byte-level token counts).

    With `fixed_prompt`, P = longest prompt (+ BOS). The answer region G is `gen_length`
    slots when given (it must hold the longest answer + terminator and be a multiple of
    `block_size`: a G set above the answers, as LLaDA's generation lengths are), else the
    longest answer + terminator rounded up to a multiple of `block_size` when given.
    """
    add_bos = kwargs.get("add_bos", True)
    prompt_len = suite.max_prompt_len + int(add_bos)
    needed = suite.max_answer_len + 1
    if block_size is not None:
      _check_len("block_size", block_size)
    if gen_length is None:
      gen_length = needed if block_size is None else -(-needed // block_size) * block_size
    else:
      _check_len("gen_length", gen_length)
      if gen_length < needed:
        raise ValueError(f"gen_length={gen_length} cannot hold the longest answer and its "
                         f"terminator ({needed} tokens); set it to at least {needed} or "
                         "leave it unset")
      if block_size is not None and gen_length % block_size:
        raise ValueError(f"gen_length={gen_length} is not a multiple of block_size="
                         f"{block_size}; use {-(-gen_length // block_size) * block_size}")
    return cls(tokenizer, seq_len=prompt_len + gen_length,
               prompt_len=prompt_len if fixed_prompt else None, **kwargs)

  @property
  def _head(self) -> list[int]:
    return [self.tokenizer.bos_id] if self.add_bos else []

  @property
  def _end_id(self) -> int:
    return self.tokenizer.eos_id if self.terminator == "eos" else self.tokenizer.eot_id

  def spans(self, record: Mapping[str, Any]) -> Spans:
    """Tokenizes one record and places it; raises TooLongError if it won't fit."""
    tok, L = self.tokenizer, self.seq_len
    prompt = self._head + tok.encode(_text(record, self.prompt_key))
    answer = tok.encode(_text(record, self.answer_key)) + [self._end_id]
    if self.prompt_len is not None:
      if len(prompt) > self.prompt_len:
        raise TooLongError(f"prompt has {len(prompt)} tokens (with BOS) > prompt_len="
                           f"{self.prompt_len}; raise prompt_len or pass drop_long=True")
      left = self.prompt_len - len(prompt)
    else:
      left = 0
    start = left + len(prompt)
    end = start + len(answer)
    if end > L:
      raise TooLongError(f"example needs {end} tokens (prompt region {start}, answer + "
                         f"terminator {len(answer)}) > seq_len={L}; raise seq_len or pass "
                         "drop_long=True")
    return Spans(prompt + answer, left, start, end)

  def empty_spans(self) -> Spans:
    """A padding row: nothing valid, nothing trained on."""
    return Spans([], self.seq_len, self.seq_len, self.seq_len)

  def assemble(self, spans: Sequence[Spans]) -> Row:
    """Placed records -> `[B, L]` arrays (masks computed for the whole batch at once)."""
    tok, L = self.tokenizer, self.seq_len
    tokens = np.full((len(spans), L), tok.eos_id if self.pad == "eos" else tok.pad_id, np.int32)
    for row, sp in enumerate(spans):
      tokens[row, :sp.left] = tok.pad_id
      tokens[row, sp.left:sp.end] = sp.ids
    idx = np.arange(L)[None, :]
    left, start, end = (np.array([getattr(sp, f) for sp in spans])[:, None]
                        for f in ("left", "start", "end"))
    valid = idx >= left if self.pad == "eos" else (idx >= left) & (idx < end)
    answer_mask = (idx >= start) & (idx < end)
    loss_mask = answer_mask | ((idx >= end) & (self.pad == "eos"))
    return {"tokens": tokens, "positions": left_pad_positions(valid), "valid": valid,
            "segment_ids": valid.astype(np.int32), "prompt_mask": (idx >= left) & (idx < start),
            "answer_mask": answer_mask, "loss_mask": loss_mask}

  def encode(self, record: Mapping[str, Any]) -> Row:
    """One record -> one row (see the module docstring); raises TooLongError if it won't fit."""
    return {k: v[0] for k, v in self.assemble([self.spans(record)]).items()}

  def encode_prompts(self, prompts: Sequence[str], length: int | None = None) -> Row:
    """Prompts for decoding: `[B, P]` left-padded `tokens`, `valid`, `positions`.

    P is `length`, else `prompt_len`, else the longest prompt of the batch. The answer canvas
    of a decoder then starts at P, as in training rows with a fixed prompt_len.
    """
    tok = self.tokenizer
    encoded = [self._head + ids for ids in tok.batch_encode(list(prompts))]
    if not encoded:
      raise ValueError("encode_prompts needs at least one prompt")
    P = length or self.prompt_len or max(len(e) for e in encoded)
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
    if len(encoded[longest]) > P:
      raise TooLongError(f"prompt {longest} has {len(encoded[longest])} tokens (with BOS) > "
                         f"prompt length {P}; pass a larger length")
    tokens = np.full((len(encoded), P), tok.pad_id, np.int32)
    valid = np.zeros((len(encoded), P), bool)
    for row, ids in enumerate(encoded):
      if ids:
        tokens[row, P - len(ids):] = ids
        valid[row, P - len(ids):] = True
    return {"tokens": tokens, "valid": valid, "positions": left_pad_positions(valid)}


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Text records -> documents `[BOS] text EOS`, concatenated into rows of `seq_len`."""

  tokenizer: Tokenizer
  seq_len: int
  text_key: str = "text"
  add_bos: bool = False

  def __post_init__(self):
    _check_len("seq_len", self.seq_len)
    if self.add_bos and self.tokenizer.bos_id is None:
      raise ValueError(f"{self.tokenizer!r} has no BOS token; use add_bos=False")

  def document(self, record: Mapping[str, Any]) -> list[int]:
    """The token ids one record contributes to the stream."""
    head = [self.tokenizer.bos_id] if self.add_bos else []
    return head + self.tokenizer.encode(_text(record, self.text_key)) + [self.tokenizer.eos_id]

  def row(self, pieces: Sequence[Sequence[int]]) -> Row:
    """Pieces of documents (in order, total <= L tokens) -> one row, PAD-filled at the end."""
    L = self.seq_len
    tokens = np.full(L, self.tokenizer.pad_id, np.int32)
    segment_ids = np.zeros(L, np.int32)
    at = 0
    for seg, piece in enumerate(pieces, start=1):
      tokens[at:at + len(piece)] = piece
      segment_ids[at:at + len(piece)] = seg
      at += len(piece)
    if at > L:
      raise ValueError(f"pieces hold {at} tokens > seq_len={L}")
    valid = segment_ids > 0
    false = np.zeros(L, bool)
    return {"tokens": tokens, "positions": np.arange(L, dtype=np.int32), "valid": valid,
            "segment_ids": segment_ids, "prompt_mask": false, "answer_mask": false.copy(),
            "loss_mask": valid.copy()}


def empty_row(layout: PackedLayout) -> Row:
  """An all-padding packed row (for the padded rows of a final eval batch)."""
  return layout.row([])
