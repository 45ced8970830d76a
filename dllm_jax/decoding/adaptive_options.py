"""The adaptive decoder's modes and options: the per-row mode codes, the task-tag map and
`AdaptiveOptions` (checked on construction, split into the static program key and the
traced thresholds).

The decoder itself: `decoding.adaptive` (docs/decoders.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from dllm_jax.decoding import adaptive_rule, base
from dllm_jax.decoding import speculative as spec

PARALLEL, VERIFY, AR, NO_ROUND = 0, 1, 2, -1
MODE_CODES = {"parallel": PARALLEL, "verify": VERIFY, "ar": AR}
TAG_MODES = ("auto",) + tuple(MODE_CODES)  # "auto": the tag leaves the choice to the rule
THRESHOLDS = adaptive_rule.THRESHOLDS


def _task_modes(value) -> tuple[tuple[str, str], ...]:
  """A {tag: mode} mapping (or pairs) -> sorted ((tag, mode), ...); ValueError if bad."""
  pairs = value.items() if isinstance(value, Mapping) or hasattr(value, "items") else value
  try:
    pairs = [(tag, mode) for tag, mode in pairs]
  except (TypeError, ValueError):
    raise ValueError(f"task_modes must map task tags to modes, e.g. {{'copy': 'parallel'}}; "
                     f"got {value!r}.") from None
  for tag, mode in pairs:
    if not isinstance(tag, str) or not tag:
      raise ValueError(f"task_modes: a task tag must be a non-empty string, got {tag!r}.")
    if mode not in TAG_MODES:
      raise ValueError(f"task_modes[{tag!r}]={mode!r}: use one of {TAG_MODES}.")
  if len({t for t, _ in pairs}) != len(pairs):
    raise ValueError(f"task_modes names a tag twice: {[t for t, _ in pairs]}.")
  return tuple(sorted(pairs))


@dataclasses.dataclass(frozen=True)
class AdaptiveOptions:
  """Options (hashable). The four thresholds and the target's sampling are traced: `split`
  moves them out of the jit key, so sweeping them (temperatures > 0) never recompiles.

  Attributes:
    gen_length: G, the most tokens generated per row.
    draft_length: k, tokens drafted per round (1 <= k <= G).
    draft_steps: drafter forwards per block (1..k; 1 is D2F's one-forward block).
    parallel_confidence: round 0 commits in parallel when c0 >= this (> 1: never).
    ar_confidence: round 0 decodes plain AR when c0 < this (0: never; > 1: always).
    min_acceptance: a VERIFY row whose accepted / drafted falls below this drops to AR
      (0: never; in [0, 1]).
    trust_streak: a VERIFY row whose last trust_streak rounds accepted whole drafts moves to
      PARALLEL (0: never).
    task_modes: {task tag: "auto" | "parallel" | "verify" | "ar"}; a row's tag (`tasks=`)
      forces its mode ("auto": the rule decides). Stored as sorted (tag, mode) pairs.
    temperature, top_k, top_p: the target's sampling in VERIFY / AR rounds (as
      `ar_generate`); PARALLEL rounds commit the drafter's greedy tokens.
    early_stop: exit once every row is done.
    batch_invariant: with draft_steps > 1 the drafter ranks its slots on
      `sampling.RANK_GRID`, so a row's drafts (its PARALLEL tokens, its acceptance) are the
      same alone and in a batch; False (default) ranks the exact scores.
  """
  gen_length: int = base.GEN_LENGTH
  draft_length: int = 4
  draft_steps: int = 1
  parallel_confidence: float = 0.9
  ar_confidence: float = 0.2
  min_acceptance: float = 0.25
  trust_streak: int = 4
  task_modes: tuple = ()
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  early_stop: bool = True
  batch_invariant: bool = False

  def __post_init__(self):
    object.__setattr__(self, "early_stop", base.check_flag("early_stop", self.early_stop))
    spec.check_draft_options(self)
    object.__setattr__(self, "batch_invariant",
                       base.check_flag("batch_invariant", self.batch_invariant))
    k = self.draft_length
    if isinstance(self.draft_steps, bool) or not isinstance(
        self.draft_steps, (int, np.integer)) or not 1 <= self.draft_steps <= k:
      raise ValueError(f"draft_steps={self.draft_steps!r} must be an int in [1, "
                       f"draft_length={k}].")
    for name in ("parallel_confidence", "ar_confidence"):
      base.check_number(name, getattr(self, name), low=0.0, allow_inf=True)
    base.check_number("min_acceptance", self.min_acceptance, low=0.0, high=1.0)
    t = self.trust_streak
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
      raise ValueError(f"trust_streak must be an int >= 0 (0: never trust), got {t!r}.")
    object.__setattr__(self, "task_modes", _task_modes(self.task_modes))

  @property
  def steps(self) -> int:  # what `drafters.diffusion_draft` reads
    return self.draft_steps

  def split(self):
    """(static options with canonical thresholds and sampling (`spec.split_sampling`) and no
    task map, {name: [] array})."""
    canonical = {"parallel_confidence": 0.9, "ar_confidence": 0.2, "min_acceptance": 0.25,
                 "trust_streak": 4, **spec.SAMPLING}
    return base.split_options(self, canonical, {"trust_streak": np.int32, "top_k": np.int32},
                              task_modes=())

  def forced_modes(self, tasks, batch: int) -> np.ndarray:
    """[B] int32 mode code each row's task tag forces, or -1 (no tag, or "auto")."""
    if tasks is None:
      return np.full((batch,), -1, np.int32)
    if isinstance(tasks, str) or not isinstance(tasks, Sequence):
      raise ValueError(f"tasks must be a list with one task tag (or None) per prompt, "
                       f"got {tasks!r}.")
    if len(tasks) != batch:
      raise ValueError(f"tasks has {len(tasks)} entries for {batch} prompts; pass one task "
                       "tag (or None) per prompt.")
    table = dict(self.task_modes)
    out = np.full((batch,), -1, np.int32)
    for row, tag in enumerate(tasks):
      if tag is None:
        continue
      if tag not in table:
        raise ValueError(f"unknown task tag {tag!r} (row {row}); task_modes knows "
                         f"{sorted(table)}. Add it to task_modes (mode 'auto' lets the rule "
                         "decide) or pass None.")
      out[row] = MODE_CODES.get(table[tag], -1)
    return out
