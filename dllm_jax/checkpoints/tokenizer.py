"""Local HF tokenizers, their special ids and their chat templates.

A model directory holds `tokenizer.json` (read with the `tokenizers` library) and optionally
`tokenizer_config.json`, `special_tokens_map.json`, `chat_template.jinja`, `config.json` and
`generation_config.json`. Special ids are read from those files, never hard-coded:

  bos / eos / pad / mask   config.json `<x>_token_id`, else generation_config.json, else the
                           `<x>_token` string of tokenizer_config.json / special_tokens_map.json
                           looked up in the vocabulary (a list of eos ids keeps the first)
  eot (end of turn)        the first of END_OF_TURN_TOKENS present in the vocabulary

Chat templates are Jinja, rendered like `transformers` does (sandboxed, `trim_blocks`,
`lstrip_blocks`, `raise_exception`, `strftime_now`, a non-escaping `tojson`, named special
tokens as variables). Rendering needs `jinja2` (imported on first use).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import tokenizers

SPECIAL_FIELDS = ("bos", "eos", "pad", "mask")
# Named special tokens exposed to chat templates (transformers' SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")
# End-of-turn markers of LLaMA-3 / LLaDA, Qwen / Dream, Phi and Gemma chat formats.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")


def read_json(path: Path) -> dict:
  """A JSON file as a dict; {} when it does not exist."""
  if not path.is_file():
    return {}
  try:
    data = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e}); re-download it.") from None
  if not isinstance(data, dict):
    raise ValueError(f"{path} must hold a JSON object.")
  return data


def _token_string(value) -> str | None:
  """A special token from tokenizer_config / special_tokens_map: a string or {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _first_id(value) -> int | None:
  if isinstance(value, (list, tuple)):
    value = value[0] if value else None
  return None if value is None else int(value)


def _lookup_fn(model_dir: Path, tok_cfg: dict) -> Callable[[str], int | None]:
  """token string -> id, from tokenizer.json or else tokenizer_config's added tokens."""
  tok_file = model_dir / "tokenizer.json"
  if tok_file.is_file():
    return _load_backend(tok_file).token_to_id
  added = {_token_string(v): int(k) for k, v in tok_cfg.get("added_tokens_decoder", {}).items()}
  return added.get


def _load_backend(path: Path) -> tokenizers.Tokenizer:
  try:
    return tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:  # the library raises bare Exceptions on malformed files
    raise ValueError(f"{path} cannot be read by the tokenizers library ({e}).") from None


def special_token_ids(model_dir, config: dict | None = None,
                      lookup: Callable[[str], int | None] | None = None) -> dict[str, int | None]:
  """{bos,eos,pad,mask,eot}_token_id from the files of `model_dir` (None when absent).

  `lookup` maps a token string to its id; by default tokenizer.json is read for it.
  """
  model_dir = Path(model_dir)
  config = read_json(model_dir / "config.json") if config is None else config
  generation = read_json(model_dir / "generation_config.json")
  tok_cfg = read_json(model_dir / "tokenizer_config.json")
  token_map = read_json(model_dir / "special_tokens_map.json")
  out: dict[str, int | None] = {}
  for field in SPECIAL_FIELDS:
    key = f"{field}_token_id"
    value = _first_id(config.get(key))
    if value is None:
      value = _first_id(generation.get(key))
    if value is None:
      token = _token_string(tok_cfg.get(f"{field}_token")) or _token_string(
          token_map.get(f"{field}_token"))
      if token is not None:
        lookup = lookup or _lookup_fn(model_dir, tok_cfg)
        value = lookup(token)
    out[key] = value
  lookup = lookup or _lookup_fn(model_dir, tok_cfg)
  out["eot_token_id"] = next(
      (i for i in map(lookup, END_OF_TURN_TOKENS) if i is not None), None)
  return out


def _find_chat_template(model_dir: Path, tok_cfg: dict) -> str | None:
  jinja_file = model_dir / "chat_template.jinja"
  if jinja_file.is_file():
    return jinja_file.read_text()
  template = tok_cfg.get("chat_template") or read_json(model_dir / "chat_template.json").get(
      "chat_template")
  if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
    named = {t.get("name"): t.get("template") for t in template}
    template = named.get("default")
  return template


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
  """A `tokenizers.Tokenizer` with the model's special ids and chat template."""
  backend: tokenizers.Tokenizer
  special_tokens: dict[str, str]            # named special tokens, e.g. {"eos_token": "<|eot_id|>"}
  chat_template: str | None
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  mask_token_id: int | None = None
  eot_token_id: int | None = None

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens: bool = False) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                          tokenize: bool = False, **kwargs) -> str | list[int]:
    """Renders `messages` ([{"role", "content"}]) with the model's template.

    With `tokenize=True` the rendered text is encoded without adding special tokens (the
    template already writes them), as transformers does.
    """
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template (no chat_template.jinja and no "
                       "`chat_template` in tokenizer_config.json); format prompts yourself.")
    text = render_chat_template(self.chat_template, messages,
                                add_generation_prompt=add_generation_prompt,
                                **{**self.special_tokens, **kwargs})
    return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(model_dir) -> Tokenizer:
  """Loads `tokenizer.json` of a local model directory with its special ids and template."""
  model_dir = Path(model_dir)
  tok_file = model_dir / "tokenizer.json"
  if not tok_file.is_file():
    raise FileNotFoundError(
        f"{tok_file} does not exist; only fast tokenizers (tokenizer.json) are supported. "
        "Convert a slow tokenizer with transformers' `AutoTokenizer(...).save_pretrained`.")
  backend = _load_backend(tok_file)
  tok_cfg = read_json(model_dir / "tokenizer_config.json")
  token_map = read_json(model_dir / "special_tokens_map.json")
  special_tokens = {}
  for key in TEMPLATE_TOKENS:
    token = _token_string(tok_cfg.get(key)) or _token_string(token_map.get(key))
    if token is not None:
      special_tokens[key] = token
  ids = special_token_ids(model_dir, lookup=backend.token_to_id)
  return Tokenizer(backend=backend, special_tokens=special_tokens,
                   chat_template=_find_chat_template(model_dir, tok_cfg), **ids)


def render_chat_template(template: str, messages: list[dict], *,
                         add_generation_prompt: bool = True, **variables) -> str:
  """Renders a HF chat template (Jinja) with transformers' environment and helpers."""
  return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **variables)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  try:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
  except ImportError:
    raise ImportError(
        "chat templates are Jinja: install jinja2 (`pip install 'jinja2>=3.1.6'`).") from None
  if tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
    raise ImportError(f"jinja2 {jinja2.__version__} has known sandbox escapes and chat templates "
                      "are untrusted code: upgrade with `pip install -U 'jinja2>=3.1.6'`.")

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)
