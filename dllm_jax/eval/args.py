"""The `--model_args` of the `dllm_jax` lm-eval model, parsed and checked without JAX.

    parse_model_args("checkpoint=demo,method=d2f,block_length=4,batch_size=8")
    parse_model_args({"checkpoint": "/ckpt/LLaDA-8B-Instruct", "adapter": "/ckpt/D2F_LoRA"})

Keys (everything else is an option of the decoding method, checked by the decoder):

  checkpoint      "demo", a HF model dir, a converted dir or a training workdir (required)
  method          a `decoding.registry` name (default: registry.DEFAULT_METHOD)
  kind, dtype, adapter, merge_lora, step
                  how to load the checkpoint (`Sampler.load`)
  drafter_model   the drafter checkpoint of a method that drafts with a second model
                  (speculative, adaptive; "demo" brings its own). `drafter` stays the
                  speculative decoder's option (the drafter's kind: ar, d2f, ...).
  mesh            the mesh shape, a dict or JSON ({"fsdp": 8}); default one device
  batch_size      prompts per decode, rows per likelihood forward (default 1)
  max_gen_toks    response slots when neither the model args nor the checkpoint set
                  gen_length (default 256; a task's own max_gen_toks wins over it)
  max_length      the window likelihoods are scored in (default the model's max_seq_len)
  seed            PRNG seed of sampling and of the Monte-Carlo masks (default 1234, LLaDA's)
  likelihood      "auto" (exact for causal models, the ELBO for bidirectional ones), "ar"
                  or "elbo"
  mc_num, mc_batch_size
                  Monte-Carlo samples of the ELBO and the rows per forward (128 and 32,
                  LLaDA's eval_llada.py; mc_num a multiple of mc_batch_size)

String values are read as `dllm_jax.generate.parse_value` reads `--opt` values (numbers,
true/false, none, Python literals, else the string). `parse_model_args` is the one place the
model args are read, so a caller (the CLI, a dry run) can check them before any weight loads.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from dllm_jax.decoding import registry
from dllm_jax.generate import UsageError, parse_value

LIKELIHOODS = ("auto", "ar", "elbo")
LOAD_KEYS = ("kind", "dtype", "adapter", "merge_lora", "step", "drafter_model")
# Keys lm-eval itself passes to every model; JAX places the arrays (see `mesh`).
IGNORED_KEYS = ("device", "max_batch_size", "trust_remote_code")


@dataclasses.dataclass(frozen=True)
class EvalArgs:
  """What the model args ask for (see the module docstring)."""
  checkpoint: str
  method: str
  load: dict
  options: dict
  mesh: dict | None = None
  batch_size: int = 1
  max_gen_toks: int = 256
  max_length: int | None = None
  seed: int = 1234
  likelihood: str = "auto"
  mc_num: int = 128
  mc_batch_size: int = 32


def _positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    hint = " (batch_size=auto is not supported: give a number)" if str(value).startswith("auto") else ""
    raise UsageError(f"{name} must be a positive integer, got {value!r}{hint}.")
  return value


def _mesh(value) -> dict | None:
  if value is None or isinstance(value, dict):
    return value
  try:
    shape = json.loads(value) if isinstance(value, str) else None
  except json.JSONDecodeError:
    shape = None
  if not isinstance(shape, dict):
    raise UsageError(f"mesh must be a dict of axis sizes, e.g. mesh={{\"fsdp\": 8}}; got "
                     f"{value!r}.")
  return shape


def split_model_args(text: str | None) -> dict[str, str]:
  """"k=v,k2=v2" -> {"k": "v", "k2": "v2"}; commas inside brackets, braces or quotes (a
  mesh dict, a list) do not split. A JSON object is read as one."""
  text = (text or "").strip()
  if text.startswith("{"):
    try:
      return dict(json.loads(text))
    except (json.JSONDecodeError, TypeError, ValueError):
      raise UsageError(f"model_args {text!r} is not a JSON object.") from None
  pairs, depth, quote, current = [], 0, None, []
  for char in text:
    if quote:
      quote = None if char == quote else quote
    elif char in "\"'":
      quote = char
    elif char in "[({":
      depth += 1
    elif char in "])}":
      depth = max(depth - 1, 0)
    elif char == "," and depth == 0:
      pairs.append("".join(current))
      current = []
      continue
    current.append(char)
  pairs = [p for p in pairs + ["".join(current)] if p.strip()]
  if any("=" not in p for p in pairs):
    raise UsageError(f"model_args must be key=value pairs separated by commas, got {text!r}.")
  return dict(p.split("=", 1) for p in pairs)


def parse_model_args(model_args: str | Mapping[str, Any] | None, *,
                     loads: bool = True) -> EvalArgs:
  """The `EvalArgs` of an lm-eval `--model_args` string or dict (UsageError if wrong).

  `loads=False`: the model is already loaded (`DllmJaxLM.from_sampler`), so no checkpoint
  or drafter is asked for.
  """
  if model_args is None or isinstance(model_args, str):
    model_args = split_model_args(model_args)
  args = {k.strip(): parse_value(v) if isinstance(v, str) else v
          for k, v in model_args.items() if k.strip() not in IGNORED_KEYS}
  checkpoint = args.pop("checkpoint", None if loads else "<sampler>")
  if checkpoint is None:
    raise UsageError("model_args need checkpoint=...: 'demo', a HF model directory, a "
                     "converted directory or a training workdir.")
  method = args.pop("method", registry.DEFAULT_METHOD)
  if method not in registry.names():
    raise UsageError(f"method={method!r} is unknown; use one of {sorted(registry.names())}.")
  load = {k: args.pop(k) for k in LOAD_KEYS if k in args}
  drafted = registry.drafter_methods()
  if (loads and method in drafted and load.get("drafter_model") is None
      and str(checkpoint) != "demo"):
    raise UsageError(f"method={method} drafts with a second model: add drafter_model=<dir> "
                     "(a checkpoint sharing the target's tokenizer) to the model args.")
  if load.get("drafter_model") is not None and method not in drafted:
    raise UsageError(f"drafter_model applies to method={' or '.join(drafted)}, not {method}.")
  fields = {}
  for name in ("batch_size", "max_gen_toks", "max_length", "mc_num", "mc_batch_size"):
    if args.get(name) is not None:
      fields[name] = _positive_int(name, args.pop(name))
    args.pop(name, None)
  if "seed" in args:
    fields["seed"] = int(args.pop("seed"))
  likelihood = args.pop("likelihood", "auto")
  if likelihood not in LIKELIHOODS:
    raise UsageError(f"likelihood={likelihood!r} is unknown; use one of {list(LIKELIHOODS)}.")
  parsed = EvalArgs(checkpoint=str(checkpoint), method=method, load=load,
                    mesh=_mesh(args.pop("mesh", None)), likelihood=likelihood,
                    options=args, **fields)
  if parsed.mc_num % parsed.mc_batch_size:
    raise UsageError(f"mc_num={parsed.mc_num} must be a multiple of mc_batch_size="
                     f"{parsed.mc_batch_size} (the samples run in batches of that many rows).")
  return parsed
