"""A tiny LLaDA-8B-Instruct stand-in and D2F adapter, in the published on-disk layouts.

`write_llada_instruct(model_dir)` writes what `huggingface-cli download
GSAI-ML/LLaDA-8B-Instruct` leaves on disk, at toy size: `config.json` with LLaDA's keys,
`model.safetensors` under LLaDA's tensor names, a BPE `tokenizer.json` with the special
tokens, and a `tokenizer_config.json` with a LLaMA-3-style chat template.
`write_d2f_adapter(adapter_dir)` writes a PEFT LoRA adapter on q/k/v/attn_out as
`SJTU-Deng-Lab/D2F_LLaDA_Instruct_8B_Lora` is published. The notebook and README tests run
the real-weights commands and cells against these (no download, a few seconds on a CPU).

Sizes: 8 heads (so `--mesh '{"tensor": 8}'` shards them on 8 fake devices), d_model 64,
2 layers, an embedding padded to a multiple of 16 rows past the tokenizer's ids (like
LLaDA's 126464 rows).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tokenizers
from pydoc_data import topics
from tokenizers import decoders, models, pre_tokenizers, trainers

from dllm_jax.checkpoints import testing as ckt

SPECIALS = ["<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|startoftext|>"]
CHAT_TEMPLATE = ("{{ '<|startoftext|>' }}{% for m in messages %}<|start_header_id|>"
                 "{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                 "\n\n{% endif %}")
HEADS, D_MODEL, LAYERS, MLP = 8, 64, 2, 128
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "attn_out")


def train_bpe(specials) -> tokenizers.Tokenizer:
  """A byte-level BPE tokenizer (300 ids, `specials` first) trained on Python's help topics:
  deterministic, offline, seconds."""
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.train_from_iterator(
      list(topics.topics.values())[:20],
      trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return backend


def write_llada_instruct(model_dir, *, seed: int = 0) -> Path:
  """Writes the tiny LLaDA-Instruct checkpoint (weights, config, tokenizer) into model_dir."""
  model_dir = Path(model_dir)
  model_dir.mkdir(parents=True, exist_ok=True)
  backend = train_bpe(SPECIALS)
  backend.save(str(model_dir / "tokenizer.json"))
  (model_dir / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
      "mask_token": "<|mdm_mask|>", "chat_template": CHAT_TEMPLATE}))
  rows = -(-backend.get_vocab_size() // 16) * 16
  w = ckt.random_weights(vocab=rows, d=D_MODEL, layers=LAYERS, heads=HEADS, kv_heads=HEADS,
                         mlp=MLP, seed=seed)
  ckt.write_tensors(model_dir, ckt.llada_tensors(w), ckt.llada_config(
      w, heads=HEADS, kv_heads=HEADS, mask_token_id=backend.token_to_id("<|mdm_mask|>"),
      eos_token_id=backend.token_to_id("<|endoftext|>"), max_sequence_length=4096))
  return model_dir


def write_llama_instruct(model_dir, *, layers: int = 2, seed: int = 3) -> Path:
  """A tiny LLaMA-layout AR checkpoint (Meta-Llama-3-8B-Instruct's stand-in) with the tiny
  LLaDA's tokenizer, so the D2F model can draft for it (the hybrids need one tokenizer)."""
  model_dir = Path(model_dir)
  backend = train_bpe(SPECIALS)
  model_dir.mkdir(parents=True, exist_ok=True)
  backend.save(str(model_dir / "tokenizer.json"))
  (model_dir / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>"}))
  rows = -(-backend.get_vocab_size() // 16) * 16  # padded as the tiny LLaDA's embedding
  w = ckt.random_weights(vocab=rows, d=32, layers=layers, heads=4, kv_heads=2, mlp=64,
                         seed=seed)
  ckt.write_tensors(model_dir, ckt.qwen_tensors(w), ckt.qwen_config(
      w, heads=4, kv_heads=2, model_type="llama", max_position_embeddings=1024,
      bos_token_id=backend.token_to_id("<|startoftext|>"),
      eos_token_id=backend.token_to_id("<|endoftext|>")))
  return model_dir


def write_d2f_adapter(adapter_dir, *, rank: int = 4, seed: int = 1) -> Path:
  """Writes a PEFT LoRA adapter for the tiny checkpoint (D2F's targets and naming)."""
  rng = np.random.default_rng(seed)
  factors = {f"model.transformer.blocks.{i}.{m}": (
      (0.1 * rng.standard_normal((rank, D_MODEL))).astype(np.float32),
      (0.1 * rng.standard_normal((D_MODEL, rank))).astype(np.float32))
      for i in range(LAYERS) for m in LORA_TARGETS}
  return ckt.write_peft_adapter(adapter_dir, factors, r=rank, alpha=float(rank),
                                target_modules=list(LORA_TARGETS), dropout=0.1)
