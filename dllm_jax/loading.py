"""Any checkpoint directory -> (params, cfg, tokenizer, prompt layout, decoder defaults).

`Sampler.load` calls `load_model`; this module knows the directory kinds and nothing about
sampling:

  hf         config.json + *.safetensors (or an index + shards) + tokenizer.json
  converted  model_config.json + params/ (checkpoints.save_converted) + tokenizer.json
  workdir    a training run: config.json (the run's config) + checkpoints/<step>/; also its
             checkpoints/ dir or one step dir. Tokenizer, fixed prompt region and decode
             settings come from the run's `data` / `decode` config.
  demo       the built-in demo (dllm_jax.demo): a workdir per attention pattern, trained on
             first use. A method that drafts with a second model (speculative, adaptive) gets
             the demo's drafter with it, as the decoder options drafter_params / drafter_cfg.

Every path checks the weights are finite (NonFiniteParamsError names the tensor) and reads
only: a failed load never writes to the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from dllm_jax.decoding import api as decode_api
from dllm_jax.decoding import registry

KINDS = ("hf", "converted", "workdir")
_DESCRIPTIONS = {
    "hf": "a HF checkpoint directory (config.json + safetensors)",
    "converted": "a converted checkpoint (model_config.json + params/, from save_converted)",
    "workdir": "a training workdir (config.json + checkpoints/)",
}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A loaded model with what decoding text with it needs.

  Attributes:
    params, cfg: the model.
    tokenizer: a checkpoints.Tokenizer (hf, converted) or a data.tokenizers one (workdir).
    kind: one of KINDS.
    prompt_len: the fixed prompt region prompts are left padded to (a run's), or None.
    defaults: {method: decoder options} the run implies (gen_length = its answer canvas,
      block sizes = its data.block_size, its own decode.options for its decode.method).
  """
  params: Any
  cfg: Any
  tokenizer: Any
  kind: str
  prompt_len: int | None = None
  defaults: dict = dataclasses.field(default_factory=dict)

  def options(self, method: str) -> dict:
    return dict(self.defaults.get(method, {}))


def _is_run_config(path: Path) -> bool:
  try:
    config = json.loads(path.read_text())
  except (OSError, ValueError):
    return False
  return isinstance(config, dict) and {"model", "data", "objective"} <= set(config)


def detect_kind(path: Path) -> str:
  """The kind of checkpoint directory `path` is; FileNotFoundError / ValueError if none."""
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist; pass a local checkpoint directory, a "
                            "training workdir or 'demo' (nothing is downloaded).")
  if not path.is_dir():
    raise ValueError(f"{path} is a file; pass the directory that holds the checkpoint.")
  if (path / "model_config.json").is_file() and (path / "params").is_dir():
    return "converted"
  if ((path / "checkpoints").is_dir() or path.name == "checkpoints"
      or (path.name.isdigit() and path.parent.name == "checkpoints")):
    return "workdir"
  config = path / "config.json"
  weights = any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json"))
  if config.is_file() and weights:
    return "hf"
  if config.is_file() and _is_run_config(config):
    raise ValueError(f"{path} holds a training run's config.json but no checkpoints/; the run "
                     "has not saved a checkpoint yet (or pass the workdir it saved to).")
  if config.is_file():
    raise ValueError(f"{path} holds config.json but no *.safetensors weights; download the "
                     "weights too, or pass the directory that holds them.")
  raise ValueError(f"{path} is not a checkpoint directory: expected config.json + *.safetensors "
                   "(HF), model_config.json + params/ (save_converted) or config.json + "
                   "checkpoints/ (a training workdir).")


def load_model(path, method: str, *, kind: str = "auto", dtype: str | None = None,
               adapter=None, merge_lora: bool = False, step: int | None = None,
               mesh=None, strict: bool = True) -> LoadedModel:
  """Loads `path` ("demo" or a directory) for decoding with `method` (see the module doc).

  `strict=False` lets a HF checkpoint hold tensors the model does not use (ignored with a
  warning naming them; see `checkpoints.hf.check_tensors`); by default that is an error.
  """
  registry.check(method)  # an unknown method fails before any loading
  if kind not in ("auto", "demo", *KINDS):
    raise ValueError(f"kind={kind!r} is unknown; use 'auto', 'demo' or one of {KINDS}.")
  demo_root = None
  if is_demo(path, kind):
    from dllm_jax import demo
    demo_root = demo.ensure()
    path, kind = demo.model_dir(method, demo_root), "workdir"
  path = Path(path)
  found = detect_kind(path)
  if kind != "auto" and found != kind:
    raise ValueError(f"{path} is {_DESCRIPTIONS[found]}, not {_DESCRIPTIONS[kind]}; pass it as "
                     "`--model` (the kind is detected) or point at the right directory.")
  if adapter is not None and found != "hf":
    raise ValueError(f"an adapter applies to HF checkpoints, but {path} is "
                     f"{_DESCRIPTIONS[found]}; merge adapters before converting.")
  if step is not None and found != "workdir":
    raise ValueError(f"step={step} selects a checkpoint of a training workdir, but {path} is "
                     f"{_DESCRIPTIONS[found]}.")
  if dtype is not None and found != "hf":
    raise ValueError(f"dtype={dtype!r} applies when converting HF weights, but {path} is "
                     f"{_DESCRIPTIONS[found]}, which loads in the dtype it was saved with.")
  if found == "workdir":
    model = _load_workdir(path, step, mesh)
    return model if demo_root is None else _with_demo_drafter(model, method, demo_root, mesh)
  from dllm_jax import checkpoints
  if found == "hf":
    dtype = platform_dtype(path) if dtype is None else dtype
    cfg, params = checkpoints.load_pretrained(path, dtype=dtype, mesh=mesh, adapter_dir=adapter,
                                              merge_lora=merge_lora, strict=strict)
  else:
    cfg, params = checkpoints.load_converted(path, mesh=mesh)
  if not (path / "tokenizer.json").is_file():
    hint = (" Write it with save_converted(..., tokenizer_dir=<the HF model dir>) or copy the "
            "tokenizer files there." if found == "converted" else "")
    raise FileNotFoundError(f"{path} has no tokenizer.json, so text cannot be encoded.{hint}")
  return LoadedModel(params, cfg, checkpoints.load_tokenizer(path), found)


def _host_memory() -> int | None:
  try:
    import os  # pylint: disable=import-outside-toplevel
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def platform_dtype(path) -> str | None:
  """The load dtype when the caller names none: the checkpoint's own (None), except a
  bfloat16 HF checkpoint on CPU, which computes in float32 when its float32 weights take at
  most half the host's memory. XLA:CPU converts bfloat16 matmul operands to float32 and
  back, so there a bfloat16 forward is slower than a float32 one (experiments/bench_step.py,
  its dtype table); on GPUs and TPUs bfloat16 is the fast path and is kept. The choice is
  logged; pass dtype="bfloat16" to keep the checkpoint's."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.default_backend() != "cpu":
    return None
  from dllm_jax.checkpoints import hf  # pylint: disable=import-outside-toplevel
  from dllm_jax.models.transformer import abstract_params  # pylint: disable=import-outside-toplevel
  cfg, _ = hf.config_from_hf(path)
  if cfg.param_dtype != "bfloat16":
    return None
  size = sum(leaf.size for leaf in jax.tree.leaves(abstract_params(cfg)))
  memory = _host_memory()
  if memory is not None and 4 * size > memory // 2:
    logging.getLogger(__name__).warning(
        "%s: kept in bfloat16 on CPU (float32 would take %.1f GiB, over half this host's "
        "%.1f GiB); float32 computes faster on CPU where it fits.", path, 4 * size / 2**30,
        memory / 2**30)
    return None
  logging.getLogger(__name__).warning(
      "%s: a bfloat16 checkpoint computed in float32 on CPU, where it runs faster (XLA:CPU "
      "converts bfloat16 per matmul); pass dtype='bfloat16' (--dtype bfloat16) to keep it.",
      path)
  return "float32"


def is_demo(path, kind: str = "auto") -> bool:
  """Whether `path` / `kind` name the built-in demo."""
  return str(path) == "demo" or kind == "demo"


def _with_demo_drafter(model: LoadedModel, method: str, root: Path, mesh) -> LoadedModel:
  """`model` with the demo's drafter for `method` (the demo model trained with the decoder's
  `drafter_attention`) among its defaults as drafter_params / drafter_cfg; unchanged for a
  method without a drafter."""
  from dllm_jax import demo
  path = demo.drafter_dir(method, root)
  if path is None:
    return model
  drafter = _load_workdir(path, None, mesh)
  defaults = dict(model.defaults)
  defaults[method] = dict(defaults.get(method, {}), drafter_params=drafter.params,
                          drafter_cfg=drafter.cfg)
  return dataclasses.replace(model, defaults=defaults)


def run_defaults(config, gen_length: int | None) -> dict:
  """{method: options} for a run: its canvas, its block size and its own decode options."""
  block = config.data.block_size or gen_length
  base = {} if gen_length is None else {"gen_length": int(gen_length)}
  defaults = {m: dict(base, **(registry.get(m).run_defaults(int(block)) if block else {}))
              for m in registry.names()}
  own = config.decode.method
  if own in defaults:
    names = decode_api.option_names(own)
    for key, value in dict(config.decode.options).items():
      if key == "block_size" and key not in names and "block_length" in names:
        key = "block_length"  # a run saved before d2f's option was renamed
      defaults[own][key] = value
  return defaults


def _load_workdir(path: Path, step: int | None, mesh) -> LoadedModel:
  from dllm_jax.models import finite, lora
  from dllm_jax.training import checkpoint, data as data_lib
  with _quiet("absl"):  # orbax warns that a read-only manager will not save: we know
    model = checkpoint.load_params(path, step, mesh=mesh)
  finite.check_finite(model.params, str(path))
  params, cfg, config = model.params, model.model_cfg, model.config
  if cfg.lora_rank:  # a D2F student: fold the adapters in (same logits, plain network)
    cfg, params = lora.merge_lora(params, cfg)
  tokenizer = data_lib.make_tokenizer(config.data)
  layout = data_lib.make_layout(config.data, tokenizer)
  if tokenizer.vocab_size < cfg.vocab_size:  # never propose an id the tokenizer lacks
    cfg = cfg.replace(active_vocab_size=int(tokenizer.vocab_size))
  gen_length = None if layout.prompt_len is None else layout.seq_len - layout.prompt_len
  return LoadedModel(params, cfg, tokenizer, "workdir", prompt_len=layout.prompt_len,
                     defaults=run_defaults(config, gen_length))


@contextlib.contextmanager
def _quiet(name: str):
  """Hides a library logger's warnings (errors still show) for the duration of the block."""
  logger = logging.getLogger(name)
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)
