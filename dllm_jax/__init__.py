"""dllm_jax: diffusion and autoregressive LMs in JAX.

The subpackages load on first use (PEP 562), so `import dllm_jax` stays cheap:

  dllm_jax.models       config, transformer, K/V cache      dllm_jax.parallel   meshes, sharding
  dllm_jax.diffusion    schedules, corruption, losses       dllm_jax.data       tasks, tokenizers
  dllm_jax.decoding     AR, LLaDA, Fast-dLLM, D2F decoders  dllm_jax.training   trainer, checkpoints
  dllm_jax.checkpoints  HF / converted checkpoints

The speed/quality study is not part of the library: its modules live beside its scripts, in
experiments/studylib.
"""

from __future__ import annotations

import importlib
from importlib import metadata

SUBPACKAGES = ("checkpoints", "data", "decoding", "diffusion", "models", "parallel", "training")

try:
  __version__ = metadata.version("dllm_jax")
except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH, not installed
  __version__ = "0.1.0"

__all__ = ["__version__", *SUBPACKAGES]


# Written out here rather than with `_lazy.attach`: `import dllm_jax` loads no submodule at all.
def __getattr__(name: str):
  if name in SUBPACKAGES:
    module = importlib.import_module(f"{__name__}.{name}")
    globals()[name] = module
    return module
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(SUBPACKAGES))
