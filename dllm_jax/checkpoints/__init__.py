"""Real checkpoints: HF safetensors in and out, PEFT LoRA, tokenizers, orbax conversions.

    cfg, params = load_pretrained(model_dir, mesh=mesh)   # the checkpoint's dtype, or dtype=
    tok = load_tokenizer(model_dir)
    save_converted("/ckpt/llada", cfg, params, tokenizer_dir=model_dir)
    cfg, params = load_converted("/ckpt/llada", mesh=mesh)
    export_safetensors(params, cfg, "/out/llada-hf", family="llada")

Families: llama, qwen2 (AR), llada, dream (masked diffusion). Every loader rejects NaN / inf
weights naming the tensor (models.finite.NonFiniteParamsError) and never writes to its input.

Modules: families.py (config keys and tensor names per family), safetensors_io.py (headers,
one-tensor reads, streamed writes), placement.py (sharded, memory-frugal placement), hf.py
(load_pretrained), lora.py (PEFT adapters), tokenizer.py (tokenizers, special ids, chat
templates), convert.py (orbax + safetensors export), atomic.py (all-or-nothing directories),
testing.py (tiny published-layout checkpoints and a float64 NumPy reference forward).
"""

from dllm_jax.checkpoints.convert import export_safetensors, load_converted, save_converted
from dllm_jax.checkpoints.families import FAMILIES, detect_family, get_family
from dllm_jax.checkpoints.hf import config_from_hf, load_pretrained
from dllm_jax.checkpoints.lora import export_lora_adapter
from dllm_jax.checkpoints.tokenizer import Tokenizer, load_tokenizer, special_token_ids


__all__ = [
    "FAMILIES", "Tokenizer", "config_from_hf", "detect_family", "export_lora_adapter",
    "export_safetensors", "get_family", "load_converted", "load_pretrained", "load_tokenizer",
    "save_converted", "special_token_ids",
]
