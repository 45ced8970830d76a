"""What a client hands the engine and gets back: requests, results, stream updates, errors.

A request is checked when it is submitted (`Engine.submit`); a bad one is answered at once
with a `Result` whose `error` is one of the named `RequestError` subclasses below, and never
reaches a slot, so it cannot disturb the requests being decoded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


class RequestError(ValueError):
  """A request the engine refuses; the message names the problem and the fix."""


class UnknownMethodError(RequestError):
  """The request names a decoding method the engine does not serve."""


class BadOptionError(RequestError):
  """An option, max_new_tokens, stop ids or the seed is invalid for the request's method."""


class QueueFullError(RequestError):
  """The request's lane already holds `max_queue` requests waiting for a slot (backpressure:
  retry later)."""


class PromptTooLongError(RequestError):
  """The prompt does not fit the engine's largest prompt bucket / the model window."""


class MaskInPromptError(RequestError):
  """A diffusion request's prompt holds the model's [MASK] id."""


class InvalidPromptError(RequestError):
  """The prompt is empty, not token ids, holds ids outside the vocabulary, or is text with no
  tokenizer to encode it."""


class NonFiniteRowError(RequestError):
  """The model produced NaN/inf logits for this request's row (its tokens mean nothing)."""


class CancelledError(RequestError):
  """The request was cancelled (`Engine.cancel`) before it finished."""


@dataclasses.dataclass(frozen=True)
class Request:
  """One checked request, as queued.

  Attributes:
    id: the engine's request id (submission order).
    prompt: the prompt token ids.
    method: decoding method (a lane of the engine).
    max_new_tokens: most response tokens returned (<= the lane's gen_length).
    stop_ids: extra stop tokens: the response is cut before the first one (the model's own
      EOS / end-of-turn always stop).
    seed: the request's sampling seed; its row's randomness depends only on it.
    arrival: `time.perf_counter()` at submission.
    row_input: what the lane's decoder reads from the request's per-row options
      (`RowDecoder.row_input`; adaptive: the mode its task tag forces, -1 for none).
    traced: the request's traced options ([] leaves: temperature, top_p, thresholds, ...),
      which its row decodes with (`Lane.resolve`).
  """
  id: int
  prompt: tuple[int, ...]
  method: str
  max_new_tokens: int
  stop_ids: tuple[int, ...]
  seed: int
  arrival: float
  row_input: int = 0
  traced: Any = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class StreamUpdate:
  """Tokens a request committed since its last update (its response prefix grew).

  Attributes:
    request_id: the request.
    new_tokens: ids appended to the response prefix now.
    done: the request finished with this update.
  """
  request_id: int
  new_tokens: tuple[int, ...]
  done: bool


@dataclasses.dataclass(frozen=True)
class Result:
  """A finished request.

  Attributes:
    request_id: the request.
    tokens: response tokens, cut before the first stop token and at max_new_tokens.
    status: "ok", "cancelled" or "error".
    error: the RequestError of a refused / failed / cancelled request, else None.
    text: the decoded text when the engine has a tokenizer.
    nfe: forwards the request's row was live in (its own model calls).
    ttft: seconds from arrival to the first streamed token (None if none).
    latency: seconds from arrival to the result.
    queued: seconds from arrival to admission into a slot (None if never admitted).
  """
  request_id: int
  tokens: tuple[int, ...] = ()
  status: str = "ok"
  error: RequestError | None = None
  text: str | None = None
  nfe: int = 0
  ttft: float | None = None
  latency: float = 0.0
  queued: float | None = None

  @property
  def ok(self) -> bool:
    return self.status == "ok"

  def raise_for_error(self) -> Result:
    """Raises the request's error (if any); returns self otherwise."""
    if self.error is not None:
      raise self.error
    return self


def check_seed(seed) -> int:
  if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or \
      not 0 <= int(seed) < 2 ** 32:
    raise BadOptionError(f"seed must be an int in [0, 2**32), got {seed!r}.")
  return int(seed)


def check_stop_ids(stop_ids, vocab_size: int) -> tuple[int, ...]:
  try:
    ids = tuple(int(i) for i in stop_ids)
    ok = all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))
             for i in stop_ids)
  except (TypeError, ValueError):
    ok = False
  if not ok or any(not 0 <= i < vocab_size for i in ids):
    raise BadOptionError(f"stop_ids must be token ids in [0, {vocab_size}), got {stop_ids!r}.")
  return ids
