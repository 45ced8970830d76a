"""A choice's text as its tokens arrive, cut at stop strings exactly as `Sampler` cuts.

The final text is `cut_at_stop(decode_text(tokens), stop)` (what `Sampler.sample` returns
for the same tokens); while streaming, the visible text is that cut of the tokens so far,
less the trailing characters a later token may change (`held_back`: an unfinished UTF-8
character, and the start of a stop string before it). So the deltas concatenate to the final
text.
"""

from __future__ import annotations

from collections.abc import Sequence

from dllm_jax import sampler as sampler_lib


def held_back(text: str, stop: Sequence[str]) -> int:
  """Trailing characters a stream must not show yet: unfinished UTF-8 characters (U+FFFD
  from a cut byte sequence) and, before them, the start of a stop string that the next
  tokens may complete (`sampler._held_back` on the text without the U+FFFD tail)."""
  head = text.rstrip("\ufffd")
  return len(text) - len(head) + sampler_lib._held_back(head, stop)


class StopText:
  """Accumulates one choice's tokens; `add` and `finish` return the text to show next."""

  def __init__(self, tokenizer, stop: Sequence[str]):
    self.tokenizer, self.stop = tokenizer, tuple(stop)
    self.tokens: list[int] = []
    self.shown = ""
    self.stopped = False  # a stop string appeared: the text is final

  def _cut(self) -> tuple[str, bool]:
    return sampler_lib.cut_at_stop(sampler_lib.decode_text(self.tokenizer, self.tokens),
                                   self.stop)

  def add(self, new_tokens: Sequence[int]) -> str:
    """Appends tokens; returns the newly visible text (may be empty)."""
    self.tokens.extend(int(t) for t in new_tokens)
    if self.stopped or not new_tokens:
      return ""
    text, self.stopped = self._cut()
    if not self.stopped:
      text = text[:len(text) - held_back(text, self.stop)]
    delta = text[len(self.shown):] if text.startswith(self.shown) else ""
    self.shown += delta
    return delta

  def finish(self, tokens: Sequence[int] | None = None) -> str:
    """The rest of the final text (the choice's final tokens, if given, replace those added)."""
    if tokens is not None and not self.stopped:
      self.tokens = [int(t) for t in tokens]
    text, stopped = self._cut()
    self.stopped = self.stopped or stopped
    delta = sampler_lib._final_delta(text, self.shown)
    self.shown += delta
    return delta

  @property
  def text(self) -> str:
    return self.shown
