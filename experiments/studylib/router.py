"""Adaptive switching without task tags: a router that reads the prompt's text, fitted on the
calibration split only.

A user has the prompt, not the generator's task label. The router maps each prompt to its
*format*, the prompt with every digit written 9 and every letter after the leading keyword
written a (`37+48=` -> `99+99=`, `cum 77270=` -> `cum 99999=`, `sort 31420=` -> `sort 99999=`),
and each format seen on the calibration split to a decode mode:

    parallel | verify | ar | auto   (auto: the adaptive rule decides each round from the
                                      decode's own signals, drafter confidence and acceptance)

choosing, per format, the fastest mode whose accuracy on that format's calibration prompts is
within the tolerance of AR's (adaptive_calibration.choose_task_modes, keyed by format instead of
task). A format with fewer than `min_prompts` calibration prompts, and any format the
calibration split never showed, decodes AR (`FALLBACK`): the router never guesses. The
adaptive decoder takes the format as each row's tag (`tasks=`), with the fitted map as its
`task_modes`. The task-tag cell (the generator's labels) stays beside it as the oracle's upper
bound.
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Mapping, Sequence

import numpy as np

from studylib import adaptive_calibration

UNSEEN = "unseen format"  # the tag of a prompt whose format the calibration split lacked
FALLBACK = "ar"  # the mode of an unseen or rarely seen format
MODES = adaptive_calibration.CALIBRATED_MODES + ("auto",)  # tie-break order: first wins
MIN_PROMPTS = 4

_KEYWORD = re.compile(r"^[a-z]+ ")
# Every ASCII digit -> 9, every ASCII lowercase letter -> a (one pass: the router tags each
# prompt inside the timed call).
_FORMAT = str.maketrans({**dict.fromkeys(string.digits, "9"),
                         **dict.fromkeys(string.ascii_lowercase, "a")})


def prompt_format(prompt: str) -> str:
  """The prompt's format: a leading keyword (`sort `, `cum `) kept, every other digit 9 and
  every other letter a."""
  head = _KEYWORD.match(prompt)
  keyword = head.group(0) if head else ""
  return keyword + prompt[len(keyword):].translate(_FORMAT)


@dataclasses.dataclass(frozen=True)
class Router:
  """The fitted map {format: mode}; `tag(prompt)` is the row tag the decoder gets."""
  modes: dict

  def tag(self, prompt: str) -> str:
    fmt = prompt_format(prompt)
    return fmt if fmt in self.modes else UNSEEN

  def task_modes(self) -> dict:
    """The adaptive decoder's `task_modes`: every fitted format, and UNSEEN -> FALLBACK."""
    return {**self.modes, UNSEEN: FALLBACK}


def fit(prompts: Sequence[str], ar_correct: Sequence, trials: Mapping[str, Mapping], *,
        tolerance: float, min_prompts: int = MIN_PROMPTS) -> tuple[Router, dict]:
  """(router, record) fitted on the calibration prompts only.

  Args:
    prompts: the calibration prompts, in decoding order.
    ar_correct: [N] AR's correctness on each.
    trials: {mode: {"correct": [N], "tokens": [N], "wall_s": [N]}}: each prompt decoded
      with every row forced into that mode (at batch 1: one wall time a prompt).
    tolerance: accuracy (a fraction) a mode may lose against AR on a format.
  Returns the router and, per format, its prompts, AR's accuracy and every mode's (accuracy,
  tokens/s) with the chosen mode (the study's JSON keeps it).
  """
  unknown = sorted(set(trials) - set(MODES))
  if unknown:
    raise ValueError(f"router modes are {list(MODES)}, got {unknown}.")
  formats = [prompt_format(p) for p in prompts]
  groups: dict[str, list[int]] = {}
  for i, f in enumerate(formats):
    groups.setdefault(f, []).append(i)
  ar_correct = np.asarray(ar_correct, float)
  ar_accuracy, figures = {}, {m: {} for m in trials}
  for fmt, rows in groups.items():
    ar_accuracy[fmt] = float(ar_correct[rows].mean())
    for mode, t in trials.items():
      tokens = float(np.asarray(t["tokens"], float)[rows].sum())
      wall = float(np.asarray(t["wall_s"], float)[rows].sum())
      figures[mode][fmt] = (float(np.asarray(t["correct"], float)[rows].mean()),
                            tokens / wall if wall > 0 else float("nan"))
  chosen = adaptive_calibration.choose_task_modes(ar_accuracy, figures, tolerance=tolerance,
                                                  modes=MODES)
  modes = {f: (m if len(groups[f]) >= min_prompts else FALLBACK) for f, m in chosen.items()}
  record = {f: {"prompts": len(groups[f]), "ar_accuracy": ar_accuracy[f], "mode": modes[f],
                "modes": {m: {"accuracy": figures[m][f][0], "tokens_per_s": figures[m][f][1]}
                          for m in trials}}
            for f in sorted(groups)}
  return Router(modes), record
