"""Converted checkpoints (orbax, fast sharded reloads) and export back to HF safetensors.

  save_converted(path, cfg, params, tokenizer_dir=model_dir)
                                          path/params (orbax StandardSave) + path/model_config.json
                                          + the tokenizer and chat-template files of model_dir
  load_converted(path, mesh=...)          restores straight into NamedShardings (StandardRestore
                                          of ShapeDtypeStructs that carry their sharding)
  export_safetensors(params, cfg, out, family=...)
                                          config.json + model.safetensors (or shards + index)
                                          in the family's own names and layout

Every writer builds its directory atomically (atomic.py): a failure leaves nothing behind and
an existing directory is replaced only with `overwrite=True`. Every loader checks that the
weights are finite (models.finite) and never writes to the checkpoint it reads.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from dllm_jax.checkpoints import atomic, placement
from dllm_jax.checkpoints.families import PROJECTIONS, get_family
from dllm_jax.checkpoints.hf import hf_shape
from dllm_jax.checkpoints.safetensors_io import TensorSpec, write_checkpoint
from dllm_jax.models.config import ModelConfig, resolve_dtype
from dllm_jax.models.finite import check_finite

CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


def _tokenizer_files(tokenizer_dir) -> list[Path]:
  """The tokenizer / chat-template files of `tokenizer_dir`; it must hold tokenizer.json."""
  tokenizer_dir = Path(tokenizer_dir)
  if not (tokenizer_dir / "tokenizer.json").is_file():
    raise FileNotFoundError(f"tokenizer_dir={tokenizer_dir} holds no tokenizer.json; pass the "
                            "HF model directory the params were loaded from.")
  return [tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]


def config_to_json(cfg: ModelConfig) -> str:
  return json.dumps(dataclasses.asdict(cfg), indent=2)


def config_from_json(text: str, source: str = CONFIG_FILE) -> ModelConfig:
  fields = json.loads(text)
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"{source} has fields {unknown} that this dllm_jax version does not know; "
                     "it was written by a newer version: upgrade dllm_jax.")
  return ModelConfig(**fields)


def save_converted(path, cfg: ModelConfig, params, *, tokenizer_dir=None,
                   overwrite: bool = False) -> Path:
  """Writes params as an orbax checkpoint plus the ModelConfig as JSON, atomically.

  `tokenizer_dir` (the HF model directory the params came from) copies its tokenizer and
  chat-template files (TOKENIZER_FILES), so the converted directory decodes text on its own:
  `Sampler.load(path)` and `python -m dllm_jax.generate --model path` need them.
  """
  files = [] if tokenizer_dir is None else _tokenizer_files(tokenizer_dir)
  shapes, _ = placement.target_shardings(cfg)
  got = {p: tuple(x.shape) for p, x in placement.flatten(params).items()}
  want = {p: tuple(x.shape) for p, x in shapes.items()}
  if got != want:
    diff = sorted(set(got.items()) ^ set(want.items()))[:3]
    raise ValueError(f"params do not match cfg (first differences {diff}); save the cfg the "
                     "params were built with.")
  with atomic.atomic_directory(path, overwrite) as tmp:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    checkpointer.close()
    (tmp / CONFIG_FILE).write_text(config_to_json(cfg))
    for f in files:
      shutil.copy2(f, tmp / f.name)
  return Path(path)


def load_converted(path, *, mesh=None, rules=None):
  """Restores `(cfg, params)` from `save_converted`, each leaf directly on its sharding.

  Raises NonFiniteParamsError (a ValueError) naming any NaN / inf tensor.
  """
  path = Path(path)
  config_path = path / CONFIG_FILE
  if not config_path.is_file() or not (path / PARAMS_DIR).is_dir():
    raise FileNotFoundError(f"{path} is not a converted checkpoint (it needs {CONFIG_FILE} and "
                            f"{PARAMS_DIR}/); create one with save_converted.")
  cfg = config_from_json(config_path.read_text(), str(config_path))
  shapes, shardings = placement.target_shardings(cfg, mesh, rules)
  target = placement.unflatten({p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[p])
                                for p, s in shapes.items()})
  checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
  params = checkpointer.restore((path / PARAMS_DIR).absolute(),
                                args=ocp.args.StandardRestore(target))
  check_finite(params, str(path))
  return cfg, params


def _merged_layer(attn_or_mlp: dict, cfg: ModelConfig, layer: int, merge_lora: bool):
  kernel = np.asarray(attn_or_mlp["kernel"][layer])
  if merge_lora and "lora_a" in attn_or_mlp:
    a = np.asarray(attn_or_mlp["lora_a"][layer], np.float32)
    b = np.asarray(attn_or_mlp["lora_b"][layer], np.float32)
    kernel = (kernel.astype(np.float32) + cfg.lora_scale * (a @ b)).astype(kernel.dtype)
  return kernel


def export_safetensors(params, cfg: ModelConfig, out_dir, *, family: str,
                       dtype: str | None = None, max_shard_bytes: int = 4 * 1024**3,
                       merge_lora: bool = False, tokenizer_dir=None,
                       overwrite: bool = False) -> Path:
  """Writes `params` as a HF checkpoint of `family` (config.json + safetensors).

  Tensors are gathered to the host and written one (layer slice) at a time. `dtype` defaults
  to cfg.param_dtype. LoRA adapters must be merged (`merge_lora=True`) or exported separately
  with `export_lora_adapter`. `tokenizer_dir` copies the tokenizer files found there.
  """
  fam = get_family(family)
  hf_config = fam.export_config(cfg)
  np_dtype = np.dtype(resolve_dtype(dtype or cfg.param_dtype))
  if cfg.lora_rank and not merge_lora:
    raise ValueError("params carry LoRA adapters: pass merge_lora=True to fold them into the "
                     "exported weights, or export them with export_lora_adapter.")
  flat = placement.flatten(params)
  specs, source = [], {}
  for path, array in flat.items():
    if path[-1] in ("lora_a", "lora_b"):
      continue
    layers = range(cfg.n_layers) if path[0] == "layers" else [None]
    for layer in layers:
      name = fam.hf_name(path, layer)
      shape = array.shape[1:] if layer is not None else array.shape
      specs.append(TensorSpec(name, np_dtype, hf_shape(path, shape)))
      source[name] = (path, layer)

  def produce(name):
    path, layer = source[name]
    if layer is None:
      host = np.asarray(flat[path])
    elif path[-1] == "kernel" and path[1:3] in PROJECTIONS.values():
      module = params["layers"][path[1]][path[2]]
      host = _merged_layer(module, cfg, layer, merge_lora)
    else:
      host = np.asarray(flat[path][layer])
    if path[-1] == "kernel":
      host = host.T
    return np.ascontiguousarray(host, dtype=np_dtype)

  hf_config["dtype"] = np_dtype.name
  with atomic.atomic_directory(out_dir, overwrite) as tmp:
    write_checkpoint(tmp, specs, produce, max_shard_bytes)
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    if tokenizer_dir is not None:
      for f in _tokenizer_files(tokenizer_dir):
        shutil.copy2(f, tmp / f.name)
  return Path(out_dir)
