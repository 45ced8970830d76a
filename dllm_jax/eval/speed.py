"""The decode speed the lm-eval model reports beside each task's score.

Counted per batched decode: response tokens (each row's tokens before its first stop token,
`DecodeOutput.lengths`; never the prompt), the forwards of the batched decode (NFE, one
batched call counts once) and its wall time. Per task:

  tokens_per_s         response tokens / wall time of every decode, compiles included
  steady_tokens_per_s  the same over the decodes whose shape bucket was already compiled
                       (None while every decode compiled)
  nfe                  forwards summed over the decodes
  tokens_per_forward   response tokens / (forwards x rows): what one row gains per forward
                       (1 for AR without drafting, up to block length for diffusion)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Speed:
  """Running totals of one task's decodes."""
  prompts: int = 0
  decodes: int = 0
  response_tokens: int = 0
  nfe: int = 0
  row_forwards: int = 0
  wall_s: float = 0.0
  steady_tokens: int = 0
  steady_wall_s: float = 0.0

  def add(self, *, rows: int, tokens: int, nfe: int, wall_s: float, compiled: bool) -> None:
    self.prompts += rows
    self.decodes += 1
    self.response_tokens += tokens
    self.nfe += nfe
    self.row_forwards += nfe * rows
    self.wall_s += wall_s
    if not compiled:
      self.steady_tokens += tokens
      self.steady_wall_s += wall_s

  def merge(self, other: "Speed") -> "Speed":
    return Speed(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                    for f in dataclasses.fields(self)})

  def summary(self) -> dict:
    steady = (self.steady_tokens / self.steady_wall_s if self.steady_wall_s > 0 else None)
    return {"prompts": self.prompts, "decodes": self.decodes,
            "response_tokens": self.response_tokens, "wall_s": round(self.wall_s, 6),
            "tokens_per_s": self.response_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "steady_tokens_per_s": steady, "nfe": self.nfe,
            "tokens_per_forward": self.response_tokens / max(self.row_forwards, 1)}

  def line(self, label: str) -> str:
    s = self.summary()
    steady = ("" if s["steady_tokens_per_s"] is None
              else f" ({s['steady_tokens_per_s']:.1f} without compiles)")
    return (f"{label}: {s['prompts']} prompts, {s['response_tokens']} response tokens in "
            f"{s['wall_s']:.2f}s = {s['tokens_per_s']:.1f} tok/s{steady}, NFE {s['nfe']}, "
            f"{s['tokens_per_forward']:.2f} tokens/forward")


class SpeedMeter:
  """Speeds per task, and which decode shapes have been compiled."""

  def __init__(self):
    self.tasks: dict[str, Speed] = {}
    self._shapes: set = set()

  def first_of_shape(self, key) -> bool:
    """Whether a decode of this shape bucket runs for the first time (so it compiles)."""
    new = key not in self._shapes
    self._shapes.add(key)
    return new

  def add(self, task: str, **counts) -> None:
    self.tasks.setdefault(task, Speed()).add(**counts)

  def total(self) -> Speed:
    out = Speed()
    for speed in self.tasks.values():
      out = out.merge(speed)
    return out

  def report(self) -> dict:
    """{"per_task": {task: summary}, "total": summary} (what the results JSON carries)."""
    return {"per_task": {t: s.summary() for t, s in sorted(self.tasks.items())},
            "total": self.total().summary()}
