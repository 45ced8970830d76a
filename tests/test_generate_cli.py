"""`python -m dllm_jax.generate` on tiny checkpoints written in the published layouts."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import tokenizers
from pydoc_data import topics
from tokenizers import decoders, models, pre_tokenizers, trainers

from dllm_jax import checkpoints, decoding, generate
from dllm_jax.checkpoints import testing as ckt

SPECIALS = ["<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>", "<|start_header_id|>",
            "<|end_header_id|>"]
TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
            "{{ m['content'] }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
            "{% endif %}")


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
  """A tiny LLaDA checkpoint with a BPE tokenizer, chat template and a PEFT adapter."""
  path = tmp_path_factory.mktemp("llada")
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.train_from_iterator(
      list(topics.topics.values())[:20],
      trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  backend.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "eos_token": "<|endoftext|>", "mask_token": "<|mdm_mask|>", "chat_template": TEMPLATE}))
  vocab = backend.get_vocab_size()
  w = ckt.random_weights(vocab=vocab, d=32, layers=2, heads=4, kv_heads=4, mlp=64)
  ckt.write_tensors(path / "model", ckt.llada_tensors(w), ckt.llada_config(
      w, heads=4, kv_heads=4, mask_token_id=backend.token_to_id("<|mdm_mask|>"),
      eos_token_id=backend.token_to_id("<|endoftext|>"), max_sequence_length=256))
  for f in ("tokenizer.json", "tokenizer_config.json"):
    (path / "model" / f).write_bytes((path / f).read_bytes())
  rng = np.random.default_rng(0)
  factors = {f"model.transformer.blocks.{i}.{m}": (
      rng.standard_normal((4, 32)).astype(np.float32) * 0.1,
      rng.standard_normal((32, 4)).astype(np.float32) * 0.1)
      for i in range(2) for m in ("q_proj", "k_proj", "v_proj", "attn_out")}
  ckt.write_peft_adapter(path / "adapter", factors, r=4, alpha=4.0,
                         target_modules=["q_proj", "k_proj", "v_proj", "attn_out"])
  return path


@pytest.mark.parametrize("method,opts", [
    ("d2f", ["block_length=4", "tau_conf=0.5"]),
    ("llada", ["block_length=8", "steps=8"]),
])
def test_cli_generates_with_adapter(llada_dir, capsys, method, opts):
  argv = ["--model", str(llada_dir / "model"), "--adapter", str(llada_dir / "adapter"),
          "--method", method, "--prompt", "What is a module?", "--gen_length", "16",
          "--dtype", "float32", "--json"]
  for o in opts:
    argv += ["--opt", o]
  assert generate.main(argv) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report["method"] == method and report["nfe"] >= 1
  assert 0 <= report["response_tokens"] <= 16

  # The CLI's answer is what the library gives for the same chat-formatted prompt.
  cfg, params = checkpoints.load_pretrained(llada_dir / "model", dtype="float32",
                                            adapter_dir=llada_dir / "adapter")
  tok = checkpoints.load_tokenizer(llada_dir / "model")
  text = tok.apply_chat_template([{"role": "user", "content": "What is a module?"}])
  kw = {k: v for k, v in (generate._parse_opt(o) for o in opts)}
  out = decoding.generate(params, cfg, [tok.encode(text, add_special_tokens=False)],
                          method=method, gen_length=16, **kw)
  expected = tok.decode(np.asarray(out.tokens[0, :out.lengths[0]]).tolist(),
                        skip_special_tokens=True)
  assert report["answers"] == [expected]
  assert report["nfe"] == int(out.nfe)


def test_cli_errors_name_the_problem(llada_dir, tmp_path):
  with pytest.raises(FileNotFoundError, match="not a directory"):
    generate.main(["--model", str(tmp_path / "nope"), "--prompt", "x"])
  with pytest.raises(ValueError, match="gen_lenght|Unknown|option"):
    generate.main(["--model", str(llada_dir / "model"), "--prompt", "x", "--dtype",
                   "float32", "--opt", "gen_lenght=3"])
