"""LoRA adapters on the attention projections: add, split, merge, save and load.

The network's `Dense` layers (layers.py) carry `lora_a [in, r]` and `lora_b [r, out]` next to
each attention kernel whenever `cfg.lora_rank > 0`, and compute
`y = x @ kernel + (alpha / r) * dropout(x) @ lora_a @ lora_b`. The model gives adapters to all
four projections q, k, v, o; a subset of `targets` is obtained by giving the others all-zero
adapters (a = b = 0 is a fixed point of gradient descent: both gradients vanish) and leaving
them out of the trainable set, of `split_lora` and of saved files.

Params tree (scanned, leading layer axis Ly): layers/attn/{q,k,v,o}/{kernel [Ly, in, out],
lora_a [Ly, in, r], lora_b [Ly, r, out]}.

`save_lora` writes a directory with `lora_adapters.safetensors` (this package's tree paths as
keys, e.g. "layers/attn/q/lora_a") and `lora_config.json` (rank, alpha, dropout, targets).
The names differ from PEFT's on purpose: PEFT-format adapters (HF module names, A/B
transposed) are read and written by `dllm_jax.checkpoints.lora`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors import flax as st_flax

from dllm_jax.models.config import ModelConfig

LORA_TARGETS = ("q", "k", "v", "o")
ADAPTER_LEAVES = ("lora_a", "lora_b")
WEIGHTS_FILE = "lora_adapters.safetensors"
CONFIG_FILE = "lora_config.json"
FORMAT = "dllm_jax.lora/1"
_ATTN = ("layers", "attn")


def _check_targets(targets: Iterable[str]) -> tuple[str, ...]:
  targets = tuple(targets)
  bad = sorted(set(targets) - set(LORA_TARGETS))
  if bad or not targets:
    raise ValueError(f"LoRA targets must be a non-empty subset of {LORA_TARGETS}, got {targets}.")
  return tuple(t for t in LORA_TARGETS if t in targets)


def _flat(tree) -> dict[tuple[str, ...], Any]:
  return traverse_util.flatten_dict(tree)


def _is_adapter(path: tuple[str, ...], targets: Iterable[str] = LORA_TARGETS) -> bool:
  return (len(path) >= 2 and path[-1] in ADAPTER_LEAVES and path[-2] in tuple(targets))


def has_lora(params) -> bool:
  """True if the tree holds any adapter leaf."""
  return any(_is_adapter(p) for p in _flat(params))


def add_lora(params, cfg: ModelConfig, rng: jax.Array, rank: int, alpha: float,
             targets: Iterable[str] = LORA_TARGETS, dropout: float = 0.0):
  """Adds fresh adapters; returns (cfg with lora_rank/alpha/dropout, params with adapters).

  Targeted projections get `lora_a ~ U(-1/sqrt(in), 1/sqrt(in))` (PEFT's kaiming-uniform,
  a = sqrt(5)) and `lora_b = 0`, so the adapted model equals the base model at init.
  Untargeted projections get a = b = 0.
  """
  targets = _check_targets(targets)
  if rank <= 0:
    raise ValueError(f"LoRA rank must be positive, got {rank}.")
  if cfg.lora_rank or has_lora(params):
    raise ValueError("params already carry LoRA adapters (cfg.lora_rank="
                     f"{cfg.lora_rank}); merge_lora or strip_lora them first.")
  flat = dict(_flat(params))
  keys = jax.random.split(rng, len(LORA_TARGETS))
  for key, name in zip(keys, LORA_TARGETS):
    kernel_path = _ATTN + (name, "kernel")
    if kernel_path not in flat:
      raise ValueError(f"params have no {'/'.join(kernel_path)}; expected a dllm_jax "
                       "transformer params tree (see models.transformer.init_params).")
    kernel = flat[kernel_path]
    n_layers, d_in, d_out = kernel.shape
    if name in targets:
      bound = 1.0 / math.sqrt(d_in)
      a = jax.random.uniform(key, (n_layers, d_in, rank), jnp.float32, -bound, bound)
    else:
      a = jnp.zeros((n_layers, d_in, rank), jnp.float32)
    flat[_ATTN + (name, "lora_a")] = a.astype(kernel.dtype)
    flat[_ATTN + (name, "lora_b")] = jnp.zeros((n_layers, rank, d_out), kernel.dtype)
  new_cfg = cfg.replace(lora_rank=rank, lora_alpha=float(alpha), lora_dropout=float(dropout))
  return new_cfg, traverse_util.unflatten_dict(flat)


def split_lora(params, targets: Iterable[str] = LORA_TARGETS):
  """(base, lora): `lora` holds the adapters of `targets`, `base` everything else."""
  targets = _check_targets(targets)
  flat = _flat(params)
  lora = {p: v for p, v in flat.items() if _is_adapter(p, targets)}
  base = {p: v for p, v in flat.items() if not _is_adapter(p, targets)}
  return traverse_util.unflatten_dict(base), traverse_util.unflatten_dict(lora)


def merge_trees(base, lora):
  """Inverse of split_lora: the union of two disjoint trees."""
  flat_base, flat_lora = _flat(base), _flat(lora)
  overlap = sorted("/".join(p) for p in set(flat_base) & set(flat_lora))
  if overlap:
    raise ValueError(f"merge_trees got the same leaves in both trees: {overlap[:4]}.")
  return traverse_util.unflatten_dict({**flat_base, **flat_lora})


def strip_lora(params):
  """The params with every adapter removed (the base model, for cfg.lora_rank = 0)."""
  return split_lora(params)[0]


def merge_lora(params, cfg: ModelConfig):
  """Folds adapters into the kernels: W + (alpha / r) * a @ b (in float32, cast back).

  Returns (cfg with lora_rank = 0, params without adapters); the merged model's logits
  equal the adapted model's (up to rounding, dropout off).
  """
  if not cfg.lora_rank:
    raise ValueError("merge_lora needs a config with lora_rank > 0; nothing to merge.")
  flat = dict(_flat(params))
  for name in LORA_TARGETS:
    path = _ATTN + (name,)
    if path + ("lora_a",) not in flat:
      raise ValueError(f"params lack {'/'.join(path)}/lora_a although cfg.lora_rank="
                       f"{cfg.lora_rank}; were the adapters split off (merge_trees first)?")
    a = flat.pop(path + ("lora_a",)).astype(jnp.float32)
    b = flat.pop(path + ("lora_b",)).astype(jnp.float32)
    kernel = flat[path + ("kernel",)]
    delta = cfg.lora_scale * jnp.einsum("lir,lro->lio", a, b)
    flat[path + ("kernel",)] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
  new_cfg = cfg.replace(lora_rank=0, lora_alpha=0.0, lora_dropout=0.0)
  return new_cfg, traverse_util.unflatten_dict(flat)


def trainable_mask(params, targets: Iterable[str] = LORA_TARGETS):
  """Tree of bools, True on the adapters of `targets`: for `optax.masked`."""
  targets = _check_targets(targets)
  flat = _flat(params)
  return traverse_util.unflatten_dict({p: _is_adapter(p, targets) for p in flat})


def param_labels(params, targets: Iterable[str] = LORA_TARGETS):
  """Tree of "lora" / "frozen" labels: for `optax.multi_transform` (frozen -> set_to_zero)."""
  mask = trainable_mask(params, targets)
  return jax.tree.map(lambda m: "lora" if m else "frozen", mask)


@dataclasses.dataclass(frozen=True)
class LoraInfo:
  """What an adapter file says about its adapters."""
  rank: int
  alpha: float
  dropout: float
  targets: tuple[str, ...]


def save_lora(path: str, lora_params, cfg: ModelConfig) -> LoraInfo:
  """Writes only the adapters of `lora_params` (a full tree is filtered) to directory `path`."""
  if not cfg.lora_rank:
    raise ValueError("save_lora needs the adapted model's config (lora_rank > 0).")
  flat = {p: v for p, v in _flat(lora_params).items() if _is_adapter(p)}
  if not flat:
    raise ValueError("save_lora found no lora_a / lora_b leaves in the tree it was given.")
  targets = tuple(t for t in LORA_TARGETS if any(p[-2] == t for p in flat))
  for t in targets:
    if (_ATTN + (t, "lora_a") not in flat) or (_ATTN + (t, "lora_b") not in flat):
      raise ValueError(f"adapter {t!r} is incomplete: both lora_a and lora_b are needed.")
  info = LoraInfo(cfg.lora_rank, float(cfg.lora_alpha), float(cfg.lora_dropout), targets)
  os.makedirs(path, exist_ok=True)
  st_flax.save_file({"/".join(p): jnp.asarray(v) for p, v in flat.items()},
                    os.path.join(path, WEIGHTS_FILE))
  meta = {"format": FORMAT, **dataclasses.asdict(info), "targets": list(targets)}
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(meta, f, indent=2)
  return info


def load_lora(path: str):
  """Reads a `save_lora` directory; returns (adapter tree, LoraInfo)."""
  cfg_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
  for p in (cfg_path, weights_path):
    if not os.path.exists(p):
      raise ValueError(f"{p} does not exist; is {path!r} a directory written by save_lora?")
  with open(cfg_path) as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT:
    raise ValueError(f"{cfg_path} has format {meta.get('format')!r}, expected {FORMAT!r}.")
  info = LoraInfo(int(meta["rank"]), float(meta["alpha"]), float(meta["dropout"]),
                  _check_targets(meta["targets"]))
  tensors = st_flax.load_file(weights_path)
  tree = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in tensors.items()})
  return tree, info


def attach_lora(params, cfg: ModelConfig, lora_params, info: LoraInfo):
  """Puts loaded adapters on a base model; returns (adapted cfg, params).

  Untargeted projections get zero adapters, as in add_lora.
  """
  cfg0 = cfg.replace(lora_rank=0, lora_alpha=0.0, lora_dropout=0.0)
  new_cfg, zero = add_lora(strip_lora(params), cfg0, jax.random.key(0), info.rank, info.alpha,
                           targets=info.targets, dropout=info.dropout)
  base, fresh = split_lora(zero, info.targets)
  flat_fresh, flat_new = _flat(fresh), _flat(lora_params)
  if set(flat_fresh) != set(flat_new):
    raise ValueError(f"adapter leaves {sorted('/'.join(p) for p in flat_new)} do not match "
                     f"the model's {sorted('/'.join(p) for p in flat_fresh)}.")
  for p, v in flat_new.items():
    if v.shape != flat_fresh[p].shape:
      raise ValueError(f"adapter {'/'.join(p)} has shape {v.shape}, the model expects "
                       f"{flat_fresh[p].shape}; was it saved for another model?")
  cast = {p: jnp.asarray(v, flat_fresh[p].dtype) for p, v in flat_new.items()}
  return new_cfg, merge_trees(base, traverse_util.unflatten_dict(cast))


def num_lora_params(params) -> int:
  """Number of adapter weights in the tree."""
  return int(sum(np.prod(v.shape) for p, v in _flat(params).items() if _is_adapter(p)))
