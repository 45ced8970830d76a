"""Every broken checkpoint is refused with an error that names the file or tensor."""

import json
import os

import numpy as np
import pytest

from dllm_jax.checkpoints import load_pretrained
from dllm_jax.checkpoints import testing as ckt
from dllm_jax.checkpoints.safetensors_io import TensorStore, read_header

HEADS, KV_HEADS = 4, 2


def _write(path, *, model_type="llama", drop=(), add=None, shard=False, **config_changes):
  w = ckt.random_weights(vocab=64, d=32, layers=2, heads=HEADS, kv_heads=KV_HEADS, mlp=64)
  tensors = {k: v for k, v in ckt.qwen_tensors(w).items() if k not in drop}
  tensors.update(add or {})
  config = ckt.qwen_config(w, heads=HEADS, kv_heads=KV_HEADS, model_type=model_type)
  config.update(config_changes)
  return ckt.write_tensors(path, tensors, config, max_shard_bytes=20_000 if shard else 1 << 40)


def test_good_checkpoint_headers_parse(tmp_path):
  store = TensorStore.from_directory(_write(tmp_path, shard=True))
  assert len(store.names()) == 3 + 2 * 9
  assert store.shape("model.layers.1.mlp.down_proj.weight") == (32, 64)


def test_truncated_file(tmp_path):
  path = _write(tmp_path) / "model.safetensors"
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 100)
  with pytest.raises(ValueError, match=r"model\.safetensors.*(truncated|ends at byte)"):
    load_pretrained(tmp_path, dtype="float32")


@pytest.mark.parametrize("garbage", [b"\xff" * 8, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"])
def test_bad_header(tmp_path, garbage):
  path = _write(tmp_path) / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(garbage + data[len(garbage):])
  with pytest.raises(ValueError, match=r"model\.safetensors.*(header|JSON)"):
    read_header(path)


def test_tiny_file(tmp_path):
  (tmp_path / "x.safetensors").write_bytes(b"abc")
  with pytest.raises(ValueError, match="too short"):
    read_header(tmp_path / "x.safetensors")


def test_missing_shard(tmp_path):
  _write(tmp_path, shard=True)
  shards = sorted(tmp_path.glob("model-*.safetensors"))
  shards[1].unlink()
  with pytest.raises(FileNotFoundError, match=shards[1].name):
    load_pretrained(tmp_path, dtype="float32")


def test_index_names_a_tensor_its_shard_lacks(tmp_path):
  _write(tmp_path, shard=True)
  index_path = tmp_path / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  home = index["weight_map"]["model.norm.weight"]
  index["weight_map"]["model.norm.weight"] = next(
      f for f in sorted(set(index["weight_map"].values())) if f != home)
  index_path.write_text(json.dumps(index))
  with pytest.raises(ValueError, match="model.norm.weight"):
    load_pretrained(tmp_path, dtype="float32")


def test_missing_tensor(tmp_path):
  _write(tmp_path, drop=("model.layers.1.self_attn.k_proj.weight",))
  with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.self_attn\.k_proj"):
    load_pretrained(tmp_path, dtype="float32")


def test_unexpected_tensor(tmp_path):
  _write(tmp_path, add={"model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)})
  with pytest.raises(ValueError, match=r"does not use.*q_norm"):
    load_pretrained(tmp_path, dtype="float32")


def test_config_weights_shape_mismatch(tmp_path):
  _write(tmp_path, intermediate_size=48)
  message = r"mlp\.\w+_proj\.weight'.* has shape .*64.*but config.json implies .*48"
  with pytest.raises(ValueError, match=message):
    load_pretrained(tmp_path, dtype="float32")


@pytest.mark.parametrize("dtype", ["float16", "int8", "fp32"])
def test_wrong_dtype_request(tmp_path, dtype):
  with pytest.raises(ValueError, match=r"dtype=.*'bfloat16', 'float32'"):
    load_pretrained(_write(tmp_path), dtype=dtype)


def test_integer_tensor_refused(tmp_path):
  _write(tmp_path, add={"model.norm.weight": np.ones(32, np.int8)})
  with pytest.raises(ValueError, match=r"model\.norm\.weight.*I8"):
    load_pretrained(tmp_path, dtype="float32")


def test_unknown_family_lists_supported(tmp_path):
  _write(tmp_path, model_type="llama", architectures=["GPT2LMHeadModel"])
  config = json.loads((tmp_path / "config.json").read_text())
  config["model_type"] = "gpt2"
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"'gpt2'.*supported: llama.*qwen2.*dream.*llada"):
    load_pretrained(tmp_path, dtype="float32")


@pytest.mark.parametrize("changes, message", [
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "RoPE scaling 'llama3'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_unsupported_config(tmp_path, changes, message):
  _write(tmp_path, **changes)
  with pytest.raises(ValueError, match=message):
    load_pretrained(tmp_path, dtype="float32")


def test_unsupported_llada_option(tmp_path):
  w = ckt.random_weights(vocab=64, d=32, layers=1, heads=HEADS, kv_heads=KV_HEADS, mlp=64)
  config = ckt.llada_config(w, heads=HEADS, kv_heads=KV_HEADS, mask_token_id=63,
                            eos_token_id=62, alibi=True)
  ckt.write_tensors(tmp_path, ckt.llada_tensors(w), config)
  with pytest.raises(ValueError, match="alibi=True"):
    load_pretrained(tmp_path, dtype="float32")


def test_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_pretrained(tmp_path, dtype="float32")
  _write(tmp_path)
  (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
  with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*\.bin"):
    load_pretrained(tmp_path, dtype="float32")
