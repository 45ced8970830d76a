"""Loading never guesses: a stored tensor the model would not use is an error naming it and
the config.json key, unless the caller opts out (then a warning names it)."""

import json
import logging

import numpy as np
import pytest

from dllm_jax import generate
from dllm_jax.checkpoints import load_pretrained
from dllm_jax.checkpoints import testing as ckt

import tiny_llada

HEADS = 4
HEAD = "model.transformer.ff_out.weight"
EMBED = "model.transformer.wte.weight"


def _llada(path, *, tied_config: bool, head: str | None, add=None):
  """A tiny LLaDA-layout checkpoint: config `weight_tying=tied_config`; `head` None (no
  stored head), "separate" (a trained head) or "copy" (the embedding stored again)."""
  w = ckt.random_weights(vocab=64, d=32, layers=2, heads=HEADS, kv_heads=HEADS, mlp=64,
                         tied=True)
  tensors = ckt.llada_tensors(w)
  if head == "separate":
    tensors[HEAD] = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
  elif head == "copy":
    tensors[HEAD] = w["embed"].copy()
  tensors.update(add or {})
  config = ckt.llada_config(w, heads=HEADS, kv_heads=HEADS, mask_token_id=63, eos_token_id=62)
  config["weight_tying"] = tied_config
  return ckt.write_tensors(path, tensors, config)


def test_tied_config_with_a_separate_head_is_an_error(tmp_path):
  _llada(tmp_path, tied_config=True, head="separate")
  with pytest.raises(ValueError, match=rf"'{HEAD}' \(config.json sets weight_tying=true.*"
                                       r"strict=False"):
    load_pretrained(tmp_path, dtype="float32")


def test_opting_out_loads_the_tied_model_and_warns(tmp_path, caplog):
  _llada(tmp_path, tied_config=True, head="separate")
  with caplog.at_level(logging.WARNING):
    cfg, params = load_pretrained(tmp_path, dtype="float32", strict=False)
  assert cfg.tie_embeddings and "lm_head" not in params
  assert HEAD in caplog.text and "weight_tying" in caplog.text and "ignored" in caplog.text


def test_a_stored_copy_of_the_tied_embedding_is_used_silently(tmp_path, caplog):
  _llada(tmp_path, tied_config=True, head="copy")
  with caplog.at_level(logging.WARNING):
    cfg, params = load_pretrained(tmp_path, dtype="float32")
  assert cfg.tie_embeddings and "lm_head" not in params and HEAD not in caplog.text


def test_untied_config_without_a_head_names_the_key(tmp_path):
  _llada(tmp_path, tied_config=False, head=None)
  with pytest.raises(ValueError, match=rf"no LM head '{HEAD}'.*weight_tying: true"):
    load_pretrained(tmp_path, dtype="float32")


@pytest.mark.parametrize("name, reason", [
    ("model.transformer.blocks.2.q_proj.weight", "layer 2, but config.json sets n_layers=2"),
    ("model.transformer.blocks.0.q_proj.bias", "a bias, which config.json.s include_qkv_bias"),
    ("model.transformer.extra_scale", "no llada parameter has this name"),
])
def test_an_unknown_tensor_is_named_with_its_config_key(tmp_path, name, reason):
  _llada(tmp_path, tied_config=True, head=None,
         add={name: np.ones((32, 32) if "proj" in name else (4,), np.float32)})
  with pytest.raises(ValueError, match=rf"1 tensor\(s\).*'{name}' \({reason}"):
    load_pretrained(tmp_path, dtype="float32")
  _, params = load_pretrained(tmp_path, dtype="float32", strict=False)
  assert params["layers"]["attn"]["q"]["kernel"].shape == (2, 32, 32)


def test_rotary_buffers_are_allowed_by_name(tmp_path):
  w = ckt.random_weights(vocab=64, d=32, layers=1, heads=HEADS, kv_heads=2, mlp=64)
  tensors = dict(ckt.qwen_tensors(w), **{
      "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)})
  ckt.write_tensors(tmp_path, tensors, ckt.qwen_config(w, heads=HEADS, kv_heads=2,
                                                       model_type="llama"))
  cfg, _ = load_pretrained(tmp_path, dtype="float32")
  assert cfg.n_layers == 1


def test_cli_refuses_in_one_line(tmp_path, capsys):
  model = tiny_llada.write_llada_instruct(tmp_path / "llada")
  config = json.loads((model / "config.json").read_text())
  (model / "config.json").write_text(json.dumps(dict(config, weight_tying=True)))
  assert generate.main(["--model", str(model), "--method", "llada", "--prompt", "hi",
                        "--gen_length", "8"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ")
  assert HEAD in err and "weight_tying" in err and "--allow_unused_weights" in err
