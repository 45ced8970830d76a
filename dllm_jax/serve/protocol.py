"""OpenAI request bodies -> checked `Job`s for the engine (every mistake a 400 naming its field).

A body is checked completely before anything reaches the engine: its fields (an unknown one is
refused), the lane (`model`, or a `method` extra; unknown -> 404), the sampling fields and the
options the lane's rows carry per row (`per_request`: the engine's traced options, sent by the
openai client as `extra_body`, i.e. top-level keys: `threshold`, `tau_conf`, ...; finite
numbers the method's decoder accepts), `n`,
`max_tokens`, `stop`, `seed`, and the prompt (encoded once: raw text with the tokenizer's
special tokens, chat messages through the model's chat template; token ids as given), which
must fit the prompt cap and hold no [MASK] id.

Seeds: choice k of a request with `seed` s (k = prompt index x n + j) decodes with seed
s + k (mod 2**32), so a choice equals its prompt decoded alone with that seed; without a seed
each choice draws a fresh one.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping

from dllm_jax import sampler as sampler_lib
from dllm_jax.decoding import api
from dllm_jax.serve.errors import APIError, bad_request

# OpenAI's sampling fields (and top_k, which most servers read): known to every lane. A lane
# that carries one per row takes the request's value; for one whose method fixes it per lane
# (e.g. selfspec's temperature) the request may send the lane's own value only.
SAMPLING = ("temperature", "top_p", "top_k")
_INTS = ("top_k", "trust_streak")
# OpenAI fields accepted with their neutral value only (what the decoders do not define).
_NEUTRAL = {"frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
            "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""),
            "logprobs": (None, False, 0), "top_logprobs": (None, 0), "best_of": (None, 1),
            "parallel_tool_calls": (None,), "tools": (None, []), "tool_choice": (None, "none"),
            "response_format": (None, {"type": "text"})}
_COMMON = {"model", "method", "stream", "stream_options", "max_tokens", "n", "stop", "seed",
           "user", *SAMPLING, *_NEUTRAL}
FIELDS = {"completions": _COMMON | {"prompt"},
          "chat": _COMMON | {"messages", "max_completion_tokens"}}


def per_request(lanes: Mapping) -> tuple[str, ...]:
  """The decoder options a request may set for its own rows on some lane: what the engine's
  lanes carry per row (their traced options, `Lane.per_row`: changing them never recompiles)."""
  return tuple(sorted({name for lane in lanes.values() for name in lane.per_row}))
MAX_STOP = 16


@dataclasses.dataclass(frozen=True)
class Limits:
  """The server's caps (each refused with a 4xx naming it).

  Attributes:
    max_body_bytes: request body size (413 above).
    max_prompt_tokens: tokens of one prompt (the engines' max_prompt_len; 400 above).
    max_tokens: `max_tokens` of a request (also at most its lane's gen_length; 400 above).
    max_n: choices of a request (`n` x prompts; 400 above).
    max_streams_per_client: rows a client (its API key, else its address) may have in
      flight at once, streamed or not (429 above).
    max_queue: requests that may wait for a slot, per lane (429 with Retry-After above).
    request_timeout: seconds a request may take, queueing included (408 after; its rows
      are cancelled).
  """
  max_body_bytes: int = 1 << 20
  max_prompt_tokens: int = 512
  max_tokens: int = 4096
  max_n: int = 8
  max_streams_per_client: int = 64
  max_queue: int = 256
  request_timeout: float = 600.0


@dataclasses.dataclass(frozen=True)
class Job:
  """A checked request: its lane, prompts (token ids) and decoding settings.

  Attributes:
    lane: the lane (method) name.
    prompts: token ids of each prompt.
    n: choices per prompt; choice i * n + j is prompt i's j-th.
    seeds: one seed per choice.
    options: per-request decoder options (the lane's `per_row` / its decoder's row options).
    max_tokens: response tokens at most, per choice.
    stop: stop strings (the text is cut before the first).
    stream: answer with server-sent events.
    include_usage: a streamed answer ends with a usage chunk (stream_options).
    chat: a chat completion (else a text completion).
  """
  lane: str
  prompts: tuple[tuple[int, ...], ...]
  n: int
  seeds: tuple[int, ...]
  options: Mapping
  max_tokens: int
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool
  chat: bool

  @property
  def choices(self) -> int:
    return len(self.prompts) * self.n

  @property
  def prompt_field(self) -> str:
    return "messages" if self.chat else "prompt"


def _int(body, name, low, high, default):
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, int):
    raise bad_request(f"'{name}' must be an integer, got {value!r}.", name)
  if not low <= value <= high:
    code = "cap_exceeded" if value > high else "invalid_value"
    raise bad_request(f"'{name}' must be in [{low}, {high}], got {value}.", name, code)
  return value


def _number(name, value):
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise bad_request(f"'{name}' must be a number, got {value!r}.", name)
  if not math.isfinite(value):
    raise bad_request(f"'{name}' must be a finite number, got {value!r}.", name)
  if name in _INTS and not float(value).is_integer():
    raise bad_request(f"'{name}' must be an integer, got {value!r}.", name)
  return int(value) if name in _INTS else float(value)


def pick_lane(body: dict, lanes: Mapping, served_name: str) -> str:
  """The lane the body names: its `method` extra, else `model` (a lane name, or the served
  model's name when it has one lane). 404 when none matches."""
  method, model = body.get("method"), body.get("model")
  for name, value in (("method", method), ("model", model)):
    if value is not None and not isinstance(value, str):
      raise bad_request(f"'{name}' must be a string, got {value!r}.", name)
  if method is not None:
    if method in lanes:
      return method
    raise APIError(404, f"method {method!r} is not served here; served: {sorted(lanes)}.",
                   param="method", code="model_not_found", reason="not_found")
  if model is None:
    raise bad_request(f"'model' is required: one of {sorted(lanes)}.", "model", "missing")
  if model in lanes:
    return model
  if model == served_name and len(lanes) == 1:
    return next(iter(lanes))
  raise APIError(404, f"model {model!r} does not exist here; the models are {sorted(lanes)} "
                 "(GET /v1/models).", param="model", code="model_not_found",
                 reason="not_found")


def _options(body: dict, lane, known: tuple[str, ...]) -> dict:
  """The request's own decoder options (`known`: the sampling fields and every lane's per-row
  options), each checked by the lane's decoder alone (so a mistake names its field)."""
  options = {}
  for name in known:
    if body.get(name) is None:
      continue
    value = _number(name, body[name])
    if name in lane.per_row:
      _check_option(lane, name, value)
      options[name] = value
    elif name in api.option_names(lane.method):
      _check_option(lane, name, value)  # fixed per lane: its own value passes, and is moot
    else:
      raise bad_request(f"'{name}' is not an option of method {lane.method!r} (its per-request "
                        f"options: {sorted(lane.per_row)}).", name, "unsupported_option")
  for name in lane.decoder.row_options:  # e.g. adaptive's `task` tag
    if body.get(name) is not None:
      try:
        lane.decoder.row_input(lane.opts, {name: body[name]})
      except ValueError as e:
        raise bad_request(f"'{name}': {e}", name) from None
      options[name] = body[name]
  return options


def _check_option(lane, name: str, value) -> None:
  """A 400 naming `name` unless the lane's decoder accepts `value` and it runs in the
  program the lane compiled (`Lane.resolve`)."""
  try:
    fits = lane.lane.resolve({name: value})[1] == lane.lane.static
  except ValueError as e:
    raise bad_request(f"'{name}': {e}", name) from None
  if fits:
    return
  if name in lane.decoder.sampling_options:  # a greedy-only lane (built sampling=False)
    raise bad_request(f"'{name}'={value} needs the sampling program; the {lane.name!r} lane "
                      f"serves {name}=0 only (start the server without --opt "
                      f"{lane.name}.sampling=false).", name, "unsupported_option")
  raise bad_request(f"'{name}' is fixed per lane for method {lane.method!r} (each value "
                    f"compiles its own program); drop it, or start the server with --opt "
                    f"{lane.name}.{name}={value}.", name, "unsupported_option")


def _stop(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    raise bad_request(f"'stop' must be a non-empty string or a list of them, got {stop!r}.",
                      "stop")
  if len(stop) > MAX_STOP:
    raise bad_request(f"'stop' holds {len(stop)} strings; at most {MAX_STOP}.", "stop",
                      "cap_exceeded")
  return tuple(stop)


def _completion_prompts(body: dict, tokenizer) -> list[list[int]]:
  prompt = body.get("prompt")
  if prompt is None:
    raise bad_request("'prompt' is required: a string, a list of strings, a list of token "
                      "ids or a list of those.", "prompt", "missing")
  if isinstance(prompt, str):
    prompt = [prompt]
  elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
    prompt = [prompt]
  if not isinstance(prompt, list) or not prompt or not all(
      isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p))
      for p in prompt):
    raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a "
                      "list of those.", "prompt")
  return [sampler_lib.encode_text(tokenizer, p) if isinstance(p, str) else list(p)
          for p in prompt]


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _chat_prompt(body: dict, tokenizer) -> list[int]:
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise bad_request("'messages' must be a non-empty list of {role, content} objects.",
                      "messages", "missing" if messages is None else "invalid_value")
  turns = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise bad_request(f"messages[{i}] must be an object with a string 'role'.", "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text
      if not all(isinstance(p, dict) and p.get("type") == "text" and
                 isinstance(p.get("text"), str) for p in content):
        raise bad_request(f"messages[{i}].content: only text parts are supported.",
                          "messages")
      content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
      raise bad_request(f"messages[{i}].content must be a string.", "messages")
    turns.append({"role": m["role"], "content": content})
  try:
    return list(sampler_lib.encode_chat(tokenizer, turns))
  except ValueError as e:
    raise bad_request(str(e), "messages") from None


def _check_prompt(ids: list[int], lane, limits: Limits, field: str) -> tuple[int, ...]:
  if not ids:
    raise bad_request(f"'{field}' is empty; send at least one token.", field)
  vocab = lane.cfg.vocab_size
  if any(not 0 <= t < vocab for t in ids):
    raise bad_request(f"'{field}' holds token ids outside the vocabulary [0, {vocab}).", field)
  if len(ids) > limits.max_prompt_tokens:
    raise bad_request(f"'{field}' has {len(ids)} tokens; this server accepts at most "
                      f"{limits.max_prompt_tokens} (--max-prompt-tokens). Shorten it.",
                      field, "context_length_exceeded")
  if lane.mask_id is not None and lane.mask_id in ids:
    raise bad_request(f"'{field}' holds the model's mask id {lane.mask_id}; remove [MASK] "
                      "tokens from prompts (they would be decoded as blanks).", field,
                      "mask_token_in_prompt")
  return tuple(int(t) for t in ids)


def _neutral(body: dict, lane) -> None:
  for name, allowed in _NEUTRAL.items():
    if name not in body:
      continue
    value = body[name]
    if name == "best_of" and value == body.get("n", 1):
      continue
    if not any(value == a and type(value) is type(a) or value is a for a in allowed):
      what = ("does not define logprobs" if "logprobs" in name
              else f"does not support '{name}'")
      raise bad_request(f"method {lane.method!r} {what}; drop '{name}' (or send its neutral "
                        f"value {allowed[-1]!r}).", name, "unsupported_parameter")


def parse(body, *, chat: bool, lanes: Mapping, limits: Limits, served_name: str) -> Job:
  """The checked Job of a completions (chat=False) or chat completions body."""
  if not isinstance(body, dict):
    raise bad_request("the request body must be a JSON object.", None, "invalid_json")
  fields = FIELDS["chat" if chat else "completions"]
  known = tuple(dict.fromkeys(SAMPLING + per_request(lanes)))
  extra = set()
  for lane in lanes.values():
    extra |= set(lane.decoder.row_options)
  unknown = sorted(set(body) - fields - set(known) - extra)
  if unknown:
    raise bad_request(f"unknown field {unknown[0]!r}: not an OpenAI field this server reads, "
                      f"nor a per-request option of its lanes ({', '.join(known)}).",
                      unknown[0], "unknown_field")
  lane = lanes[pick_lane(body, lanes, served_name)]
  _neutral(body, lane)
  for name in set(body) & extra - set(lane.decoder.row_options):
    raise bad_request(f"'{name}' is not an option of method {lane.method!r}.", name,
                      "unsupported_option")
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise bad_request(f"'stream' must be true or false, got {stream!r}.", "stream")
  usage = body.get("stream_options") or {}
  if not isinstance(usage, dict) or set(usage) - {"include_usage"} or not isinstance(
      usage.get("include_usage", False), bool):
    raise bad_request("'stream_options' must be {\"include_usage\": true|false}.",
                      "stream_options")
  if body.get("user") is not None and not isinstance(body["user"], str):
    raise bad_request("'user' must be a string.", "user")
  n = _int(body, "n", 1, limits.max_n, 1)
  top = min(limits.max_tokens, lane.gen_length)
  tokens_field = "max_completion_tokens" if chat and "max_completion_tokens" in body else \
      "max_tokens"
  max_tokens = _int(body, tokens_field, 1, top, top)
  seed = _int(body, "seed", 0, 2 ** 32 - 1, None)
  stop = _stop(body)
  options = _options(body, lane, known)
  field = "messages" if chat else "prompt"
  raw = [_chat_prompt(body, lane.tokenizer)] if chat else \
      _completion_prompts(body, lane.tokenizer)
  prompts = tuple(_check_prompt(ids, lane, limits, field) for ids in raw)
  if len(prompts) * n > limits.max_n:
    raise bad_request(f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices; at most "
                      f"{limits.max_n} per request (--max-n).", "n", "cap_exceeded")
  count = len(prompts) * n
  seeds = tuple(secrets.randbits(32) if seed is None else choice_seed(seed, k)
                for k in range(count))
  return Job(lane.name, prompts, n, seeds, options, max_tokens, stop, stream,
             bool(usage.get("include_usage", False)), chat)


def choice_seed(seed: int, index: int) -> int:
  """The seed of choice `index` of a request sent with `seed` (see the module docstring)."""
  return (int(seed) + int(index)) % 2 ** 32
