"""PEFT LoRA adapters: read (to apply or to merge) and write back.

A PEFT adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `lora_dropout`,
`target_modules`, ...) and `adapter_model.safetensors` with, per adapted linear `<module>`:

  base_model.model.<module>.lora_A.weight   A [r, in]
  base_model.model.<module>.lora_B.weight   B [out, r]      y = W x + s * B A x

with s = lora_alpha / r (lora_alpha / sqrt(r) under `use_rslora`). In our [in, out] kernel
layout the same update is `kernel += s * A.T @ B.T`; as adapters, `lora_a = A.T` [in, r] and
`lora_b = B.T` [r, out]. The model has adapters on q/k/v/o only; merging also accepts the MLP
projections. Projections the adapter does not target get all-zero factors (an exact no-op).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from dllm_jax.checkpoints import atomic
from dllm_jax.checkpoints.families import LORA_PROJECTIONS, PROJECTIONS, Family, get_family
from dllm_jax.checkpoints.safetensors_io import TensorSpec, TensorStore, write_file
from dllm_jax.checkpoints.tokenizer import read_json
from dllm_jax.models.config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def projection_dims(cfg: ModelConfig, projection: str) -> tuple[int, int]:
  """(in, out) features of a projection."""
  q, kv = cfg.n_heads * cfg.resolved_head_dim, cfg.n_kv_heads * cfg.resolved_head_dim
  return {"q": (cfg.d_model, q), "k": (cfg.d_model, kv), "v": (cfg.d_model, kv),
          "o": (q, cfg.d_model), "gate": (cfg.d_model, cfg.mlp_dim),
          "up": (cfg.d_model, cfg.mlp_dim), "down": (cfg.mlp_dim, cfg.d_model)}[projection]


def lora_names(family: Family, projection: str, layer: int) -> tuple[str, str]:
  module = _PREFIX + family.module_name(projection, layer)
  return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
  """A validated adapter: which (projection, layer) it adapts and how to read its factors."""
  store: TensorStore
  family: Family
  rank: int
  scale: float
  dropout: float
  targets: frozenset[tuple[str, int]]

  @property
  def projections(self) -> set[str]:
    return {p for p, _ in self.targets}

  def factors(self, projection: str, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(lora_a [in, r], lora_b [r, out]) in float32, or None if not adapted."""
    if (projection, layer) not in self.targets:
      return None
    name_a, name_b = lora_names(self.family, projection, layer)
    a = self.store.read(name_a).astype(np.float32)
    b = self.store.read(name_b).astype(np.float32)
    return a.T, b.T

  def delta(self, projection: str, layer: int) -> np.ndarray | None:
    """s * A.T @ B.T [in, out] in float32, the update of our kernel; None if not adapted."""
    ab = self.factors(projection, layer)
    return None if ab is None else self.scale * (ab[0] @ ab[1])


def _check_supported(config: dict, path: Path):
  if str(config.get("peft_type", "LORA")).upper() != "LORA":
    raise ValueError(f"{path}: peft_type={config.get('peft_type')!r}; only LORA is supported.")
  for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
    if config.get(key) == bad:
      raise ValueError(f"{path}: {key}={bad} is not supported; merge the adapter with PEFT's "
                       "merge_and_unload() and load the merged model instead.")
  if config.get("bias", "none") != "none":
    raise ValueError(f"{path}: bias={config['bias']!r}; only bias='none' adapters are supported.")
  for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
    if config.get(key):
      raise ValueError(f"{path}: {key}={config[key]!r} is not supported (per-module ranks or "
                       "saved full modules); merge the adapter with PEFT first.")


def _resolve_targets(config: dict, family: Family, cfg: ModelConfig, path: Path):
  layers = config.get("layers_to_transform")
  layers = (range(cfg.n_layers) if layers is None else
            [layers] if isinstance(layers, int) else layers)
  modules = {(p, i): family.module_name(p, i) for p in PROJECTIONS for i in range(cfg.n_layers)}
  suffixes = sorted({family.module_name(p, 0).rsplit(".", 1)[-1] for p in PROJECTIONS})
  target = config.get("target_modules")
  if target == "all-linear":
    return frozenset(key for key in modules if key[1] in layers)
  if isinstance(target, str):
    found = {k for k, name in modules.items() if re.fullmatch(target, name)}
    if not found:
      raise ValueError(f"{path}: target_modules regex {target!r} matches no {family.name} "
                       f"linear layer; they are named like {modules[('q', 0)]!r}.")
    return frozenset(found)
  if not isinstance(target, (list, tuple)) or not target:
    raise ValueError(f"{path}: target_modules must be a list of module names or a regex, "
                     f"got {target!r}.")
  found = set()
  for t in target:
    hits = {k for k, n in modules.items() if (n == t or n.endswith("." + t)) and k[1] in layers}
    if not hits:
      raise ValueError(f"{path}: unknown LoRA target module {t!r} for a {family.name} model; "
                       f"its linear modules are {suffixes}.")
    found |= hits
  return frozenset(found)


def read_adapter(adapter_dir, family: Family, cfg: ModelConfig, *, merge: bool) -> LoraAdapter:
  """Validates a PEFT adapter against the base model `cfg` (before anything is read)."""
  adapter_dir = Path(adapter_dir)
  config_path = adapter_dir / ADAPTER_CONFIG
  if not config_path.is_file():
    raise FileNotFoundError(f"{config_path} does not exist; an adapter directory needs "
                            f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}.")
  config = read_json(config_path)
  _check_supported(config, config_path)
  rank = int(config.get("r", 0))
  if rank <= 0:
    raise ValueError(f"{config_path}: r must be a positive integer, got {config.get('r')!r}.")
  alpha = float(config.get("lora_alpha", 8))
  scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
  targets = _resolve_targets(config, family, cfg, config_path)
  if not merge and (extra := sorted({p for p, _ in targets} - set(LORA_PROJECTIONS))):
    raise ValueError(
        f"{config_path}: the adapter targets {[family.module_name(p, 0) for p in extra]}, but "
        f"dllm_jax carries adapters on q/k/v/o only; load with merge_lora=True to fold them "
        "into the base weights.")
  store = TensorStore.from_file(adapter_dir / ADAPTER_WEIGHTS)
  expected = {}
  for projection, layer in targets:
    d_in, d_out = projection_dims(cfg, projection)
    name_a, name_b = lora_names(family, projection, layer)
    expected[name_a], expected[name_b] = (rank, d_in), (d_out, rank)
  missing = sorted(set(expected) - set(store.names()))
  if missing:
    raise ValueError(f"{store.description} lacks {len(missing)} LoRA tensors that "
                     f"{ADAPTER_CONFIG} implies, e.g. {missing[:3]}; the adapter is incomplete "
                     "or was trained for a different base model.")
  extra = sorted(set(store.names()) - set(expected))
  if extra:
    raise ValueError(f"{store.description} has tensors {ADAPTER_CONFIG} does not describe, "
                     f"e.g. {extra[:3]}; check target_modules / layers_to_transform.")
  for name, shape in expected.items():
    if store.shape(name) != shape:
      raise ValueError(f"{store.description}: {name} has shape {store.shape(name)}, expected "
                       f"{shape} for r={rank} on this base model; wrong base model or rank.")
  return LoraAdapter(store, family, rank, scale, float(config.get("lora_dropout", 0.0)),
                     targets)


def export_lora_adapter(params, cfg: ModelConfig, out_dir, *, family: str,
                        base_model_name_or_path: str | None = None,
                        overwrite: bool = False) -> Path:
  """Writes the q/k/v/o adapters of `params` as a PEFT adapter directory.

  Projections whose two factors are all zero (never adapted) are left out. Factors are
  written in the dtype they are stored in.
  """
  family = get_family(family)
  if cfg.lora_rank <= 0:
    raise ValueError("cfg.lora_rank is 0: these params carry no LoRA adapters to export.")
  attn = params["layers"]["attn"]
  projections = [p for p in LORA_PROJECTIONS
                 if np.any(np.asarray(attn[p]["lora_a"])) or np.any(np.asarray(attn[p]["lora_b"]))]
  if not projections:
    raise ValueError("every LoRA factor is zero: there is no adapter to export.")
  specs, source = [], {}
  for layer in range(cfg.n_layers):
    for p in projections:
      name_a, name_b = lora_names(family, p, layer)
      for name, leaf in ((name_a, "lora_a"), (name_b, "lora_b")):
        array = attn[p][leaf]
        specs.append(TensorSpec(name, np.dtype(array.dtype), tuple(array.shape[1:][::-1])))
        source[name] = (array, layer)

  def produce(name):
    array, layer = source[name]
    return np.ascontiguousarray(np.asarray(array[layer]).T)

  config = dict(
      peft_type="LORA", task_type="CAUSAL_LM", r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
      lora_dropout=cfg.lora_dropout,
      target_modules=[family.module_name(p, 0).rsplit(".", 1)[-1] for p in projections],
      bias="none", fan_in_fan_out=False, use_rslora=False, use_dora=False,
      modules_to_save=None, layers_to_transform=None, rank_pattern={}, alpha_pattern={},
      inference_mode=True, base_model_name_or_path=base_model_name_or_path)
  with atomic.atomic_directory(out_dir, overwrite) as tmp:
    write_file(tmp / ADAPTER_WEIGHTS, specs, produce)
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
  return Path(out_dir)
