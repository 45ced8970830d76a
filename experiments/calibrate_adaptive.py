"""Calibrate adaptive decoding's thresholds on a held-out split (configs/adaptive.py).

  python experiments/calibrate_adaptive.py --config configs/adaptive.py \
      --target /tmp/ar_tiny --drafter /tmp/d2f_tiny \
      --calibration calib.jsonl --eval eval.jsonl --out adaptive_thresholds.json

--calibration and --eval are JSON-lines files of {"prompt": str, "answer": str}; a response
is correct when its text equals the answer (whitespace stripped). The calibration prompts
must not occur in --eval (an error otherwise); pass --eval=none only when no evaluation set
exists. Writes the chosen thresholds, their accuracy and tokens per forward beside AR's, and
every trial, as JSON (`CalibrationResult.to_json`); the "options" entry goes straight into
`generate(..., method="adaptive", **options)` or the config's `decode`.

When every calibration row also names its "task", the task-tag map is fitted too
(`calibrate_task_modes`: per task, the mode of parallel / verify / AR with the most tokens per
forward within the tolerance of AR's accuracy on that task's rows): "options" then carries
`task_modes`, and "task_modes" holds its per-task figures.
"""

import json

from absl import app, flags

import _config_args  # experiments/_config_args.py: --config found from any directory

_CONFIG = _config_args.define("configs/adaptive.py", "configs/adaptive.py")
_TARGET = flags.DEFINE_string("target", None, "AR model: training workdir or model dir.",
                              required=True)
_DRAFTER = flags.DEFINE_string("drafter", None, "D2F / block-diffusion drafter directory.",
                               required=True)
_CALIB = flags.DEFINE_string("calibration", None, "held-out JSONL split.", required=True)
_EVAL = flags.DEFINE_string("eval", None, "evaluation JSONL (checked disjoint) or 'none'.",
                            required=True)
_OUT = flags.DEFINE_string("out", "adaptive_thresholds.json", "where to write the JSON.")


def read_split(path):
  """(prompts, answers, tasks): tasks is None unless every row names its "task"."""
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  if not rows or not all("prompt" in r and "answer" in r for r in rows):
    raise ValueError(f"{path}: expected JSON lines with 'prompt' and 'answer' fields.")
  tasks = [r["task"] for r in rows] if all("task" in r for r in rows) else None
  return [r["prompt"] for r in rows], [r["answer"] for r in rows], tasks


def main(argv):
  del argv
  # JAX loads after the flags (_config_args).
  # pylint: disable=import-outside-toplevel
  from dllm_jax import loading
  from studylib import adaptive_calibration as calib
  from dllm_jax.sampler import decode_text, encode_text
  c = _CONFIG.value
  target = loading.load_model(_TARGET.value, "ar")
  drafter = loading.load_model(_DRAFTER.value, "d2f")
  prompts, answers, tasks = read_split(_CALIB.value)
  eval_prompts = None if _EVAL.value == "none" else read_split(_EVAL.value)[0]
  calib.check_disjoint(prompts, eval_prompts)  # on the text, before any decoding
  tok = target.tokenizer
  options = {k: (dict(v) if k == "task_modes" else v) for k, v in c.decode.items()}
  for name in calib.adaptive.THRESHOLDS:
    options.pop(name)  # swept
  decode, ar_decode = calib.model_decoders(target.params, target.cfg, drafter.params,
                                           drafter.cfg, batch_size=c.calibrate.batch_size,
                                           **options)
  score = lambda ids, answer: decode_text(tok, ids).strip() == answer.strip()
  ids = [encode_text(tok, p) for p in prompts]
  eval_ids = None if eval_prompts is None else [encode_text(tok, p) for p in eval_prompts]
  result = calib.calibrate(decode, ar_decode, ids, answers, eval_prompts=eval_ids,
                           grid={k: list(v) for k, v in c.calibrate.grid.items()},
                           tolerance=c.calibrate.tolerance,
                           drafter_cost=c.calibrate.drafter_cost, score=score)
  written = json.loads(result.to_json())
  if tasks is not None:
    fitted = calib.calibrate_task_modes(
        decode, ar_decode, ids, answers, tasks, eval_prompts=eval_ids,
        thresholds=result.options, tolerance=c.calibrate.tolerance,
        drafter_cost=c.calibrate.drafter_cost, score=score)
    written["options"]["task_modes"] = fitted.task_modes
    written["task_modes"] = json.loads(fitted.to_json())
    print(f"task modes {fitted.task_modes}")
  with open(_OUT.value, "w") as f:
    json.dump(written, f, indent=2)
  print(f"chosen {result.options}: accuracy {result.chosen.accuracy:.3f} (AR "
        f"{result.ar_accuracy:.3f}), {result.chosen.tokens_per_forward:.2f} tokens per "
        f"forward (AR {result.ar_tokens_per_forward:.2f}); wrote {_OUT.value}")
  return 0


if __name__ == "__main__":
  _config_args.run(main)
