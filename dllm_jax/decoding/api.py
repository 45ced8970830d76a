"""`generate`: one entry point for every decoder, on one device or a mesh.

Shape legend: B batch, P padded prompt length, G gen_length.

    out = generate(params, cfg, [[1, 5, 6], [1, 7]], method="fast_dllm", gen_length=64,
                   block_length=16, cache="dual")
    out.tokens  # [B, G], cut after each row's first EOS

Option checks, buckets, meshes and non-finite rows, in full: docs/decoders.md,
`decoding.api`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from dllm_jax.decoding import base, buckets, protocol, registry
from dllm_jax.models.config import ModelConfig
from dllm_jax.parallel import mesh as mesh_lib

option_names, check_options, plan = protocol.option_names, protocol.check_options, protocol.plan


def as_prompt_batch(cfg: ModelConfig, prompts):
  """A list of token lists, or a ([B, P] tokens, [B, P] valid) pair -> (tokens, valid)."""
  if isinstance(prompts, tuple) and len(prompts) == 2 and np.ndim(prompts[0]) == 2:
    tokens, valid = prompts
    return np.asarray(tokens, np.int32), np.asarray(valid, bool)
  rows = None
  if isinstance(prompts, Sequence) and not isinstance(prompts, str) and prompts:
    rows = [np.asarray(p) for p in prompts]
    if not all(r.ndim == 1 and (r.size == 0 or np.issubdtype(r.dtype, np.integer))
               for r in rows):
      rows = None
  if rows is not None:
    return base.pad_prompts([r.tolist() for r in rows], base.output_pad_id(cfg))
  raise ValueError("prompts must be a non-empty list of token-id lists or a (tokens [B, P], "
                   "valid [B, P]) pair; use dllm_jax.decoding.pad_prompts for the latter.")


def generate(params, cfg: ModelConfig, prompts, *, method: str = registry.DEFAULT_METHOD,
             rng=None, mesh=None, rules=None, data_parallel: str | None = None,
             pad_to=buckets.PROMPT_BUCKETS, batch_buckets=buckets.BATCH_BUCKETS,
             **options) -> base.DecodeOutput:
  """Decodes a prompt batch with `method` and returns a `base.DecodeOutput`.

  Args:
    params: model parameters.
    cfg: the model config.
    prompts: list of token-id lists (left padded here) or a (tokens, valid) pair.
    method: a registered method (`registry.names()`; default `registry.DEFAULT_METHOD`).
    rng: PRNG key for sampling (default key 0).
    mesh: optional `jax.sharding.Mesh` (see parallel.mesh.make_mesh) to decode on.
    rules: logical-axis rules for the mesh (default parallel.mesh.DEFAULT_RULES).
    data_parallel: with a mesh, "shard_map" (one while_loop per data shard, each to its own
      exit; the default on a data axis) or "spmd" (one program, every device steps until
      the slowest row is done; the default on an fsdp axis, whose params stay sharded).
    pad_to: prompt-length buckets: "pow2" (default: 16, 32, 64, ...), a length, a list of
      lengths, or None (exact). Capped so prompt + gen_length fits the model window.
    batch_buckets: batch-size buckets: "pow2" (default), a list of sizes, or None (exact).
    **options: the method's options (e.g. gen_length, block_length, steps, threshold;
      `option_names(method)`), and on_nonfinite: "raise" (default: NonFiniteLogitsError
      naming the rows whose logits were ever NaN/inf) or "flag" (return them with
      `finite` False and `lengths` 0).
  """
  registry.check(method)
  check_options(method, options)
  on_nonfinite = options.get("on_nonfinite", "raise")
  base.check_on_nonfinite(on_nonfinite)
  mode = _data_parallel_mode(data_parallel, mesh, rules)
  tokens, valid = as_prompt_batch(cfg, prompts)
  rng = jax.random.key(0) if rng is None else rng
  b = tokens.shape[0]
  dp = 1 if mesh is None else mesh_lib.data_parallel_size(mesh,
                                                          mesh_lib.rules_from_config(rules))
  length = buckets.prompt_length(tokens.shape[1], options.get("gen_length", base.GEN_LENGTH),
                                 cfg.max_seq_len, pad_to)
  tokens, valid = buckets.pad_batch(tokens, valid, length,
                                    buckets.batch_size(b, batch_buckets, dp),
                                    base.output_pad_id(cfg))
  options = _pad_row_options(registry.get(method), options, b, tokens.shape[0])
  the_plan = protocol.plan(method, cfg, options)
  the_plan.decoder.check(tokens, valid)
  protocol.check_row_inputs(the_plan, tokens.shape[0])
  if mode == "shard_map":
    from dllm_jax.decoding import data_parallel  # pylint: disable=import-outside-toplevel
    out, _ = data_parallel.run_plan(params, the_plan, tokens, valid, rng, mesh=mesh,
                                    rules=rules)
  elif mesh is not None:
    out = protocol.run_on_mesh(the_plan, params, tokens, valid, rng, mesh,
                               mesh_lib.rules_from_config(rules))
  else:
    out = protocol.run_batch(the_plan.params(params), *base.prompt_inputs(tokens, valid), rng,
                             the_plan.traced, the_plan.row_inputs, decoder=the_plan.decoder)
  # The decoder flags; the error names rows of the caller's batch (padding rows dropped).
  return base.raise_if_nonfinite(_take_rows(out, b), on_nonfinite)


def _data_parallel_mode(data_parallel, mesh, rules) -> str | None:
  """The data-parallel implementation: None without a mesh, else "shard_map" or "spmd"."""
  modes = ("shard_map", "spmd")
  if data_parallel is not None and data_parallel not in modes:
    raise ValueError(f"data_parallel={data_parallel!r}: use one of {modes} (or None for the "
                     "default: `parallel.default_data_parallel`).")
  if mesh is None:
    return None
  rules = mesh_lib.rules_from_config(rules)
  if mesh_lib.data_parallel_size(mesh, rules) == 1:
    return "spmd"  # nothing to split: the two are the same program
  return data_parallel or mesh_lib.default_data_parallel(mesh, rules)


def _pad_row_options(decoder_cls, options: dict, b: int, rows: int) -> dict:
  """Per-prompt options (the decoder's `row_options`, one entry per caller row) extended
  to the padded batch by repeating the last entry, as `buckets.pad_batch` repeats the last
  prompt."""
  for name in decoder_cls.row_options:
    value = options.get(name)
    if value is None:
      continue
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != b:
      raise ValueError(f"{name} must be a list with one entry per prompt ({b}), got "
                       f"{value!r}.")
    options = dict(options, **{name: list(value) + [value[-1]] * (rows - b)})
  return options


def _take_rows(out: base.DecodeOutput, b: int) -> base.DecodeOutput:
  """The first b rows of every per-row field (the batch-bucket padding rows dropped)."""
  if out.tokens.shape[0] == b:  # no padding rows: six slices of ~0.1 ms each saved per call
    return out
  finite = None if out.finite is None else out.finite[:b]
  extra = {name: getattr(out, name)[:b] for name in getattr(out, "ROW_FIELDS", ())
           if getattr(out, name) is not None}  # per-row fields of a DecodeOutput subclass
  return out.replace(tokens=out.tokens[:b], lengths=out.lengths[:b],
                     committed=out.committed[:b], done=out.done[:b], finite=finite, **extra)
