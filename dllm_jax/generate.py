"""Generate from a real local checkpoint with any decoder.

  python -m dllm_jax.generate --model /ckpt/LLaDA-8B-Instruct --adapter /ckpt/D2F_LLaDA_LoRA \
      --method d2f --prompt "What is 12 * 34?" --gen_length 256 --opt block_length=32

Loads `config.json` + safetensors (family detected), optionally a PEFT LoRA adapter, the
checkpoint's own tokenizer and chat template (special ids from the checkpoint, never
hard-coded), decodes with `dllm_jax.decoding.generate`, and prints the answer with tokens/s,
NFE and wall time. Decoder options go through repeated `--opt key=value` flags and are checked
by the decoder (a misspelt option is an error).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time

import jax

from dllm_jax import checkpoints, decoding
from dllm_jax.parallel import mesh as mesh_lib


def _parse_opt(text: str) -> tuple[str, object]:
  if "=" not in text:
    raise argparse.ArgumentTypeError(f"--opt expects key=value, got {text!r}")
  key, value = text.split("=", 1)
  try:
    return key, ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return key, value


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m dllm_jax.generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True, help="local HF model directory (config.json, "
                 "*.safetensors, tokenizer.json) or an orbax dir from save_converted")
  p.add_argument("--adapter", help="PEFT LoRA adapter directory (adapter_config.json)")
  p.add_argument("--merge_lora", action="store_true", help="merge the adapter into the weights")
  p.add_argument("--method", default="d2f", choices=sorted(decoding.api.METHODS))
  p.add_argument("--prompt", action="append", required=True,
                 help="prompt text; repeat for a batch")
  p.add_argument("--no_chat_template", action="store_true",
                 help="feed the raw prompt instead of the model's chat template")
  p.add_argument("--gen_length", type=int, default=256)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--mesh", default=None,
                 help='mesh shape as JSON, e.g. \'{"tensor": 8}\'; default: one device')
  p.add_argument("--opt", action="append", type=_parse_opt, default=[],
                 help="decoder option key=value (e.g. block_length=32, tau_conf=0.9)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
  return p


def _load(args, mesh):
  from pathlib import Path
  model_dir = Path(args.model)
  if not model_dir.is_dir():
    raise FileNotFoundError(f"--model {model_dir} is not a directory; pass a local checkpoint "
                            "folder (weights cannot be downloaded by this command).")
  if (model_dir / "config.json").exists():
    cfg, params = checkpoints.load_pretrained(model_dir, dtype=args.dtype, mesh=mesh,
                                              adapter_dir=args.adapter,
                                              merge_lora=args.merge_lora)
  else:
    if args.adapter:
      raise ValueError("--adapter needs an HF model directory; merge adapters before "
                       "save_converted.")
    cfg, params = checkpoints.load_converted(model_dir, mesh=mesh)
  return cfg, params, checkpoints.load_tokenizer(model_dir)


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  mesh = mesh_lib.make_mesh(json.loads(args.mesh)) if args.mesh else None
  cfg, params, tok = _load(args, mesh)
  texts = args.prompt
  if not args.no_chat_template and tok.chat_template:
    texts = [tok.apply_chat_template([{"role": "user", "content": t}],
                                     add_generation_prompt=True, tokenize=False) for t in texts]
  prompts = [tok.encode(t, add_special_tokens=args.no_chat_template) for t in texts]
  opts = dict(args.opt)
  opts.setdefault("gen_length", args.gen_length)
  rng = jax.random.key(args.seed)

  start = time.perf_counter()
  out = jax.block_until_ready(decoding.generate(params, cfg, prompts, method=args.method,
                                                rng=rng, mesh=mesh, **opts))
  first = time.perf_counter() - start  # includes compilation
  start = time.perf_counter()
  out = jax.device_get(decoding.generate(params, cfg, prompts, method=args.method,
                                         rng=rng, mesh=mesh, **opts))
  wall = time.perf_counter() - start

  tokens = int(out.lengths.sum())
  answers = [tok.decode(out.tokens[i, :out.lengths[i]].tolist(), skip_special_tokens=True)
             for i in range(len(prompts))]
  stats = {"method": args.method, "response_tokens": tokens, "nfe": int(out.nfe),
           "wall_s": wall, "first_call_s": first, "tokens_per_s": tokens / wall,
           "tokens_per_forward": tokens / max(int(out.nfe) * len(prompts), 1)}
  if args.json:
    print(json.dumps({"answers": answers, **stats}))
  else:
    for i, a in enumerate(answers):
      print(f"[{i}] {a}")
    print(f"{args.method}: {tokens} response tokens in {wall:.3f}s = "
          f"{stats['tokens_per_s']:.1f} tok/s, NFE {stats['nfe']}, "
          f"{stats['tokens_per_forward']:.2f} tokens/forward "
          f"(first call with compile {first:.1f}s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
