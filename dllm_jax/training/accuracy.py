"""Task accuracy during training: decode held-out prompts and score the answers exactly.

Shape legend: N examples, P prompt length (the layout's fixed prompt length), G gen_length.

The first `decode.eval_examples` records of the test split are decoded with
`decode.method` / `decode.options` through `dllm_jax.decoding.api.generate`, in batches of
`decode.batch_size` (the last batch is padded by repeating its last prompt, so one compiled
decoder serves every call), on the training mesh. Each response is detokenized and scored by
its task (`TaskSuite.score`: the final answer after the last '=' must be right).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from dllm_jax.data.sources import record_to_example
from dllm_jax.decoding import api as decode_api
from dllm_jax.decoding import registry
from dllm_jax.training import data as data_lib


def decode_options(config, layout) -> dict:
  """`decode.options` with gen_length defaulting to the rows' answer region (L - P)."""
  options = dict(config.decode.options)
  if "gen_length" not in options:
    if layout.prompt_len is None:
      raise ValueError("decode.options.gen_length must be set when data.fixed_prompt=False.")
    options["gen_length"] = layout.seq_len - layout.prompt_len
  return options


def check_decode_config(config, layout) -> None:
  """Unknown methods or options fail here, before training starts."""
  registry.check(config.decode.method)
  decode_api.check_options(config.decode.method, decode_options(config, layout))


def _gather(x) -> np.ndarray:
  if jax.process_count() > 1:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def exact_match(exp, params, source, rng: jax.Array) -> dict[str, float]:
  """{"exact_match", "tokens_per_forward", "answer_tokens"} over the first examples, plus
  "exact_match_<task>" per task of a mixture."""
  config, layout = exp.config, exp.layout
  n = min(int(config.decode.eval_examples), len(source))
  examples = [record_to_example(source[i]) for i in range(n)]
  suite = data_lib.make_suite(config.data)
  options = decode_options(config, layout)
  size = min(int(config.decode.batch_size), n)
  model_cfg = exp.model_cfg
  if exp.tokenizer.vocab_size < model_cfg.vocab_size:
    # An undertrained model must not emit ids past the tokenizer's (they decode to nothing).
    model_cfg = model_cfg.replace(active_vocab_size=int(exp.tokenizer.vocab_size))
  correct, committed, forwards, lengths = [], 0.0, 0.0, []
  for start in range(0, n, size):
    chunk = examples[start:start + size]
    prompts = [e.prompt for e in chunk] + [chunk[-1].prompt] * (size - len(chunk))
    enc = layout.encode_prompts(prompts)
    out = decode_api.generate(params, model_cfg, (enc["tokens"], enc["valid"]),
                              method=config.decode.method,
                              rng=jax.random.fold_in(rng, start), mesh=exp.mesh,
                              rules=exp.rules, **options)
    tokens = _gather(out.tokens)[:len(chunk)]
    for row, example in zip(tokens, chunk):
      correct.append(suite.score(exp.tokenizer.decode(row), example))
    lengths += list(_gather(out.lengths)[:len(chunk)])
    committed += float(np.sum(_gather(out.committed)[:len(chunk)]))
    forwards += float(out.nfe) * len(chunk)
  results = {"exact_match": float(np.mean(correct)),
             "tokens_per_forward": committed / max(forwards, 1.0),
             "answer_tokens": float(np.mean(lengths))}
  tasks = sorted({e.task for e in examples})
  if len(tasks) > 1:  # a mixture: also per task
    for task in tasks:
      hits = [c for c, e in zip(correct, examples) if e.task == task]
      results[f"exact_match_{task}"] = float(np.mean(hits))
  return results
