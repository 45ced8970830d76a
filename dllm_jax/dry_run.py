"""Dry run: will a decode fit the devices? Bytes per device from config.json alone.

    report = dry_run.plan_checkpoint("/ckpt/LLaDA-8B-Instruct", method="d2f",
                                     mesh={"fsdp": 8}, batch=8, prompt_len=512,
                                     gen_length=256, device_memory="16GiB",
                                     data_parallel="spmd", block_length=32)
    print(report.table())          # per-device bytes: params, K/V cache, decode state, activations
    report.check()                 # DoesNotFit (a ValueError) with one line naming the change

Nothing is allocated and no weight file is opened: the params tree and the decoder's state
are `jax.eval_shape` results (`models.abstract_params`, the decoder's `init`), and each
leaf's per-device shape is `NamedSharding(AbstractMesh, spec).shard_shape(shape)` under the
placement the real run uses (`parallel.mesh.param_shardings`; the state's batch axis over
the mesh's data axes, cache kv heads over `tensor` when they divide). Activations are an
estimate from the model's shapes (docs/design.md, "The dry run's accounting").

Shape legend: B batch (padded as `generate` pads it), P padded prompt length, G gen_length,
T tokens of the widest forward, S keys it attends, L layers, D d_model, H/K heads, Dh head
dim, F mlp width, V vocab, b = B / (data-parallel size) rows per device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from dllm_jax.checkpoints import hf
from dllm_jax.decoding import buckets, protocol, registry
from dllm_jax.models import kv_cache
from dllm_jax.models.config import ModelConfig, resolve_dtype
from dllm_jax.models.transformer import abstract_params
from dllm_jax.parallel import mesh as mesh_lib

GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
MODES = ("shard_map", "spmd")
# Attention patterns whose widest forward is the prompt's prefill (T = P); every other
# decoder may forward the whole canvas at once (T = P + G).
_PREFILL_ATTENTION = ("causal", "selfspec")


class DoesNotFit(ValueError):
  """The plan needs more memory per device than the budget (the message is one line)."""


def parse_bytes(text) -> int:
  """'16GiB', '16 GB', '1.5e10' or an int -> bytes."""
  if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
    return int(text)
  match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
  unit = match and match.group(2).lower()
  if not match or unit not in _UNITS:
    raise ValueError(f"device memory {text!r} is not a size; write it like 16GiB, 80GB or "
                     "17179869184 (bytes).")
  return int(float(match.group(1)) * _UNITS[unit])


def device_memory() -> int | None:
  """The first device's memory limit in bytes (GPUs and TPUs report one), else None."""
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return int(limit) if limit else None


def _gib(n) -> str:
  return f"{n / GiB:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class DryRun:
  """Per-device bytes of one decode plan (every `*_bytes` is per device).

  Attributes:
    model: the model's name; method: the decoding method.
    mesh: {axis: size}; devices: their product; data_parallel: "shard_map" or "spmd".
    batch / padded_batch: rows asked for / rows decoded (`generate` pads to a power of two
      and a multiple of the data-parallel size); rows_per_device: padded_batch / dp.
    prompt_len / padded_prompt_len, gen_length: P asked for / its bucket, G.
    dtype: parameter dtype; compute_dtype: the matmuls'.
    param_bytes: the params as stored on the mesh (placed at load by the rules).
    working_param_bytes: a second, gathered copy the decode holds on top (shard_map
      replicates params over the data axes; spmd with FSDP gathers one layer at a time,
      counted under activations), 0 when the stored copy is used as it is.
    cache_bytes: the K/V caches of the decoder's state; state_bytes: the rest of its state.
    activation_bytes: the estimated transient peak of the widest forward (`activations`
      holds each term); forward_tokens / forward_keys: its T and S.
    total_bytes: their sum. budget_bytes: the device memory (None: unknown).
    refusal: the one-line reason and fix when the plan does not fit, else None.
  """
  model: str
  method: str
  mesh: dict
  devices: int
  data_parallel: str
  batch: int
  padded_batch: int
  rows_per_device: int
  prompt_len: int
  padded_prompt_len: int
  gen_length: int
  dtype: str
  compute_dtype: str
  param_bytes: int
  working_param_bytes: int
  cache_bytes: int
  state_bytes: int
  activation_bytes: int
  activations: dict
  forward_tokens: int
  forward_keys: int
  total_bytes: int
  budget_bytes: int | None
  refusal: str | None = None

  @property
  def fits(self) -> bool | None:
    return None if self.budget_bytes is None else self.total_bytes <= self.budget_bytes

  def to_dict(self) -> dict:
    return dict(dataclasses.asdict(self), fits=self.fits)

  def table(self) -> str:
    """The report as a small text table (GiB per device)."""
    mesh = json.dumps(self.mesh)
    rows = [("parameters (stored)", self.param_bytes),
            ("parameters (gathered copy)", self.working_param_bytes),
            ("K/V cache", self.cache_bytes), ("decode state", self.state_bytes),
            (f"activations (T={self.forward_tokens}, S={self.forward_keys})",
             self.activation_bytes), ("total", self.total_bytes)]
    devices = f"{self.devices} device{'s' if self.devices > 1 else ''}"
    lines = [f"dry run: {self.model}, method {self.method}, mesh {mesh} ({devices}, "
             f"{self.data_parallel}), batch {self.batch} -> {self.padded_batch} "
             f"({self.rows_per_device} per device), prompt {self.prompt_len} -> "
             f"{self.padded_prompt_len}, gen_length {self.gen_length}, {self.dtype}",
             f"{'per device':<40} {'bytes':>15} {'GiB':>9}"]
    lines += [f"{name:<40} {n:>15,} {n / GiB:>9.2f}" for name, n in rows]
    if self.budget_bytes is not None:
      verdict = "fits" if self.fits else "DOES NOT FIT"
      lines.append(f"{'budget':<40} {self.budget_bytes:>15,} {self.budget_bytes / GiB:>9.2f}"
                   f"  {verdict}")
    return "\n".join(lines)

  def check(self) -> "DryRun":
    """Self when it fits (or the budget is unknown); else raises DoesNotFit."""
    if self.refusal is not None:
      raise DoesNotFit(self.refusal)
    return self


# ----------------------------------------------------------------------------- accounting

def abstract_mesh(shape: dict[str, int] | None) -> AbstractMesh:
  """A device-free (data, fsdp, tensor) mesh of the given axis sizes (missing axes are 1)."""
  shape = dict(shape or {})
  unknown = sorted(set(shape) - set(mesh_lib.MESH_AXES))
  if unknown:
    raise ValueError(f"mesh names unknown axes {unknown}; the axes are "
                     f"{list(mesh_lib.MESH_AXES)}.")
  sizes = tuple(int(shape.get(a, 1)) for a in mesh_lib.MESH_AXES)
  if any(n < 1 for n in sizes):
    raise ValueError(f"mesh {shape} has an axis below 1; a dry run needs every size given.")
  return AbstractMesh(sizes, mesh_lib.MESH_AXES, axis_types=(AxisType.Auto,) * len(sizes))


def _itemsize(leaf) -> int:
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # a threefry key: 2 x uint32
    return 8
  return np.dtype(leaf.dtype).itemsize


def shard_bytes(leaf, sharding: NamedSharding) -> int:
  """Bytes of one device's shard of `leaf` (a ShapeDtypeStruct) under `sharding`."""
  return math.prod(sharding.shard_shape(tuple(leaf.shape))) * _itemsize(leaf)


def param_bytes(boxed, mesh: AbstractMesh, rules) -> int:
  """Per-device bytes of a boxed abstract params tree placed by `param_shardings`."""
  shardings = mesh_lib.param_shardings(boxed, mesh, rules)
  leaves = jax.tree_util.tree_leaves(nn.unbox(boxed))
  return sum(shard_bytes(x, s) for x, s in zip(leaves, jax.tree_util.tree_leaves(shardings)))


def _axes_size(mesh, axes) -> int:
  names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
  return math.prod(mesh.shape[a] for a in names)


def state_bytes(state, batch: int, mesh: AbstractMesh, rules) -> tuple[int, int]:
  """(K/V cache bytes, other state bytes) per device: leaves with a leading batch axis are
  split over the batch rule's axes, cache k / v [L, B, S, K, Dh] also over the kv-heads rule
  when it divides K (as `d2f._constrain` pins them); the rest is replicated."""
  batch_axes = nn.logical_to_mesh_axes(("batch",), rules)[0]
  heads = nn.logical_to_mesh_axes(("kv_heads",), rules)[0]
  rows = batch_axes if batch % _axes_size(mesh, batch_axes) == 0 else None

  def by_rows(x):
    spec = PartitionSpec(rows, *([None] * (x.ndim - 1))) if x.ndim and x.shape[0] == batch \
        else PartitionSpec()
    return shard_bytes(x, NamedSharding(mesh, spec))

  caches = [c for c in jax.tree_util.tree_leaves(
      state, is_leaf=lambda x: isinstance(x, kv_cache.KVCache)) if isinstance(c, kv_cache.KVCache)]
  cache_total = 0
  for c in caches:
    kv_heads = heads if c.k.shape[3] % _axes_size(mesh, heads) == 0 else None
    spec = NamedSharding(mesh, PartitionSpec(None, rows, None, kv_heads, None))
    cache_total += 2 * shard_bytes(c.k, spec) + by_rows(c.block_ids) + by_rows(c.length)
  others = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      lambda x: None if isinstance(x, kv_cache.KVCache) else x, state,
      is_leaf=lambda x: isinstance(x, kv_cache.KVCache)))
  return cache_total, sum(by_rows(x) for x in others)


def activation_terms(cfg: ModelConfig, rows: int, t: int, s: int, cached: bool,
                     mesh: AbstractMesh, rules) -> dict[str, int]:
  """Estimated per-device bytes of the transient tensors of one forward of T = `t` tokens
  attending S = `s` keys, `rows` rows per device (see docs/design.md)."""
  def split(n, logical):
    size = _axes_size(mesh, nn.logical_to_mesh_axes((logical,), rules)[0])
    return n // size if n % size == 0 else n

  c = np.dtype(resolve_dtype(cfg.dtype)).itemsize
  dh, d = cfg.resolved_head_dim, cfg.d_model
  h, k = split(cfg.n_heads, "heads"), split(cfg.n_kv_heads, "kv_heads")
  f, v = split(cfg.mlp_dim, "mlp"), split(cfg.vocab_size, "vocab")
  attention = rows * c * (2 * t * h * dh + 2 * s * k * dh) + rows * h * t * s * (4 + c)
  terms = {
      "residual [b,T,D] x2": 2 * rows * t * d * c,
      "attention q,out [b,T,H,Dh]; k,v [b,S,K,Dh]; scores f32 + probs [b,H,T,S]": attention,
      "mlp gate,up,hidden [b,T,F]": 3 * rows * t * f * c,
      "logits f32 + probabilities f32 [b,T,V]": 2 * rows * t * v * 4,
  }
  if cached:
    terms["new k,v of the chunk [L,b,T,K,Dh] x2"] = 2 * cfg.n_layers * rows * t * k * dh * c
  return terms


def _peak(terms: dict[str, int]) -> int:
  """Residual + the larger of the attention and MLP blocks (they run one after the other)
  + everything else (logits, chunk K/V, a gathered layer)."""
  parts = dict(terms)
  block = max(parts.pop(n) for n in list(parts) if n.startswith(("attention", "mlp")))
  return block + sum(parts.values())


# ----------------------------------------------------------------------------- planning

def default_mode(mesh: AbstractMesh, rules) -> str:
  """`generate`'s data-parallel mode (`parallel.mesh.default_data_parallel`)."""
  return mesh_lib.default_data_parallel(mesh, rules)


def plan(cfg: ModelConfig, *, method: str = registry.DEFAULT_METHOD, mesh=None,
         batch: int = 1, prompt_len: int, gen_length: int | None = None,
         data_parallel: str | None = None, rules=None, device_memory=None,
         drafter_cfg: ModelConfig | None = None, suggest: bool = True, **options) -> DryRun:
  """The per-device bytes of decoding `batch` prompts of `prompt_len` tokens with `method`.

  Args:
    cfg: the model config (its param_dtype / dtype are the dtypes counted).
    method, **options: the decoding method and its options (checked as `generate` does);
      `gen_length` is G.
    mesh: {axis: size} over (data, fsdp, tensor), or None for one device.
    batch, prompt_len: prompts and their longest length; padded as `generate` pads them.
    data_parallel: "shard_map" (params replicated over the data axes) or "spmd" (params
      stay sharded; FSDP gathers a layer at a time); None: `generate`'s default.
    rules: logical-axis rules (default DEFAULT_RULES).
    device_memory: the per-device budget (bytes or '16GiB'); None: no verdict.
    drafter_cfg: the drafter of a hybrid method (speculative, adaptive).
    suggest: when it does not fit, re-plan with a larger mesh axis, a smaller batch and a
      smaller G to name the changes that fit (False: only say by how much).
  Returns:
    a DryRun; `.check()` raises DoesNotFit with its one-line refusal.
  """
  rules = mesh_lib.rules_from_config(rules)
  amesh = abstract_mesh(mesh)
  mode = default_mode(amesh, rules) if data_parallel is None else data_parallel
  if mode not in MODES:
    raise ValueError(f"data_parallel={data_parallel!r}: use one of {MODES} or None.")
  budget = None if device_memory is None else parse_bytes(device_memory)
  if gen_length is not None:
    options["gen_length"] = int(gen_length)
  if registry.get(method).uses_drafter:
    if drafter_cfg is None:
      raise ValueError(f"method {method!r} drafts with a second model: pass its config "
                       "(drafter_cfg=, or the drafter checkpoint directory) to the dry run.")
    options.update(drafter_cfg=drafter_cfg,
                   drafter_params=nn.unbox(abstract_params(drafter_cfg)))
  dp = mesh_lib.data_parallel_size(amesh, rules)
  rows = buckets.batch_size(int(batch), buckets.BATCH_BUCKETS, dp)
  the_plan = protocol.plan(method, cfg, options)
  decoder = the_plan.decoder
  g = decoder.gen_length
  p = buckets.prompt_length(int(prompt_len), g, cfg.max_seq_len)
  tokens, valid = np.zeros((rows, p), np.int32), np.ones((rows, p), bool)
  decoder.check(tokens, valid)

  boxed = decoder.abstract_params()
  stored = param_bytes(boxed, amesh, rules)
  working = 0
  if mode == "shard_map":
    replicated = mesh_lib.without_axes(rules, mesh_lib.data_axes(amesh, rules))
    gathered = param_bytes(boxed, amesh, replicated)
    working = gathered if gathered != stored else 0

  state = _abstract_state(the_plan, rows, p)
  cache, other = state_bytes(state, rows, amesh, rules)
  caches = [c for c in jax.tree_util.tree_leaves(
      state, is_leaf=lambda x: isinstance(x, kv_cache.KVCache)) if isinstance(c, kv_cache.KVCache)]
  t = p if decoder.attention in _PREFILL_ATTENTION else p + g
  s = t + max((c.capacity for c in caches), default=0)
  per_device = rows // dp if rows % dp == 0 else rows
  terms = activation_terms(cfg, per_device, t, s, bool(caches), amesh, rules)
  if mode == "spmd":
    layer = _gathered_layer_bytes(boxed, amesh, rules, cfg.n_layers)
    if layer:
      terms["one layer's weights gathered (FSDP)"] = layer
  activations = _peak(terms)
  total = stored + working + cache + other + activations
  report = DryRun(
      model=cfg.name, method=method, mesh={a: amesh.shape[a] for a in mesh_lib.MESH_AXES
                                           if amesh.shape[a] > 1},
      devices=math.prod(amesh.axis_sizes), data_parallel=mode, batch=int(batch),
      padded_batch=rows, rows_per_device=per_device, prompt_len=int(prompt_len),
      padded_prompt_len=p, gen_length=g, dtype=cfg.param_dtype, compute_dtype=cfg.dtype,
      param_bytes=stored, working_param_bytes=working, cache_bytes=cache, state_bytes=other,
      activation_bytes=activations, activations=terms, forward_tokens=t, forward_keys=s,
      total_bytes=total, budget_bytes=budget)
  if budget is not None and total > budget:
    fixes = _fixes(cfg, method, dict(mesh or {}), int(batch), int(prompt_len), options, mode,
                   data_parallel, rules, budget, drafter_cfg) if suggest else []
    report = dataclasses.replace(report, refusal=_refusal(report, fixes))
  return report


def _abstract_state(the_plan: protocol.Plan, rows: int, p: int):
  """The decoder's state after `init`, as ShapeDtypeStructs (nothing allocated)."""
  decoder = the_plan.decoder
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        nn.unbox(decoder.abstract_params()))
  tokens = jax.ShapeDtypeStruct((rows, p), jnp.int32)
  valid = jax.ShapeDtypeStruct((rows, p), jnp.bool_)
  row_inputs = the_plan.row_inputs
  return jax.eval_shape(
      lambda prm, tok, val: decoder.init(prm, tok, val, jax.random.key(0), the_plan.traced,
                                         row_inputs), params, tokens, valid)


def _gathered_layer_bytes(boxed, mesh, rules, n_layers: int) -> int:
  """Bytes of one layer's weights as the scan gathers them (data axes removed from the
  rules) on top of their stored shard; 0 when no data axis shards them."""
  axes = mesh_lib.data_axes(mesh, rules)
  if not axes:
    return 0
  layers = {"layers": boxed["layers"]} if isinstance(boxed, dict) else \
      {"layers": boxed[0]["layers"]}
  full = param_bytes(layers, mesh, mesh_lib.without_axes(rules, axes))
  return full // n_layers


def _fixes(cfg, method, mesh, batch, prompt_len, options, mode, data_parallel, rules, budget,
           drafter_cfg) -> list[str]:
  """Single changes that make the plan fit, in the order a user would try them."""
  found = []

  def fits(**change) -> bool:
    kwargs = dict(method=method, mesh=mesh, batch=batch, prompt_len=prompt_len,
                  data_parallel=data_parallel, rules=rules, device_memory=budget,
                  drafter_cfg=drafter_cfg, suggest=False,
                  **{k: v for k, v in options.items()
                     if k not in ("drafter_cfg", "drafter_params")})
    kwargs.update(change)
    try:
      return plan(cfg, **kwargs).refusal is None
    except ValueError:
      return False

  def grown(axis):
    for factor in (2, 4, 8, 16, 32):
      bigger = dict(mesh, **{axis: mesh.get(axis, 1) * factor})
      if fits(mesh=bigger, data_parallel="spmd" if axis == "fsdp" else data_parallel):
        return bigger
    return None

  # shard_map (asked for explicitly on an fsdp mesh) replicates the params over the data
  # axes, spmd keeps them sharded over fsdp; tensor parallelism shards them in either mode
  spmd = mode == "shard_map" and mesh.get("fsdp", 1) > 1 and fits(data_parallel="spmd")
  if spmd:
    found.append("data_parallel=spmd (params stay sharded over fsdp; shard_map replicates "
                 "them over the data axes)")
  bigger = grown("tensor")
  if bigger:
    found.append(f"mesh {_mesh_json(bigger)}")
  bigger = None if spmd or data_parallel == "shard_map" else grown("fsdp")
  if bigger:
    found.append(f"mesh {_mesh_json(bigger)}" +
                 ("" if data_parallel == "spmd" else " with data_parallel=spmd"))
  smaller = batch // 2
  while smaller >= 1:
    if fits(batch=smaller):
      found.append(f"batch={smaller}")
      break
    smaller //= 2
  g = options.get("gen_length")
  if g:
    smaller = g // 2
    while smaller >= 16:
      if fits(gen_length=smaller):
        found.append(f"gen_length={smaller}")
        break
      smaller //= 2
  return found


def _mesh_json(shape: dict) -> str:
  return json.dumps({a: n for a, n in shape.items() if n > 1})


def _refusal(report: DryRun, fixes: list[str]) -> str:
  parts = (f"params {_gib(report.param_bytes + report.working_param_bytes)}, K/V cache "
           f"{_gib(report.cache_bytes)}, activations {_gib(report.activation_bytes)}")
  head = (f"does not fit: {_gib(report.total_bytes)} per device > {_gib(report.budget_bytes)} "
          f"on mesh {_mesh_json(report.mesh)} ({parts})")
  if fixes:
    return f"{head}; it fits with {' or '.join(fixes)}."
  return (f"{head}; no single change of the mesh (up to 32x), batch or G makes it fit: "
          "use more devices per model (a larger fsdp or tensor axis) and a smaller batch.")


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_config(path, *, dtype: str | None = None, adapter=None,
                      merge_lora: bool = False) -> ModelConfig:
  """The ModelConfig of a checkpoint directory, from its config files only (no weights).

  HF directories (config.json) read as `checkpoints.hf.config_without_weights`; an adapter
  adds its LoRA rank (from adapter_config.json) unless merged. Converted directories read
  model_config.json.
  """
  path = Path(path)
  if (path / "model_config.json").is_file():
    from dllm_jax.checkpoints import convert  # pylint: disable=import-outside-toplevel
    cfg = convert.config_from_json((path / convert.CONFIG_FILE).read_text(),
                                   str(path / convert.CONFIG_FILE))
    return cfg if dtype is None else cfg.replace(param_dtype=dtype, dtype=dtype)
  cfg, _ = hf.config_without_weights(path, dtype)
  if adapter is not None and not merge_lora:
    config = hf.read_json(Path(adapter) / "adapter_config.json")
    if not config:
      raise FileNotFoundError(f"{adapter} has no adapter_config.json; pass a PEFT LoRA "
                              "adapter directory.")
    rank = int(config.get("r", 8))
    cfg = cfg.replace(lora_rank=rank, lora_alpha=float(config.get("lora_alpha", rank)))
  return cfg


def plan_checkpoint(path, *, dtype: str | None = None, adapter=None, merge_lora: bool = False,
                    drafter=None, **kwargs) -> DryRun:
  """`plan` for a checkpoint directory (HF or converted) read without its weights;
  `drafter` is a hybrid's drafter directory. Other arguments as `plan`."""
  cfg = checkpoint_config(path, dtype=dtype, adapter=adapter, merge_lora=merge_lora)
  if drafter is not None:
    kwargs["drafter_cfg"] = checkpoint_config(drafter, dtype=dtype)
  return plan(cfg, **kwargs)
