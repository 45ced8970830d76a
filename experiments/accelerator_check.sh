#!/usr/bin/env bash
# The accelerator figures of BENCHMARKS.md section 5, in an estimated ten minutes on one GPU or
# TPU (not yet timed on one):
#   1. the long-answer study (`configs/study.py:long`, answers of 159-163 tokens, G = 192): D2F,
#      Fast-dLLM and the hybrids against vanilla LLaDA and AR tokens/s at batch 1 on trained
#      models, and AR against the HBM-bandwidth bound. Models already trained in
#      runs/study_long/models (say on a CPU) are reused, so both machines decode the same
#      weights; otherwise the three tiny models train first (3700 steps at batch 32).
#   2. the weight-streaming point (`configs/scaling.py:1b`): AR, Fast-dLLM and D2F at
#      batch 1, G = 256, on random-weight 92M and 1.2B bf16 models.
#
#   experiments/accelerator_check.sh [OUT]      # OUT defaults to runs/accelerator
#
# Everything lands in OUT: devices.txt, study.{md,json}, study_pareto.png, scaling.{md,json},
# breakeven_vs_width.png and the logs. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/accelerator}"
py="${PYTHON:-python3}"
mkdir -p "$out/study_long"
"$py" -c 'import jax; print(jax.__version__, jax.devices())' | tee "$out/devices.txt"
if [[ -d runs/study_long/models && ! -e "$out/study_long/models" ]]; then
  cp -r runs/study_long/models "$out/study_long/models"
fi
"$py" experiments/study.py --long --workdir "$out/study_long" 2>&1 | tee "$out/study.log"
cp "$out"/study_long/study.md "$out"/study_long/study.json "$out"/study_long/study_pareto.png \
  "$out/"
"$py" experiments/scaling.py --config configs/scaling.py:1b --workdir "$out/scaling_1b" 2>&1 \
  | tee "$out/scaling.log"
cp "$out"/scaling_1b/scaling.md "$out"/scaling_1b/scaling.json \
  "$out"/scaling_1b/breakeven_vs_width.png "$out/"
