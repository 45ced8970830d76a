"""`generate`: one entry point for every decoder, on one device or a mesh.

Shape legend: B batch, P padded prompt length, G gen_length.

    out = generate(params, cfg, [[1, 5, 6], [1, 7]], method="fast_dllm", gen_length=64,
                   block_length=16, cache="dual")
    out.tokens  # [B, G], cut after each row's first EOS

Options are checked against the method's options dataclass (or, for decoders living in other
modules, against the decoder's keyword-only parameters): a misspelt option is an error, never
silently ignored. `option_names(method)` lists them (the shared vocabulary is in the package
docstring); the old D2F spelling `block_size` is an error that says to use `block_length`.

Rows whose logits were ever non-finite are flagged in `DecodeOutput.finite`; `generate`
raises `NonFiniteLogitsError` naming them unless `on_nonfinite="flag"`.

With `mesh=`, the batch is split over the mesh's data axes (rows are padded to a multiple of
the data-parallel size by repeating the last row, then dropped). Parameters already on the
mesh's devices stay where they are; host or single-device parameters are placed by
`parallel.mesh.param_shardings` (tensor / fsdp axes). The same jitted decoder then runs as
one SPMD program; rows are independent and each row's random keys depend only on its index,
so the tokens equal single-device decoding.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np

from dllm_jax.decoding import ar, base, fast_dllm, llada
from dllm_jax.models.config import ModelConfig
from dllm_jax.parallel import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class Method:
  """Where a decoder lives: module, function name and (if any) its options dataclass."""
  module: str
  function: str
  options: type | None = None


METHODS: dict[str, Method] = {
    "ar": Method("dllm_jax.decoding.ar", "ar_generate", ar.AROptions),
    "llada": Method("dllm_jax.decoding.llada", "llada_generate", llada.LLaDAOptions),
    "dream": Method("dllm_jax.decoding.llada", "dream_generate", llada.LLaDAOptions),
    "fast_dllm": Method("dllm_jax.decoding.fast_dllm", "fast_dllm_generate",
                        fast_dllm.FastDLLMOptions),
    # Imported when first used, so this module works before/without them.
    "d2f": Method("dllm_jax.decoding.d2f", "d2f_generate"),
    "block_diffusion": Method("dllm_jax.decoding.d2f", "block_diffusion_generate"),
    # Hybrids: a drafter (AR, D2F or block diffusion) verified by an AR target, and one
    # network that verifies causally and drafts by diffusion in the same forward.
    "speculative": Method("dllm_jax.decoding.speculative", "speculative_generate"),
    "selfspec": Method("dllm_jax.decoding.selfspec", "selfspec_generate"),
}


def resolve(method: str):
  """Returns the decoder function of `method` (importing its module on first use)."""
  if method not in METHODS:
    raise ValueError(f"Unknown decoding method {method!r}; use one of {sorted(METHODS)}.")
  entry = METHODS[method]
  try:
    module = importlib.import_module(entry.module)
  except ModuleNotFoundError as e:
    if e.name != entry.module:
      raise
    raise ValueError(f"method {method!r} needs {entry.module}, which is not installed in this "
                     "checkout.") from None
  return getattr(module, entry.function)


@functools.lru_cache(maxsize=None)
def _option_names(method: str) -> tuple[str, ...]:
  entry = METHODS[method]
  if entry.options is not None:
    return tuple(f.name for f in dataclasses.fields(entry.options)) + ("on_nonfinite",)
  params = inspect.signature(resolve(method)).parameters.values()
  return tuple(p.name for p in params
               if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _NOT_OPTIONS)


def option_names(method: str) -> list[str]:
  """The options `method` accepts (its dataclass fields or keyword-only parameters, plus
  on_nonfinite)."""
  if method not in METHODS:
    resolve(method)  # raises the unknown-method error
  return list(_option_names(method))


# Keywords `generate` owns itself (placement), that would change its return type, or that
# only exist to reject an old spelling.
_NOT_OPTIONS = ("mesh", "rules", "return_state", "return_stats", "block_size")
# Old option names -> the shared name (rejected with a message naming the new one).
RENAMED = {"block_size": "block_length"}


def check_options(method: str, options: dict) -> None:
  """Raises ValueError naming unknown options and listing the valid ones."""
  valid = option_names(method)
  for old, new in RENAMED.items():
    if old in options and new in valid:
      raise ValueError(f"option {old}={options[old]!r}: the option is called {new} (the same "
                       f"name in every decoding method); pass {new} instead.")
  unknown = sorted(set(options) - set(valid))
  if unknown:
    raise ValueError(f"Unknown option(s) {unknown} for method {method!r}; valid options: "
                     f"{sorted(valid)}.")


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


def generate(params, cfg: ModelConfig, prompts, *, method: str = "llada", rng=None, mesh=None,
             rules=None, **options) -> base.DecodeOutput:
  """Decodes a prompt batch with `method` and returns a `base.DecodeOutput`.

  Args:
    params: model parameters.
    cfg: the model config.
    prompts: list of token-id lists (left padded here) or a (tokens, valid) pair.
    method: one of METHODS: "ar", "llada", "dream", "fast_dllm", "d2f", "block_diffusion".
    rng: PRNG key for sampling (default key 0).
    mesh: optional `jax.sharding.Mesh` (see parallel.mesh.make_mesh) to decode on.
    rules: logical-axis rules for the mesh (default parallel.mesh.DEFAULT_RULES).
    **options: the method's options (e.g. gen_length, block_length, steps, threshold;
      `option_names(method)`), and on_nonfinite: "raise" (default: NonFiniteLogitsError
      naming the rows whose logits were ever NaN/inf) or "flag" (return them with
      `finite` False and `lengths` 0).
  """
  fn = resolve(method)
  check_options(method, options)
  on_nonfinite = options.get("on_nonfinite", "raise")
  base.check_on_nonfinite(on_nonfinite)
  tokens, valid = as_prompt_batch(cfg, prompts)
  rng = jax.random.key(0) if rng is None else rng
  if mesh is None:
    return fn(params, cfg, tokens, valid, rng, **options)
  # The decoder flags; the error names rows of the caller's batch (padding rows dropped).
  out = _generate_on_mesh(fn, params, cfg, tokens, valid, rng, mesh,
                          mesh_lib.rules_from_config(rules), dict(options, on_nonfinite="flag"))
  return base.raise_if_nonfinite(out, on_nonfinite)


def _generate_on_mesh(fn, params, cfg, tokens, valid, rng, mesh, rules, options):
  """Places the batch (and params not yet on the mesh) and runs `fn` as one SPMD program."""
  b = tokens.shape[0]
  dp = mesh_lib.data_parallel_size(mesh, rules)
  extra = -b % dp
  if extra:  # Repeat the last row: it finishes with it, so it never lengthens the loop.
    tokens = np.concatenate([tokens, np.repeat(tokens[-1:], extra, 0)])
    valid = np.concatenate([valid, np.repeat(valid[-1:], extra, 0)])
  if "mesh" in inspect.signature(fn).parameters:  # the decoder places its inputs itself
    return _take_rows(fn(params, cfg, tokens, valid, rng, mesh=mesh, rules=rules, **options), b)
  params = base.place_params(params, cfg, mesh, rules)
  batch = mesh_lib.batch_sharding(mesh, 2, rules)
  tokens, valid = jax.device_put(tokens, batch), jax.device_put(valid, batch)
  rng = jax.device_put(rng, mesh_lib.replicated(mesh))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    out = fn(params, cfg, tokens, valid, rng, **options)
  return _take_rows(out, b)


def _take_rows(out: base.DecodeOutput, b: int) -> base.DecodeOutput:
  finite = None if out.finite is None else out.finite[:b]
  return out.replace(tokens=out.tokens[:b], lengths=out.lengths[:b],
                     committed=out.committed[:b], done=out.done[:b], finite=finite)
