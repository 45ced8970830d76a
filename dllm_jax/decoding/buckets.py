"""Prompt-length and batch buckets: a few static shapes, so a server compiles a few times.

Shape legend: B batch, P padded prompt length, Bb / Pb their buckets.

Every jitted decoder compiles once per (B, P). `generate` pads the prompt batch to the
smallest bucket that holds it: the prompt length to a power of two from 16 (`PROMPT_BUCKETS`,
extra LEFT padding, which no decoder can see: positions come from the valid mask), the batch
to a power of two (extra rows repeat the last row, finish with it, and are dropped from the
output). So prompts of every length inside one bucket, and batches of every size inside one
bucket, share one compile and give the tokens of the unbucketed call.

Overrides: `pad_to=` a length or a list of lengths, `batch_buckets=` a list of sizes, `None`
for exact shapes. A prompt bucket is capped so that bucket + gen_length still fits the model
window; when it would not, the exact length is used instead (never an error the unbucketed
call would not raise).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PROMPT_BUCKETS = "pow2"   # 16, 32, 64, ... (the default for pad_to)
BATCH_BUCKETS = "pow2"    # 1, 2, 4, 8, ... (the default for batch_buckets)
MIN_PROMPT_BUCKET = 16


def _pow2_at_least(n: int, low: int = 1) -> int:
  return max(low, 1 << max(0, int(n) - 1).bit_length())


def _check_list(name: str, buckets) -> tuple[int, ...]:
  if isinstance(buckets, (int, np.integer)) and not isinstance(buckets, bool):
    buckets = (buckets,)
  if not isinstance(buckets, Sequence) or isinstance(buckets, str) or not buckets or not all(
      isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b > 0 for b in buckets):
    raise ValueError(f"{name}={buckets!r} must be a positive int, a non-empty list of "
                     f"positive ints, {'pow2'!r} (powers of two) or None (exact shapes).")
  return tuple(sorted(int(b) for b in buckets))


def bucket(n: int, buckets, *, low: int = 1, cap: int | None = None) -> int:
  """The smallest bucket >= n (n itself when none is, or the bucket exceeds `cap`).

  `buckets`: "pow2" (powers of two, at least `low`), an int or a list of ints, or None
  (exact: n).
  """
  if buckets is None:
    return n
  if isinstance(buckets, str):
    if buckets != "pow2":
      raise ValueError(f"unknown bucket rule {buckets!r}; use 'pow2', an int, a list of "
                       "ints or None.")
    size = _pow2_at_least(n, low)
  else:
    size = next((b for b in _check_list("buckets", buckets) if b >= n), n)
  return n if cap is not None and size > cap else size


def prompt_length(p: int, gen_length: int, max_seq_len: int, pad_to=PROMPT_BUCKETS) -> int:
  """The padded prompt length for a P-token batch: its bucket, capped so that
  bucket + gen_length <= max_seq_len (else P itself)."""
  if pad_to is not None and not isinstance(pad_to, str):
    _check_list("pad_to", pad_to)
  return bucket(p, pad_to, low=MIN_PROMPT_BUCKET, cap=max_seq_len - gen_length)


def batch_size(b: int, batch_buckets=BATCH_BUCKETS, multiple: int = 1) -> int:
  """The padded batch size: its bucket, rounded up to a multiple of `multiple` (the
  data-parallel size)."""
  if batch_buckets is not None and not isinstance(batch_buckets, str):
    _check_list("batch_buckets", batch_buckets)
  size = bucket(b, batch_buckets)
  return -(-size // multiple) * multiple


def pad_batch(tokens: np.ndarray, valid: np.ndarray, length: int, rows: int, pad_id: int):
  """Left-pads [B, P] prompts to [rows, length]: extra columns are invisible padding, extra
  rows repeat the last row (drop them from the output)."""
  b, p = tokens.shape
  if length < p or rows < b:
    raise ValueError(f"cannot pad a [{b}, {p}] batch down to [{rows}, {length}].")
  tokens = np.concatenate([np.full((b, length - p), pad_id, np.int32), tokens], axis=1)
  valid = np.concatenate([np.zeros((b, length - p), bool), valid], axis=1)
  if rows > b:
    tokens = np.concatenate([tokens, np.repeat(tokens[-1:], rows - b, 0)])
    valid = np.concatenate([valid, np.repeat(valid[-1:], rows - b, 0)])
  return tokens, valid
