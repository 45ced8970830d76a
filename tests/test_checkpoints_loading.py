"""Loading for decoding: converted dirs carry their tokenizer, dtypes are kept, NaN weights are
named at load, and a failed load never touches the checkpoint."""

import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from dllm_jax import checkpoints, generate
from dllm_jax.checkpoints import testing as ckt
from dllm_jax.models.finite import NonFiniteParamsError
from dllm_jax.sampler import Sampler

SPECIALS = ["<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>"]
TEMPLATE = ("{% for m in messages %}<|eot_id|>{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|eot_id|>assistant: {% endif %}")


def _write_model(path: Path, *, dtype=np.float32, nan_at=None, seed=0) -> Path:
  """A tiny LLaDA checkpoint with a word-level tokenizer and a chat template."""
  backend = tokenizers.Tokenizer(models.WordLevel(unk_token="<|endoftext|>"))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  backend.train_from_iterator(["what is one plus two ? three four five six seven : user "
                               "assistant"], trainers.WordLevelTrainer(special_tokens=SPECIALS))
  path.mkdir(parents=True)
  backend.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "eos_token": "<|endoftext|>", "mask_token": "<|mdm_mask|>"}))
  (path / "chat_template.jinja").write_text(TEMPLATE)
  w = ckt.random_weights(vocab=backend.get_vocab_size(), d=32, layers=2, heads=4, kv_heads=4,
                         mlp=64, seed=seed)
  if nan_at is not None:
    w["layers"][nan_at]["q"][3, 5] = np.nan
  tensors = {k: v.astype(dtype) for k, v in ckt.llada_tensors(w).items()}
  ckt.write_tensors(path, tensors, ckt.llada_config(
      w, heads=4, kv_heads=4, mask_token_id=backend.token_to_id("<|mdm_mask|>"),
      eos_token_id=backend.token_to_id("<|endoftext|>"), max_sequence_length=128))
  return path


def _snapshot(root: Path) -> dict:
  """Every file under root with its bytes' hash and mtime."""
  return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                     p.stat().st_mtime_ns)
          for p in sorted(root.rglob("*")) if p.is_file()}


def test_converted_dir_decodes_text_like_the_hf_dir(tmp_path, capsys):
  """README: save_converted(...) then `--model /ckpt/..._orbax` (it needs the tokenizer)."""
  hf = _write_model(tmp_path / "hf")
  cfg, params = checkpoints.load_pretrained(hf)
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    checkpoints.save_converted(tmp_path / "bad", cfg, params, tokenizer_dir=tmp_path)
  assert not (tmp_path / "bad").exists()
  out = checkpoints.save_converted(tmp_path / "orbax", cfg, params, tokenizer_dir=hf)
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    assert (out / name).read_bytes() == (hf / name).read_bytes()

  opts = dict(gen_length=8, block_length=4, steps=8)
  message = [{"role": "user", "content": "what is one plus two ?"}]
  from_hf = Sampler.load(hf, "llada", **opts).sample(message, return_output=True)
  from_orbax = Sampler.load(out, "llada", **opts).sample(message, return_output=True)
  np.testing.assert_array_equal(from_orbax.tokens, from_hf.tokens)
  assert from_orbax.text == from_hf.text
  # The chat template was applied: the prompt ends with the assistant header.
  tok = checkpoints.load_tokenizer(out)
  ids = from_orbax.prompt_tokens[0][from_orbax.prompt_valid[0]].tolist()
  assert tok.decode(ids).endswith("assistant :")

  argv = ["--model", str(out), "--method", "llada", "--prompt", "what is one plus two ?",
          "--gen_length", "8", "--opt", "block_length=4", "--opt", "steps=8", "--json"]
  assert generate.main(argv) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report["answers"] == [from_hf.text]

  # Without the tokenizer files the converted dir names the fix.
  bare = checkpoints.save_converted(tmp_path / "bare", cfg, params)
  with pytest.raises(FileNotFoundError, match="tokenizer_dir"):
    Sampler.load(bare, "llada", **opts)


@pytest.mark.parametrize("stored,expected", [(np.float32, "float32"),
                                             (ml_dtypes.bfloat16, "bfloat16"),
                                             (np.float16, "float32")])
def test_load_pretrained_keeps_the_checkpoint_dtype(tmp_path, stored, expected):
  path = _write_model(tmp_path / "m", dtype=stored)
  cfg, params = checkpoints.load_pretrained(path)
  assert cfg.param_dtype == cfg.dtype == expected
  kernel = params["layers"]["attn"]["q"]["kernel"]
  assert kernel.dtype == jnp.dtype(expected)
  cfg16, params16 = checkpoints.load_pretrained(path, dtype="bfloat16")  # asked for: converted
  assert cfg16.param_dtype == "bfloat16"
  assert params16["layers"]["attn"]["q"]["kernel"].dtype == jnp.bfloat16
  # float32 storage loads bit-exactly by default (kernels are stored transposed).
  if stored is np.float32:
    from dllm_jax.checkpoints.safetensors_io import TensorStore
    ref = TensorStore.from_directory(path).read("model.transformer.blocks.1.q_proj.weight")
    np.testing.assert_array_equal(np.asarray(kernel[1]), ref.T)


def test_nan_weight_is_named_and_nothing_is_written(tmp_path, capsys):
  path = _write_model(tmp_path / "m", nan_at=1)
  before = _snapshot(tmp_path)
  with pytest.raises(NonFiniteParamsError, match=r"layers/attn/q/kernel \(1 of"):
    checkpoints.load_pretrained(path)
  assert generate.main(["--model", str(path), "--method", "llada", "--prompt", "one",
                        "--gen_length", "8"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ")
  assert "non-finite" in err[0] and "layers/attn/q/kernel" in err[0] and str(path) in err[0]
  assert _snapshot(tmp_path) == before


def test_nan_in_converted_checkpoint_is_named(tmp_path):
  clean = _write_model(tmp_path / "hf")
  cfg, params = checkpoints.load_pretrained(clean)
  params["layers"]["attn"]["q"]["kernel"] = params["layers"]["attn"]["q"]["kernel"].at[
      0, 1, 2].set(jnp.nan)
  out = checkpoints.save_converted(tmp_path / "orbax", cfg, params, tokenizer_dir=clean)
  before = _snapshot(tmp_path)
  with pytest.raises(NonFiniteParamsError, match="layers/attn/q/kernel"):
    checkpoints.load_converted(out)
  assert _snapshot(tmp_path) == before


def test_nan_in_adapter_is_named(tmp_path):
  base = _write_model(tmp_path / "hf")
  rng = np.random.default_rng(0)
  factors = {f"model.transformer.blocks.{i}.q_proj": (
      rng.standard_normal((4, 32)).astype(np.float32), rng.standard_normal((32, 4)).astype(
          np.float32)) for i in range(2)}
  factors["model.transformer.blocks.1.q_proj"][1][0, 0] = np.inf
  adapter = ckt.write_peft_adapter(tmp_path / "adapter", factors, r=4, alpha=4.0,
                                   target_modules=["q_proj"])
  before = _snapshot(tmp_path)
  for merge in (False, True):
    with pytest.raises(NonFiniteParamsError, match=(
        r"adapter: non-finite weights \(NaN or inf\) in "
        r"base_model\.model\.model\.transformer\.blocks\.1\.q_proj\.lora_B\.weight \(1 of 128 ")):
      checkpoints.load_pretrained(base, adapter_dir=adapter, merge_lora=merge)
  assert _snapshot(tmp_path) == before


def test_a_bfloat16_checkpoint_computes_in_float32_on_cpu(tmp_path, caplog, monkeypatch):
  """Sampler.load / the CLI on CPU: a bfloat16 HF checkpoint loads in float32 (the faster
  path on XLA:CPU) with a log line saying so, unless dtype is named or float32 would take
  over half the host's memory; a float32 checkpoint is left alone."""
  from dllm_jax import loading
  path = _write_model(tmp_path / "bf16", dtype=ml_dtypes.bfloat16)
  with caplog.at_level("WARNING", logger="dllm_jax.loading"):
    model = loading.load_model(path, "llada")
  assert model.cfg.param_dtype == model.cfg.dtype == "float32"
  assert model.params["layers"]["attn"]["q"]["kernel"].dtype == jnp.float32
  assert "computed in float32 on CPU" in caplog.text and "dtype='bfloat16'" in caplog.text
  kept = loading.load_model(path, "llada", dtype="bfloat16")
  assert kept.cfg.param_dtype == "bfloat16"
  caplog.clear()
  monkeypatch.setattr(loading, "_host_memory", lambda: 1 << 10)  # 1 KiB: float32 cannot fit
  with caplog.at_level("WARNING", logger="dllm_jax.loading"):
    small = loading.load_model(path, "llada")
  assert small.cfg.param_dtype == "bfloat16" and "kept in bfloat16" in caplog.text
  f32 = _write_model(tmp_path / "f32")
  assert loading.platform_dtype(f32) is None
