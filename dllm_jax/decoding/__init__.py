"""Decoders for autoregressive and masked-diffusion LMs behind one `generate` entry point.

  generate(params, cfg, prompts, method="ar" | "llada" | "dream" | "fast_dllm" | "d2f" |
           "block_diffusion", rng=None, mesh=None, **options) -> DecodeOutput
"""

from dllm_jax.decoding.api import METHODS, generate
from dllm_jax.decoding.ar import AROptions, ar_generate
from dllm_jax.decoding.base import DecodeOutput, pad_prompts
from dllm_jax.decoding.d2f import block_diffusion_generate, d2f_generate
from dllm_jax.decoding.fast_dllm import FastDLLMOptions, fast_dllm_generate
from dllm_jax.decoding.llada import LLaDAOptions, dream_generate, llada_generate
from dllm_jax.decoding.streaming import StreamEvent, stream
