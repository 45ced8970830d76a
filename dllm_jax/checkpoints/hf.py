"""Load a local HF checkpoint directory into a dllm_jax `(ModelConfig, params)`.

    cfg, params = load_pretrained("/models/LLaDA-8B-Instruct", mesh=mesh)

Order of work, so that every error comes before any tensor is read or anything compiled:
  1. `config.json` -> family (llama / qwen2 / llada / dream) -> ModelConfig; special ids from
     config.json, generation_config.json and the tokenizer files (see tokenizer.py).
  2. Safetensors headers (single file or index + shards) are parsed and checked: every tensor
     the config implies exists with the implied shape, and no tensor is left unexplained
     (an unused one, such as a separate head under a tied config, is an error unless
     `strict=False`).
  3. Placement is decided from `abstract_params(cfg)` (+ `param_shardings` on `mesh`).
  4. Tensors are read one at a time, transposed ([out, in] -> [in, out]) and converted on
     the host, and placed straight onto their sharding; stacked layer leaves are assembled on
     device layer by layer (placement.py).

Peak host memory is a few copies of the largest single tensor (read buffer, converted
and contiguous transposed copies; with `merge_lora`, also the float32 merge). No stacked
[L, ...] parameter ever exists on the host; on device, a stacked leaf under construction
coexists with one layer slice. On a CPU backend "device" memory is host memory too, so there
the total is the loaded model plus that working set.

Shapes: L layers, D d_model, V vocab, F mlp width, H/K heads, Dh head dim.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import ml_dtypes
import numpy as np

from dllm_jax.checkpoints import lora as lora_lib
from dllm_jax.checkpoints import placement
from dllm_jax.checkpoints.families import PROJECTIONS, Family, detect_family
from dllm_jax.checkpoints.safetensors_io import TensorStore
from dllm_jax.checkpoints.tokenizer import read_json, special_token_ids
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.finite import check_finite

LOAD_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
_PROJECTION_OF = {prefix: name for name, prefix in PROJECTIONS.items()}


def load_dtype(dtype: str) -> np.dtype:
  if dtype not in LOAD_DTYPES:
    raise ValueError(f"dtype={dtype!r} is not supported for loading; use one of "
                     f"{sorted(LOAD_DTYPES)}.")
  return LOAD_DTYPES[dtype]


# Stored dtype (safetensors code) -> load dtype when none is asked for. float16 widens to
# float32 (exact); bfloat16 would round it.
_CHECKPOINT_DTYPES = {"BF16": "bfloat16", "F32": "float32", "F16": "float32", "F64": "float32"}


def checkpoint_dtype(store: TensorStore) -> str:
  """The load dtype that keeps a checkpoint's own precision: its most common float dtype."""
  counts: dict[str, int] = {}
  for name in store.names():
    code = store.infos[name].dtype
    if code in _CHECKPOINT_DTYPES:
      counts[code] = counts.get(code, 0) + store.infos[name].nbytes
  if not counts:
    return "bfloat16"
  return _CHECKPOINT_DTYPES[max(counts, key=counts.get)]


def read_config(model_dir) -> dict:
  path = Path(model_dir) / "config.json"
  if not path.is_file():
    raise FileNotFoundError(f"{path} does not exist; point at a HF model directory that holds "
                            "config.json and the safetensors weights.")
  return read_json(path)


def _model_config(model_dir: Path, config: dict, family: Family, shapes: dict,
                  dtype: str) -> ModelConfig:
  """The ModelConfig of config.json (+ the stored tensors' `shapes`, + special ids)."""
  fields = family.parse_config(config, shapes)
  fields.update(special_token_ids(model_dir, config))
  try:
    return ModelConfig(**fields, param_dtype=dtype, dtype=dtype,
                       name=f"{family.name}:{model_dir.name}")
  except ValueError as e:
    raise ValueError(f"{model_dir}: the config implies an invalid model: {e}") from None


def _open(model_dir: Path, dtype: str | None) -> tuple[ModelConfig, Family, TensorStore]:
  config = read_config(model_dir)
  family = detect_family(config, str(model_dir / "config.json"))
  store = TensorStore.from_directory(model_dir)
  dtype = checkpoint_dtype(store) if dtype is None else dtype
  shapes = {n: store.shape(n) for n in store.names()}
  return _model_config(model_dir, config, family, shapes, dtype), family, store


def config_from_hf(model_dir, dtype: str | None = None) -> tuple[ModelConfig, Family]:
  """ModelConfig (with special ids) and family of a HF model directory.

  Reads config.json, the tokenizer files and the safetensors headers; no tensor data. `dtype`
  None keeps the checkpoint's own (see `checkpoint_dtype`).
  """
  if dtype is not None:
    load_dtype(dtype)
  cfg, family, _ = _open(Path(model_dir), dtype)
  return cfg, family


def config_without_weights(model_dir,
                           dtype: str | None = None) -> tuple[ModelConfig, Family]:
  """ModelConfig and family from config.json (and the tokenizer files) alone.

  No safetensors file is opened, so this works on a directory that holds no weights (a dry
  run). `dtype` None takes config.json's `torch_dtype` / `dtype` when it is one of
  LOAD_DTYPES, else bfloat16.
  """
  model_dir = Path(model_dir)
  config = read_config(model_dir)
  family = detect_family(config, str(model_dir / "config.json"))
  if dtype is None:
    stored = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    dtype = stored if stored in LOAD_DTYPES else "bfloat16"
  load_dtype(dtype)
  return _model_config(model_dir, config, family, {}, dtype), family


def hf_shape(path, shape) -> tuple[int, ...]:
  """HF shape of one (per-layer) leaf: kernels are stored transposed."""
  return tuple(shape)[::-1] if path[-1] == "kernel" else tuple(shape)


def tensor_plan(family: Family, cfg: ModelConfig, shapes) -> dict:
  """{leaf path: ([HF names], HF shape of one name)} for every non-LoRA leaf."""
  plan = {}
  for path, leaf in shapes.items():
    if path[-1] in ("lora_a", "lora_b"):
      continue
    if path[0] == "layers":
      plan[path] = ([family.hf_name(path, i) for i in range(cfg.n_layers)],
                    hf_shape(path, leaf.shape[1:]))
    else:
      plan[path] = ([family.hf_name(path)], hf_shape(path, leaf.shape))
  return plan


def check_tensors(store: TensorStore, plan: dict, family: Family, cfg: ModelConfig, *,
                  strict: bool = True) -> list[str]:
  """Every implied tensor exists with its shape, and every stored tensor is used.

  A stored tensor the model would not use (a separate LM head under a tied config, a layer
  past the layer count, a bias the config turns off, any unknown name) is an error naming
  it and the config key that drops it; `strict=False` logs a warning instead. Known
  non-parameter buffers (`family.ignorable`) are allowed by name. Returns the unused names.
  """
  expected = {name: (path, shape) for path, (names, shape) in plan.items() for name in names}
  missing = [n for n in expected if n not in store]
  head = family.global_names[("lm_head", "kernel")]
  if missing == [head]:
    raise ValueError(
        f"{store.description} has no LM head {head!r}, but config.json does not set "
        f"{family.tying_key}: true, so the model needs one; set {family.tying_key}: true in "
        "config.json if the model ties its head to the embedding.")
  if missing:
    raise ValueError(
        f"{store.description} lacks {len(missing)} tensor(s) that config.json implies for a "
        f"{family.name} model, e.g. {missing[:3]}; the checkpoint is incomplete or config.json "
        f"describes a different model (check {family.layers_key} and {family.tying_key}).")
  unused = [n for n in store.names() if n not in expected and not family.is_ignorable(n)]
  if cfg.tie_embeddings and head in unused and _same_tensor(store, head, _embed_name(family)):
    unused.remove(head)  # a stored copy of the tied embedding: tying uses exactly it
  if unused:
    reasons = "; ".join(f"{n!r} ({_unused_reason(n, family, cfg)})" for n in unused[:3])
    more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
    message = (f"{store.description} holds {len(unused)} tensor(s) that a {family.name} model "
               f"of this config.json does not use: {reasons}{more}.")
    if strict:
      raise ValueError(
          f"{message} Loading would drop them without a word; fix config.json or the "
          "weights, or load with strict=False (CLI: --allow_unused_weights) to ignore them.")
    logging.getLogger(__name__).warning("%s They are ignored (strict=False).", message)
  for name, (path, shape) in expected.items():
    if store.shape(name) != shape:
      raise ValueError(
          f"tensor {name!r} in {store.infos[name].path.name} has shape {store.shape(name)}, "
          f"but config.json implies {shape} (parameter {'/'.join(path)}); config.json and the "
          "weights do not belong together.")
  return unused


def _embed_name(family: Family) -> str:
  return family.global_names[("embed", "embedding")]


def _same_tensor(store: TensorStore, a: str, b: str) -> bool:
  """Whether stored tensors `a` and `b` hold the same values (read only when shapes agree)."""
  if b not in store or store.shape(a) != store.shape(b):
    return False
  return bool(np.array_equal(store.read(a), store.read(b)))


def _unused_reason(name: str, family: Family, cfg: ModelConfig) -> str:
  """The config.json key that leaves stored tensor `name` unused."""
  if name == family.global_names[("lm_head", "kernel")]:
    return (f"config.json sets {family.tying_key}=true, so the head is the embedding "
            f"{_embed_name(family)!r} and this different stored head would be dropped; set "
            f"{family.tying_key}: false to use it")
  prefix = re.escape(family.layer_prefix).replace(re.escape("{i}"), r"(\d+)")
  layer = re.match(prefix, name)
  if layer and int(layer.group(1)) >= cfg.n_layers:
    return f"layer {layer.group(1)}, but config.json sets {family.layers_key}={cfg.n_layers}"
  if name.endswith(".bias"):
    return f"a bias, which config.json's {family.bias_key} turns off"
  return f"no {family.name} parameter has this name; check model_type in config.json"


def _host_leaf(store, name, path, layer, dtype, adapter):
  """One tensor in our layout and dtype, with a LoRA update merged in float32 if asked."""
  host = store.read(name)
  if path[-1] == "kernel":
    host = host.T
  projection = _PROJECTION_OF.get(path[1:3]) if path[0] == "layers" else None
  delta = adapter.delta(projection, layer) if adapter is not None and projection else None
  if delta is not None:
    host = host.astype(np.float32) + delta
  return np.asarray(host, dtype=dtype, order="C")


def load_pretrained(model_dir, *, dtype: str | None = None, mesh=None, rules=None,
                    adapter_dir=None, merge_lora: bool = False, strict: bool = True):
  """Loads a HF model directory as `(ModelConfig, params)`.

  Args:
    model_dir: local directory with config.json and model.safetensors (or an index + shards).
    dtype: "bfloat16" or "float32": parameter and compute dtype; None (default) keeps the
      checkpoint's own (bfloat16 stays bfloat16, float32 stays float32, float16 -> float32).
    mesh: a `jax.sharding.Mesh` (see `dllm_jax.parallel.mesh.make_mesh`); None puts every
      parameter on the first device.
    rules: logical-axis rules (pairs) for `mesh`; default `DEFAULT_RULES`.
    adapter_dir: a PEFT LoRA adapter directory to apply (or merge) on top.
    merge_lora: fold the adapter into the base kernels (`W += s * A.T @ B.T`, in float32)
      instead of returning `lora_a` / `lora_b` leaves and a cfg with `lora_rank` set.
    strict: a stored tensor the model does not use (see `check_tensors`) is an error;
      False loads anyway and logs a warning naming the ignored tensors.

  Returns:
    (cfg, params) where params matches `init_params(cfg, ...)` leaf for leaf.

  Raises:
    ValueError naming the tensor and the config.json key when the files and the config
    disagree (a missing tensor, a wrong shape, an unused tensor unless `strict=False`).
    NonFiniteParamsError (a ValueError) naming the tensor when a weight of the checkpoint or
    of the adapter is NaN or inf. Nothing on disk is ever written.
  """
  if dtype is not None:
    load_dtype(dtype)  # a bad request fails before any file is read
  cfg, family, store = _open(Path(model_dir), dtype)
  np_dtype = load_dtype(cfg.param_dtype)
  adapter = None
  if adapter_dir is not None:
    adapter = lora_lib.read_adapter(adapter_dir, family, cfg, merge=merge_lora)
    # Checked on its own first, so the error names the adapter's tensor, not a merged kernel.
    check_finite({n: adapter.store.read(n) for n in adapter.store.names()}, str(adapter_dir))
    if not merge_lora:
      cfg = cfg.replace(lora_rank=adapter.rank, lora_alpha=adapter.scale * adapter.rank,
                        lora_dropout=adapter.dropout)
  shapes, shardings = placement.target_shardings(cfg, mesh, rules)
  plan = tensor_plan(family, cfg, shapes)
  check_tensors(store, plan, family, cfg, strict=strict)
  merge = adapter if merge_lora else None

  params = {}
  for path, leaf in shapes.items():
    if path[-1] in ("lora_a", "lora_b"):
      read = _lora_reader(adapter, path, leaf.shape[1:], np_dtype)
      params[path] = placement.stack_layers(leaf.shape, np_dtype, shardings[path], read)
      continue
    names = plan[path][0]
    if path[0] == "layers":
      read = lambda i, names=names, path=path: _host_leaf(store, names[i], path, i, np_dtype,
                                                          merge)
      params[path] = placement.stack_layers(leaf.shape, np_dtype, shardings[path], read)
    else:
      params[path] = placement.put(_host_leaf(store, names[0], path, None, np_dtype, None),
                                   shardings[path])
  params = placement.unflatten(params)
  check_finite(params, str(model_dir))
  return cfg, params


def _lora_reader(adapter, path, shape, dtype):
  projection, factor = _PROJECTION_OF[path[1:3]], path[-1]

  def read(layer):
    ab = adapter.factors(projection, layer)
    if ab is None:
      return np.zeros(shape, dtype)
    return np.asarray(ab[0] if factor == "lora_a" else ab[1], dtype=dtype, order="C")
  return read
