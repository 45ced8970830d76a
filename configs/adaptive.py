"""Task-adaptive decoding (`method="adaptive"`, dllm_jax.decoding.adaptive): the rule's
thresholds, the task-tag map, and how `experiments/calibrate_adaptive.py` re-fits them.

  python experiments/calibrate_adaptive.py --config configs/adaptive.py \
      --target /tmp/ar_tiny --drafter /tmp/d2f_tiny \
      --calibration calib.jsonl --eval eval.jsonl --out adaptive_thresholds.json

Calibration rows that name their "task" also get the task-tag map fitted (per task, the
mode of parallel / verify / AR with the most tokens per forward within `calibrate.tolerance`
of AR's accuracy: `experiments/studylib/adaptive_calibration.py`).

`decode` holds every `adaptive_generate` option (pass them as `generate(...,
method="adaptive", **decode)` with the drafter's params and config); the four thresholds are
traced (sweeping them never recompiles). The calibration script replaces them with the
setting that keeps accuracy within `calibrate.tolerance` of AR on the held-out split while
maximising tokens per forward.

Mode codes on the output (`AdaptiveOutput.modes`, `.round_modes`): 0 parallel (commit the
D2F draft), 1 verify (AR verifies the draft, exact), 2 AR; -1 no round.
"""

from ml_collections import config_dict

from dllm_jax.decoding import adaptive_rule


def get_config():
  c = config_dict.ConfigDict()
  c.decode = config_dict.ConfigDict(dict(
      gen_length=32,
      draft_length=4,           # k tokens drafted per round
      draft_steps=1,            # drafter forwards per draft (1: D2F's one-forward block)
      # The rule (traced):
      parallel_confidence=0.9,  # round 0: commit in parallel when c0 >= this (> 1: never)
      ar_confidence=0.2,        # round 0: plain AR when c0 < this (0: never)
      min_acceptance=0.25,      # a verified row drops to AR below this acceptance rate
      trust_streak=4,           # ... and commits in parallel after this many whole accepts
      # Task tag -> "parallel" | "verify" | "ar" | "auto" (forced for every round of a row
      # whose request carries the tag; "auto": the rule decides).
      task_modes={"copy": "auto", "format": "auto", "long_addition": "auto",
                  "short_answer": "auto"},
      temperature=0.0,
  ))
  c.calibrate = config_dict.ConfigDict(dict(
      grid={k: list(v) for k, v in adaptive_rule.DEFAULT_GRID.items()},
      tolerance=0.01,           # accuracy (fraction) a setting may lose against AR
      drafter_cost=1.0,         # a drafter forward's cost in AR forwards (1: count forwards)
      batch_size=64,
  ))
  return c
