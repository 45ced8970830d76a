"""Decoders for autoregressive and masked-diffusion LMs behind one `generate` entry point.

  generate(params, cfg, prompts, method=<a registry name; default "d2f">, rng=None,
           mesh=None, **options) -> DecodeOutput
  stream(params, cfg, prompts, method=..., rng=None, **options) -> Iterator[StreamEvent]

Every option, its default, whether it is traced (a sweep never recompiles) and what it
means: docs/decoding_options.md (`api.option_names(method)` lists a method's).
"""

from __future__ import annotations

from dllm_jax import _lazy

# The package loads its modules on first use (PEP 562): `adaptive_rule`, which a config file
# reads, and `registry`, which the command line reads, import no JAX. Every module is also
# an attribute (`decoding.api`, `decoding.sampling`).
_EXPORTS = {
    "generate": "api", "option_names": "api",
    "Decoder": "protocol", "Plan": "protocol",
    "DEFAULT_METHOD": "registry", "register": "registry",
    "AROptions": "ar", "ar_generate": "ar",
    "DecodeOutput": "base", "NonFiniteLogitsError": "base", "pad_prompts": "base",
    "block_diffusion_generate": "d2f", "d2f_generate": "d2f",
    "FastDLLMOptions": "fast_dllm", "fast_dllm_generate": "fast_dllm",
    "LLaDAOptions": "llada", "dream_generate": "llada", "llada_generate": "llada",
    "StreamEvent": "streaming", "stream": "streaming",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy.attach(__name__, _EXPORTS, submodules=True)
