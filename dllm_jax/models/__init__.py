"""Model family: config, attention patterns, K/V cache and the transformer.

The config (`ModelConfig`, `get_preset`, `PRESETS`) imports no JAX, so a config file loads
without it; the JAX-side names load on first use (PEP 562).
"""

from __future__ import annotations

from dllm_jax import _lazy
from dllm_jax.models.config import PRESETS, ModelConfig, get_preset

_LAZY = {"KVCache": "kv_cache", "init_cache": "kv_cache", "ATTENTION_KINDS": "masks",
         "NO_KEY": "masks", "Transformer": "transformer", "abstract_params": "transformer",
         "forward": "transformer", "init_params": "transformer"}

__all__ = ["PRESETS", "ModelConfig", "get_preset", *_LAZY]

__getattr__, __dir__ = _lazy.attach(__name__, _LAZY)
