"""Model family: config, attention patterns, K/V cache and the transformer."""

from dllm_jax.models.config import PRESETS, ModelConfig, get_preset
from dllm_jax.models.kv_cache import KVCache, init_cache
from dllm_jax.models.masks import ATTENTION_KINDS, NO_KEY
from dllm_jax.models.transformer import Transformer, abstract_params, forward, init_params
