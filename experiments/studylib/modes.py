"""The study's command-line modes: `--short` / `--long` / `--full` / `--tradeoff` /
`--checkpoints`, `--dry-run` (spelt as absl's `--dry_run`) and each mode's default workdir.

Imports no JAX, so experiments/study.py expands these flags and parses its config (a typo is
then a one-line error within a second or two) before the study's modules load.
"""

from __future__ import annotations

MODE_FLAGS = {"--short": "configs/study.py:short", "--long": "configs/study.py:long",
              "--full": "configs/study.py:full", "--tradeoff": "configs/study.py:tradeoff",
              "--checkpoints": "configs/study.py:checkpoints"}
# Command-line spellings absl does not know, and the flag each stands for.
SPELLINGS = {"--dry-run": "--dry_run"}
# Modes that share another mode's workdir (they load its trained models).
SHARES_WORKDIR = {"tradeoff": ""}


def expand_mode_flags(argv: list[str]) -> list[str]:
  """The study command line with `--short` / `--long` / `--full` / `--tradeoff` rewritten into the
  `--config` each stands for; ValueError for two modes, or a mode flag beside an explicit
  --config."""
  argv = [SPELLINGS.get(a, a) for a in argv]
  picked = [a for a in argv[1:] if a in MODE_FLAGS]
  if not picked:
    return list(argv)
  explicit = [a for a in argv[1:] if a == "--config" or a.startswith("--config=")]
  if len(picked) > 1 or explicit:
    raise ValueError(f"pass one study mode: {' '.join(picked + explicit)} conflict "
                     "(--short, --long, --full, --tradeoff and --checkpoints each stand for a "
                     "--config).")
  return [argv[0]] + [f"--config={MODE_FLAGS[a]}" if a in MODE_FLAGS else a
                      for a in argv[1:]]


def default_workdir(study_config) -> str:
  """runs/study for the default mode, runs/study_<mode> for the others; a mode that reuses
  another's models (tradeoff: the default mode's) gets that mode's workdir."""
  mode = study_config.get("mode", "")
  mode = SHARES_WORKDIR.get(mode, mode)
  return f"runs/study_{mode}" if mode else "runs/study"
