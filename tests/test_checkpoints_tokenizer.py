"""Tokenizer files: special ids from the right sources, chat templates rendered like HF."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import tokenizers
from pydoc_data import topics
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dllm_jax.checkpoints import config_from_hf, load_tokenizer, special_token_ids
from dllm_jax.checkpoints import testing as ckt

SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>",
            "<|start_header_id|>", "<|end_header_id|>"]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MESSAGES = [{"role": "system", "content": "You are terse. "},
            {"role": "user", "content": "What does the with statement do?"},
            {"role": "assistant", "content": "It manages a context."},
            {"role": "user", "content": "Ünïcode & <tags> too"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  """A byte-level BPE trained offline, saved with LLaDA-style tokenizer files."""
  path = tmp_path_factory.mktemp("tok")
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  text = list(topics.topics.values())[:60]
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  backend.train_from_iterator(text, trainer)
  bos = backend.token_to_id("<|startoftext|>")
  backend.post_processor = processors.TemplateProcessing(
      single="<|startoftext|> $A", special_tokens=[("<|startoftext|>", bos)])
  backend.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
      "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
      "chat_template": TEMPLATE}))
  (path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
  return path


def test_special_ids_from_tokenizer_files(tok_dir):
  tok = load_tokenizer(tok_dir)
  ids = {t: tok.backend.token_to_id(t) for t in SPECIALS}
  assert tok.bos_token_id == ids["<|startoftext|>"]
  assert tok.eos_token_id == tok.pad_token_id == ids["<|endoftext|>"]
  assert tok.eot_token_id == ids["<|eot_id|>"]
  assert tok.mask_token_id is None  # no mask token declared anywhere: never guessed
  assert tok.vocab_size == 400


def test_config_and_generation_config_take_precedence(tok_dir, tmp_path):
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7, "mask_token_id": 9,
                                                    "pad_token_id": None}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"pad_token_id": [11, 12]}))
  ids = special_token_ids(tmp_path)
  assert (ids["eos_token_id"], ids["mask_token_id"], ids["pad_token_id"]) == (7, 9, 11)
  assert ids["bos_token_id"] == load_tokenizer(tok_dir).bos_token_id


def test_model_config_picks_up_tokenizer_ids(tok_dir, tmp_path):
  w = ckt.random_weights(vocab=416, d=32, layers=1, heads=4, kv_heads=4, mlp=64)
  config = ckt.llada_config(w, heads=4, kv_heads=4, mask_token_id=3, eos_token_id=1)
  del config["pad_token_id"]
  ckt.write_tensors(tmp_path, ckt.llada_tensors(w), config)
  for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
  cfg, family = config_from_hf(tmp_path)
  tok = load_tokenizer(tmp_path)
  assert family.name == "llada"
  assert (cfg.mask_token_id, cfg.eos_token_id) == (3, 1)  # config.json first
  assert cfg.eot_token_id == tok.eot_token_id == tok.backend.token_to_id("<|eot_id|>")
  assert cfg.pad_token_id == tok.backend.token_to_id("<|endoftext|>")  # special_tokens_map
  assert cfg.bos_token_id == tok.backend.token_to_id("<|startoftext|>")


def test_chat_template_and_encoding_match_transformers(tok_dir):
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
  tok = load_tokenizer(tok_dir)
  for add in (True, False):
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=add)
    assert ours == hf.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=False)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=True)
    theirs = hf.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=True)
    assert ids == list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
  assert ours.startswith("<|startoftext|><|start_header_id|>system")
  assert ids.count(tok.eot_token_id) == len(MESSAGES) and ids[0] == tok.bos_token_id
  text = "Exceptions: the try statement, then ünïcode."
  assert tok.encode(text) == hf(text)["input_ids"]
  assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
  with pytest.raises(Exception, match="unknown role tool"):
    tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_from_jinja_file_and_missing_template(tok_dir, tmp_path):
  (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
  with pytest.raises(ValueError, match="no chat template"):
    load_tokenizer(tmp_path).apply_chat_template(MESSAGES)
  (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
  assert load_tokenizer(tmp_path).apply_chat_template(MESSAGES[:2]) == "[system][user]"
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    load_tokenizer(tmp_path / "nowhere")
  assert np.array_equal(load_tokenizer(tmp_path).encode("a b", add_special_tokens=False),
                        load_tokenizer(tok_dir).encode("a b", add_special_tokens=False))
