"""How often ranking mode and batch size change a decode: reference order vs batch invariance.

  python experiments/rank_flips.py                       # the demo models, 64 sums
  python experiments/rank_flips.py --methods llada,d2f,fast_dllm --prompts 128
  python experiments/rank_flips.py --preset tiny --methods dream,d2f --opt remasking=entropy

For each method, `--prompts` held-out two-digit sums (the demo task, operands in [0, 100)) are
decoded greedily four ways: each prompt alone (a batch of one) and in batches of `--batch`,
each with the default ranking (exact float32 scores, the references' order) and with
`batch_invariant=True` (scores on the 2^-12 grid). It prints, per method, the fraction of
rows whose tokens differ between

  default: alone vs batch      the float noise of the batch size flipping a near-tie
  invariant: alone vs batch    the same under the grid (0 unless a score straddles a grid line)
  default vs invariant         the grid's own choice on near-ties (alone, and in batches)

and one JSON line with the counts. `--model` takes anything `Sampler.load` does ("demo" by
default: each method gets the demo model it decodes with); `--preset tiny` decodes with a
preset's random init instead (near-uniform logits: confidences nearly tie everywhere), with
the demo's character tokenizer, `--gen_length` slots and blocks of `--block_length`.
`--opt key=value` (repeatable) sets a decoder option, as on `python -m dllm_jax.generate`.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def held_out_sums(n: int, seed: int) -> list[str]:
  """n prompts "a+b=" with a, b uniform in [0, 100), the demo's training distribution."""
  pairs = np.random.default_rng(seed).integers(0, 100, (n, 2))
  return [f"{a}+{b}=" for a, b in pairs]


def decode_rows(sampler, prompts: list[str], batch: int) -> np.ndarray:
  """[N, G] response tokens, the prompts decoded `batch` at a time (in order)."""
  rows = [sampler.sample(prompts[i:i + batch], return_output=True).tokens
          for i in range(0, len(prompts), batch)]
  return np.concatenate(rows)


def flip_rates(sampler, prompts: list[str], batch: int) -> dict:
  """Rows (out of len(prompts)) whose tokens differ between the four decodes."""
  out = {}
  for mode, s in (("default", sampler), ("invariant", sampler.replace(batch_invariant=True))):
    out[mode] = {"alone": decode_rows(s, prompts, 1), "batch": decode_rows(s, prompts, batch)}
  differ = lambda a, b: int(np.any(a != b, axis=1).sum())
  return {
      "rows": len(prompts), "batch": batch,
      "default_alone_vs_batch": differ(out["default"]["alone"], out["default"]["batch"]),
      "invariant_alone_vs_batch": differ(out["invariant"]["alone"], out["invariant"]["batch"]),
      "default_vs_invariant_alone": differ(out["default"]["alone"], out["invariant"]["alone"]),
      "default_vs_invariant_batch": differ(out["default"]["batch"], out["invariant"]["batch"]),
  }


def random_sampler(preset: str, method: str, seed: int, gen_length: int, block_length: int):
  """A Sampler over a preset's random init with the demo task's character tokenizer."""
  import jax
  from dllm_jax.data import tasks, tokenizers
  from dllm_jax.models import get_preset, init_params
  from dllm_jax.sampler import Sampler
  tok = tokenizers.CharTokenizer(tasks.TASK_ALPHABET)
  cfg = get_preset(preset).replace(active_vocab_size=tok.vocab_size)
  params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(seed))
  return Sampler(params, cfg, tok, method, gen_length=gen_length, block_length=block_length)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="demo", help="'demo' or any Sampler.load path")
  p.add_argument("--methods", default="llada,d2f", help="comma-separated ranking methods")
  p.add_argument("--prompts", type=int, default=64)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seed", type=int, default=7, help="prompts (and --preset weights)")
  p.add_argument("--preset", default=None, help="random init of this preset, not --model")
  p.add_argument("--gen_length", type=int, default=16, help="with --preset")
  p.add_argument("--block_length", type=int, default=8, help="with --preset")
  p.add_argument("--opt", action="append", default=[], help="decoder option key=value")
  args = p.parse_args(argv)
  from dllm_jax.generate import parse_value  # imports no JAX
  options = {}
  for text in args.opt:
    key, _, value = text.partition("=")
    options[key.strip()] = parse_value(value)
  from dllm_jax.sampler import Sampler  # JAX loads after the flags are parsed
  prompts = held_out_sums(args.prompts, args.seed)
  results = {}
  for method in args.methods.split(","):
    if args.preset:
      sampler = random_sampler(args.preset, method, args.seed, args.gen_length,
                               args.block_length)
    else:
      sampler = Sampler.load(args.model, method)
    sampler = sampler.replace(**options) if options else sampler
    r = results[method] = flip_rates(sampler, prompts, args.batch)
    n = r["rows"]
    print(f"{method} ({n} rows, batches of {r['batch']}, options {dict(sampler.options)}):")
    for key in ("default_alone_vs_batch", "invariant_alone_vs_batch",
                "default_vs_invariant_alone", "default_vs_invariant_batch"):
      print(f"  {key:28s} {r[key]:4d} / {n} = {r[key] / n:.3f}")
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
