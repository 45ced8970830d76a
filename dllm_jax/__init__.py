"""dllm_jax: diffusion and autoregressive LMs in JAX."""
