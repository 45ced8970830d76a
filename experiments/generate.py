"""Decode prompts with any decoder: a thin shell around `dllm_jax.decoding.generate`.

  # a trained run (model shape, tokenizer and prompt format come from its config.json)
  python experiments/generate.py --workdir /tmp/mdm_tiny --method fast_dllm \
      --prompt "12+34=" --opt gen_length=16 --opt block_length=8 --opt threshold=0.9

  # smoke test: random weights of a preset, byte tokenizer
  python experiments/generate.py --preset small --method llada --prompt "hello" \
      --opt gen_length=32 --opt steps=16

Prints each answer, then NFE, tokens/s and wall time of a second (compiled) call; the first
call's time includes compilation and is printed separately.
"""

import ast
import time

import jax
import numpy as np
from absl import app, flags

from dllm_jax.data import tokenizers
from dllm_jax.decoding import api
from dllm_jax.models import get_preset, init_params

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run to load (latest checkpoint).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of --workdir (default: latest).")
_PRESET = flags.DEFINE_string("preset", None, "Model preset with random weights (smoke tests).")
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte",
                                 "'byte' or a tokenizer.json path (with --preset).")
_METHOD = flags.DEFINE_enum("method", "llada", sorted(api.METHODS), "Decoding method.")
_PROMPTS = flags.DEFINE_multi_string("prompt", None, "Prompt text (repeat for a batch).")
_OPTS = flags.DEFINE_multi_string("opt", [], "Decoder option key=value (repeatable).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.mark_flag_as_required("prompt")


def parse_options(pairs) -> dict:
  """["steps=8", "cache=dual"] -> {"steps": 8, "cache": "dual"}."""
  options = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep:
      raise app.UsageError(f"--opt {pair!r} is not key=value.")
    try:
      options[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      options[key] = value
  return options


def load(prompts):
  """-> (params, ModelConfig, tokenizer, (tokens [B, P], valid [B, P]))."""
  if (_WORKDIR.value is None) == (_PRESET.value is None):
    raise app.UsageError("Pass exactly one of --workdir and --preset.")
  if _WORKDIR.value is not None:
    from dllm_jax.training import checkpoint, config as config_lib, data as data_lib
    params, config = checkpoint.load_params(_WORKDIR.value, _STEP.value)
    tok = data_lib.make_tokenizer(config.data)
    enc = data_lib.make_layout(config.data, tok).encode_prompts(prompts)
    return params, config_lib.model_config(config), tok, (enc["tokens"], enc["valid"])
  cfg = get_preset(_PRESET.value)
  tok = (tokenizers.ByteTokenizer() if _TOKENIZER.value == "byte"
         else tokenizers.HFTokenizer.from_file(_TOKENIZER.value))
  if tok.vocab_size > cfg.vocab_size:
    raise app.UsageError(f"the tokenizer has {tok.vocab_size} ids but preset {cfg.name!r} only "
                         f"{cfg.vocab_size}; pick a larger preset (e.g. small).")
  params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(_SEED.value))
  bos = [] if tok.bos_id is None else [tok.bos_id]
  return params, cfg, tok, [bos + tok.encode(p) for p in prompts]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  params, cfg, tok, prompts = load(_PROMPTS.value)
  options = parse_options(_OPTS.value)
  run = lambda: api.generate(params, cfg, prompts, method=_METHOD.value,
                             rng=jax.random.key(_SEED.value), **options)
  start = time.perf_counter()
  jax.block_until_ready(run())
  first = time.perf_counter() - start
  start = time.perf_counter()
  out = jax.block_until_ready(run())
  wall = time.perf_counter() - start
  for text, row, n in zip(_PROMPTS.value, np.asarray(out.tokens), np.asarray(out.lengths)):
    print(f"{text!r} -> {tok.decode(row[:n])!r}")
  tokens = int(np.sum(out.lengths))
  print(f"method={_METHOD.value} nfe={int(out.nfe)} tokens={tokens} "
        f"tokens/forward={tokens / max(int(out.nfe), 1) / len(prompts):.2f}/row "
        f"wall={wall:.3f}s tokens/s={tokens / wall:.1f} (first call incl. compile {first:.1f}s)")


if __name__ == "__main__":
  app.run(main)
