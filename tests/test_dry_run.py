"""The dry run on the published 8B configs (config.json only, no weights): its printed bytes
per device equal the abstract arrays' bytes summed by hand, an {fsdp: 8} plan fits a 16 GiB
chip in bfloat16 and {fsdp: 1} is refused in one line naming the change."""

import json
import re

import pytest

from dllm_jax import dry_run, generate

GIB16 = 16 << 30
BF16 = 2

# GSAI-ML/LLaDA-8B-Instruct's config.json as published (auto_map left out).
LLADA_8B_INSTRUCT = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0, "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True, "bias_for_layer_norm": False,
    "block_group_size": 1, "block_type": "llama", "d_model": 4096, "embedding_dropout": 0.0,
    "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None,
    "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
    "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": 126336,
    "max_sequence_length": 4096, "mlp_hidden_size": 12288, "mlp_ratio": 4,
    "model_type": "llada", "multi_query_attention": None, "n_heads": 32, "n_kv_heads": 32,
    "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
    "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False,
    "vocab_size": 126464, "weight_tying": False}

# meta-llama/Meta-Llama-3-8B-Instruct's config.json as published.
LLAMA3_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128009, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  out = {}
  for name, config in (("llada", LLADA_8B_INSTRUCT), ("llama", LLAMA3_8B_INSTRUCT)):
    path = tmp_path_factory.mktemp(name)
    (path / "config.json").write_text(json.dumps(config))
    out[name] = path
  return out


def _hand_params(*, v, d, layers, heads, kv_heads, mlp, fsdp):
  """Per-device parameter bytes under the default rules: every kernel and the embedding
  split over fsdp along D, norm scales replicated."""
  dh = d // heads
  split = (v * d                                           # embedding [V, D]
           + layers * d * heads * dh * 2                   # q [L, D, H*Dh], o [L, H*Dh, D]
           + layers * d * kv_heads * dh * 2                # k, v [L, D, K*Dh]
           + layers * d * mlp * 3                          # gate, up [L, D, F], down [L, F, D]
           + d * v)                                        # lm_head [D, V]
  replicated = layers * d * 2 + d                          # attn / mlp norms [L, D], final [D]
  return (split // fsdp + replicated) * BF16


def _hand_cache(*, layers, rows, slots, kv_heads, dh, dp):
  """k, v [L, B, S, K, Dh] in bf16 and block_ids [B, S], length [B] int32, B over dp."""
  return (2 * layers * rows * slots * kv_heads * dh * BF16 + rows * slots * 4 + rows * 4) // dp


def _printed(out: str, row: str) -> int:
  return int(re.search(rf"^{re.escape(row)}\s+([\d,]+)", out, re.M).group(1).replace(",", ""))


def _cli(capsys, *argv):
  rc = generate.main(list(argv))
  captured = capsys.readouterr()
  return rc, captured.out, captured.err


def test_llada_fsdp8_fits_and_its_bytes_are_the_hand_sum(dirs, capsys):
  rc, out, err = _cli(capsys, "--model", str(dirs["llada"]), "--method", "d2f", "--opt",
                      "block_length=32", "--dry-run", "--mesh", '{"fsdp": 8}', "--data_parallel",
                      "spmd", "--batch", "8", "--prompt_len", "512", "--gen_length", "256",
                      "--device_memory", "16GiB")
  assert rc == 0 and err == "", err
  params = _hand_params(v=126464, d=4096, layers=32, heads=32, kv_heads=32, mlp=12288, fsdp=8)
  assert _printed(out, "parameters (stored)") == params
  # D2F's exact cache holds prompt + canvas: 512 + 256 slots per row, one row per device.
  assert _printed(out, "K/V cache") == _hand_cache(layers=32, rows=8, slots=768, kv_heads=32,
                                                   dh=128, dp=8)
  rows = ("parameters (stored)", "parameters (gathered copy)", "K/V cache", "decode state",
          "activations (T=768, S=1536)")  # T = P + G, S = T + the cache's 768 slots
  assert _printed(out, "total") == sum(_printed(out, r) for r in rows) < GIB16
  assert re.search(r"^budget .* fits$", out, re.M)
  whole = _hand_params(v=126464, d=4096, layers=32, heads=32, kv_heads=32, mlp=12288, fsdp=1)
  assert 8.0e9 < whole / BF16 < 8.05e9  # LLaDA-8B: 8.02B parameters, 14.9 GiB in bf16


def test_llama3_fsdp8_with_gqa_is_the_hand_sum(dirs):
  report = dry_run.plan_checkpoint(dirs["llama"], method="ar", mesh={"fsdp": 8},
                                   data_parallel="spmd", batch=8, prompt_len=700,
                                   gen_length=256, device_memory="16GiB")
  assert report.param_bytes == _hand_params(v=128256, d=4096, layers=32, heads=32, kv_heads=8,
                                            mlp=14336, fsdp=8)
  assert report.padded_prompt_len == 1024  # generate's bucket for 700 tokens
  assert report.cache_bytes == _hand_cache(layers=32, rows=8, slots=1024 + 256, kv_heads=8,
                                           dh=128, dp=8)
  assert report.forward_tokens == 1024  # AR's widest forward is the prefill
  assert report.fits and report.check() is report
  assert json.loads(json.dumps(report.to_dict()))["fits"] is True


def test_fsdp1_is_refused_in_one_line_naming_the_change(dirs, capsys):
  rc, out, err = _cli(capsys, "--model", str(dirs["llada"]), "--method", "d2f", "--opt",
                      "block_length=32", "--dry_run", "--mesh", '{"fsdp": 1}', "--data_parallel",
                      "spmd", "--prompt_len", "512", "--gen_length", "256", "--device_memory",
                      "16GiB")
  assert rc == 2 and "DOES NOT FIT" in out
  assert err.count("\n") == 1 and err.startswith("error: does not fit: ")
  assert 'mesh {"fsdp": 2}' in err and "14.93 GiB" in err


def test_shard_map_replicates_fsdp_params_and_says_so(dirs):
  """shard_map (asked for on an fsdp mesh) gathers the whole model on every device: the dry
  run counts that copy and names data_parallel=spmd (generate's default there) as the fix."""
  default = dry_run.plan_checkpoint(dirs["llada"], method="d2f", mesh={"fsdp": 8}, batch=8,
                                    prompt_len=512, gen_length=256, device_memory=GIB16,
                                    block_length=32)
  assert default.data_parallel == "spmd" and default.fits
  report = dry_run.plan_checkpoint(dirs["llada"], method="d2f", mesh={"fsdp": 8}, batch=8,
                                   prompt_len=512, gen_length=256, device_memory=GIB16,
                                   data_parallel="shard_map", block_length=32)
  assert report.data_parallel == "shard_map"
  assert report.working_param_bytes == _hand_params(v=126464, d=4096, layers=32, heads=32,
                                                    kv_heads=32, mlp=12288, fsdp=1)
  with pytest.raises(dry_run.DoesNotFit, match=r"fits with data_parallel=spmd"):
    report.check()


def test_tensor_axis_splits_heads_cache_and_logits(dirs):
  one = dry_run.plan_checkpoint(dirs["llama"], method="ar", batch=1, prompt_len=64,
                                gen_length=64)
  eight = dry_run.plan_checkpoint(dirs["llama"], method="ar", mesh={"tensor": 8}, batch=1,
                                  prompt_len=64, gen_length=64)
  assert eight.cache_bytes == (one.cache_bytes - 64 * 4 * 2 - 4) // 8 + 128 * 4 + 4
  logits = "logits f32 + probabilities f32 [b,T,V]"
  assert eight.activations[logits] * 8 == one.activations[logits] == 2 * 64 * 128256 * 4
  assert one.fits is None and one.refusal is None  # no budget: no verdict


def test_no_weights_are_needed_and_bad_input_is_named(dirs, tmp_path):
  assert not list(dirs["llada"].glob("*.safetensors"))
  with pytest.raises(ValueError, match="16 GiB.*write it like 16GiB"):
    dry_run.parse_bytes("16 GiB?")
  assert dry_run.parse_bytes("16GiB") == GIB16 and dry_run.parse_bytes("80GB") == 80 * 10**9
  with pytest.raises(ValueError, match="unknown axes"):
    dry_run.plan_checkpoint(dirs["llama"], method="ar", mesh={"model": 8}, prompt_len=8)
  with pytest.raises(ValueError, match="drafts with a second model"):
    dry_run.plan_checkpoint(dirs["llama"], method="speculative", prompt_len=8)
  with pytest.raises(FileNotFoundError, match="config.json"):
    dry_run.plan_checkpoint(tmp_path, method="ar", prompt_len=8)


def test_an_adapter_adds_its_lora_leaves(dirs, tmp_path):
  (tmp_path / "adapter_config.json").write_text(json.dumps(
      {"peft_type": "LORA", "r": 32, "lora_alpha": 32, "target_modules": ["q_proj"]}))
  base = dry_run.plan_checkpoint(dirs["llada"], method="d2f", prompt_len=64, gen_length=64)
  lora = dry_run.plan_checkpoint(dirs["llada"], adapter=tmp_path, method="d2f", prompt_len=64,
                                 gen_length=64)
  # lora_a [L, in, r] and lora_b [L, r, out] on q, k, v, o (4096 -> 4096 each), bf16
  assert lora.param_bytes - base.param_bytes == 4 * 32 * (4096 * 32 + 32 * 4096) * BF16


def test_the_cli_data_parallel_flag_reaches_the_sampler():
  args = generate.build_parser().parse_args(
      ["--preset", "tiny", "--method", "ar", "--prompt", "hi", "--data_parallel", "spmd"])
  sampler = generate.make_sampler(args)
  assert sampler.data_parallel == "spmd"
  assert sampler.replace(gen_length=4).data_parallel == "spmd"


def test_eval_cli_dry_run_plans_from_the_model_args(dirs, capsys):
  """`python -m dllm_jax.eval ... --dry-run` reads the model args (batch_size, mesh, dtype,
  method options) and prints the same plan as the generate CLI; {fsdp: 1} is refused."""
  from dllm_jax.eval import __main__ as eval_cli
  args = ["--model_args", f"checkpoint={dirs['llada']},method=d2f,block_length=32,"
          "gen_length=256,batch_size=8,mesh={\"fsdp\": 8}", "--tasks", "gsm8k", "--dry-run",
          "--prompt_len", "512", "--device_memory", "16GiB"]
  assert eval_cli.main(args) == 0
  out = capsys.readouterr().out
  assert _printed(out, "parameters (stored)") == _hand_params(
      v=126464, d=4096, layers=32, heads=32, kv_heads=32, mlp=12288, fsdp=8)
  assert _printed(out, "K/V cache") == _hand_cache(layers=32, rows=8, slots=768, kv_heads=32,
                                                   dh=128, dp=8)
  assert eval_cli.main([a.replace('"fsdp": 8', '"fsdp": 1') for a in args]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: does not fit: ")
  assert eval_cli.main(["--model_args", "checkpoint=demo", "--tasks", "x", "--dry-run"]) == 2
  assert "needs none" in capsys.readouterr().err
