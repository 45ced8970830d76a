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
#   3. the real models (only when their paths are set; needs the weights on local disk):
#      LLaDA-8B-Instruct + the D2F LoRA against LLaMA-3-8B-Instruct on GSM8K, on a TPU v5e-8
#      (mesh {"tensor": 8}, 16 GiB per chip) or one H100 (no mesh). The dry run comes first
#      and stops the script with one line naming the change if a plan does not fit; then
#      lm-eval's GSM8K (4-shot, 512 new tokens, greedy, bf16, D2F's release settings: block
#      64, tau_add 0.7, tau_act 0.95, tau_conf 0.9) for both models, and the study's
#      checkpoint mode on a local GSM8K-format file (every decoder the models allow).
#
#   experiments/accelerator_check.sh [OUT]      # OUT defaults to runs/accelerator
#   LLADA=/ckpt/LLaDA-8B-Instruct D2F_LORA=/ckpt/D2F_LLaDA_Instruct_8B_Lora \
#     LLAMA=/ckpt/Meta-Llama-3-8B-Instruct GSM8K=/data/gsm8k_test.jsonl REAL_ONLY=1 \
#     experiments/accelerator_check.sh runs/accelerator
#
# Everything lands in OUT: devices.txt, study.{md,json}, study_pareto.png, scaling.{md,json},
# breakeven_vs_width.png and the logs; part 3 writes OUT/real/ (dry runs, lm-eval results,
# the checkpoint study). PYTHON picks the interpreter (default python3). REAL_ONLY=1 skips
# parts 1 and 2. lm-eval's gsm8k task reads the HF hub's openai/gsm8k (or its local cache).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/accelerator}"
py="${PYTHON:-python3}"
mkdir -p "$out/study_long"
"$py" -c 'import jax; print(jax.__version__, jax.devices())' | tee "$out/devices.txt"
if [[ -z "${REAL_ONLY:-}" ]]; then
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
fi

# --- 3. The real models (LLaDA-8B-Instruct + D2F LoRA vs LLaMA-3-8B-Instruct, GSM8K) ---
if [[ -z "${LLADA:-}" || -z "${D2F_LORA:-}" || -z "${LLAMA:-}" ]]; then
  echo "real models: skipped (set LLADA, D2F_LORA and LLAMA to the checkpoint directories)"
  exit 0
fi
real="$out/real"
mkdir -p "$real"
devices=$("$py" -c 'import jax; print(jax.device_count())')
if (( devices > 1 )); then  # a TPU v5e-8: every chip holds 1/8 of each model
  mesh="{\"tensor\": $devices}"; batch="${BATCH:-16}"
else                        # one H100: the whole model on the device
  mesh=""; batch="${BATCH:-8}"
fi
mesh_flag=(); mesh_arg=""; study_mesh=()
if [[ -n "$mesh" ]]; then
  mesh_flag=(--mesh "$mesh"); mesh_arg=",mesh=$mesh"; study_mesh=(--config.mesh="$mesh")
fi
d2f_opts=(--opt block_length=64 --opt tau_add=0.7 --opt tau_act=0.95 --opt tau_conf=0.9)
d2f_args="block_length=64,tau_add=0.7,tau_act=0.95,tau_conf=0.9"
# Dry runs first: bytes per device from config.json alone; a plan that does not fit stops
# here with one line naming the change (GSM8K 4-shot prompts are about 1000 tokens).
"$py" -m dllm_jax.generate --model "$LLADA" --adapter "$D2F_LORA" --method d2f \
  "${d2f_opts[@]}" --dry_run "${mesh_flag[@]}" --batch "$batch" --prompt_len 1024 \
  --gen_length 512 --dtype bfloat16 | tee "$real/dry_run_d2f.txt"
"$py" -m dllm_jax.generate --model "$LLAMA" --method ar --dry_run "${mesh_flag[@]}" \
  --batch "$batch" --prompt_len 1024 --gen_length 512 --dtype bfloat16 \
  | tee "$real/dry_run_ar.txt"
"$py" -m dllm_jax.eval --model_args "checkpoint=$LLADA,adapter=$D2F_LORA,method=d2f,$d2f_args,gen_length=512,dtype=bfloat16,batch_size=$batch$mesh_arg" \
  --tasks gsm8k --num_fewshot 4 --dry-run | tee "$real/dry_run_eval.txt"
study=(--config configs/study.py:checkpoints --config.checkpoints.ar="$LLAMA"
       --config.checkpoints.diffusion="$LLADA" --config.checkpoints.d2f_adapter="$D2F_LORA"
       "${study_mesh[@]}")
if [[ -n "${GSM8K:-}" ]]; then
  study+=(--config.eval_set.source="$GSM8K")
  "$py" experiments/study.py "${study[@]}" --workdir "$real/study" --dry-run \
    | tee "$real/dry_run_study.txt"
fi
# GSM8K through lm-eval: D2F-LLaDA against the AR baseline, the scores with tokens/s beside.
"$py" -m dllm_jax.eval --model_args "checkpoint=$LLADA,adapter=$D2F_LORA,method=d2f,$d2f_args,gen_length=512,dtype=bfloat16,batch_size=1$mesh_arg" \
  --tasks gsm8k --num_fewshot 4 --output_path "$real/lm_eval_d2f" 2>&1 | tee "$real/lm_eval_d2f.log"
"$py" -m dllm_jax.eval --model_args "checkpoint=$LLAMA,method=ar,gen_length=512,dtype=bfloat16,batch_size=1$mesh_arg" \
  --tasks gsm8k --num_fewshot 4 --output_path "$real/lm_eval_ar" 2>&1 | tee "$real/lm_eval_ar.log"
if [[ -n "${GSM8K:-}" ]]; then
  "$py" experiments/study.py "${study[@]}" --workdir "$real/study" 2>&1 | tee "$real/study.log"
fi
