"""The adaptive decoder's rule as plain data: its threshold names and the calibration grid.

Kept apart from `adaptive.py` (the decoder) and the study's threshold sweep
(`experiments/studylib/adaptive_calibration.py`) so that
configs/adaptive.py, which the study's config loads, names them without importing JAX.
"""

from __future__ import annotations

# The rule's traced thresholds (`adaptive.adaptive_generate` options).
THRESHOLDS = ("parallel_confidence", "ar_confidence", "min_acceptance", "trust_streak")

# Each threshold's candidates: AR-only / verify-only / parallel-only corners included, so
# the grid always holds a setting as accurate as AR (everything verified, at greedy).
DEFAULT_GRID = {
    "parallel_confidence": (0.8, 0.9, 0.95, 0.99, float("inf")),
    "ar_confidence": (0.0, 0.1, 0.2, 0.3),
    "min_acceptance": (0.0, 0.25, 0.5),
    "trust_streak": (0, 2, 4),
}
