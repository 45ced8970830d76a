"""Text in, text out: one `Sampler` over every decoder and every kind of checkpoint.

    sampler = Sampler.load("demo", method="d2f")            # or a HF / converted / run dir
    sampler.sample("37+48=")                                # -> "85"
    sampler.sample(["12+34=", "9+90="], seed=1)             # ragged batch -> list of str
    sampler.sample([{"role": "user", "content": "Hi"}])     # chat, via the chat template
    for delta in sampler.sample("37+48=", stream=True):     # text deltas, step by step
      print(delta, end="")

Shape legend: B batch, P padded prompt length, G gen_length (response slots).

A prompt becomes token ids exactly once (`encode`), left padded to at least `prompt_len` (the
fixed prompt region a training run used), and the ids go to `decoding.generate` (or
`decoding.stream`) with the sampler's method and options, so a sampler gives the tokens the
decoder gives on the same encoded prompts. A response is the ids before the first stop token,
detokenized without special tokens, and cut before the first `stop` string. Options pass
through unchanged: `batch_invariant=True` (methods that rank confidences) makes a prompt's
answer the same alone and in a batch; the default ranks exactly, as the reference decoders.

`Sampler.load(path)` accepts:
  "demo"          the built-in demo models (dllm_jax.demo; trained on first use, then cached)
  a HF directory  config.json + safetensors (+ optional PEFT adapter) + tokenizer.json
  a converted dir model_config.json + params/ (checkpoints.save_converted) + tokenizer.json
  a training run  a workdir of `training.trainer.train` (config.json + checkpoints/), with the
                  run's tokenizer and prompt layout, and its decode settings as defaults

Methods that draft with a second model ("speculative", "adaptive") take it as the options
drafter_params / drafter_cfg, or load it from any of the same kinds of path (the demo brings
its own drafter):

    Sampler.load(target_dir, method="speculative", drafter_model=drafter_dir, drafter="ar")
    Sampler.load("demo", method="speculative")              # the demo's AR + D2F drafter
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dllm_jax import decoding
from dllm_jax.decoding import base, registry
from dllm_jax.models.config import ModelConfig

# --- tokenizers: the HF kind (checkpoints.Tokenizer) and the data kind (char / byte / file) ---

def _is_hf_tokenizer(tok) -> bool:
  return hasattr(tok, "apply_chat_template")


def encode_text(tok, text: str) -> list[int]:
  """A raw prompt's ids: the tokenizer's own special tokens (e.g. BOS) included."""
  if _is_hf_tokenizer(tok):
    return tok.encode(text, add_special_tokens=True)
  head = [] if tok.bos_id is None else [tok.bos_id]
  return head + tok.encode(text)


def encode_chat(tok, messages: Sequence[Mapping[str, str]]) -> list[int]:
  """A conversation's ids through the chat template (the template writes special tokens).

  A tokenizer without a template accepts a single user turn, encoded as a raw prompt.
  """
  if _is_hf_tokenizer(tok) and tok.chat_template:
    return tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
  if len(messages) == 1 and messages[0].get("role") == "user":
    return encode_text(tok, messages[0]["content"])
  raise ValueError("this tokenizer has no chat template, so only a single user message can be "
                   "sent; pass the conversation as one formatted string instead.")


def decode_text(tok, ids) -> str:
  ids = [int(i) for i in ids]
  if _is_hf_tokenizer(tok):
    return tok.decode(ids, skip_special_tokens=True)
  return tok.decode(ids, skip_special=True)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
  """(text before the earliest stop string, whether one occurred)."""
  cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
  return (text[:min(cuts)], True) if cuts else (text, False)


def _held_back(text: str, stop: Sequence[str]) -> int:
  """Trailing characters a stream must not show yet: an unfinished UTF-8 character (U+FFFD
  from a cut byte sequence) or the start of a stop string that the next tokens may complete."""
  hold = len(text) - len(text.rstrip("\ufffd"))
  for s in stop:
    for k in range(min(len(s) - 1, len(text)), 0, -1):
      if text.endswith(s[:k]):
        hold = max(hold, k)
        break
  return hold


def _is_messages(x) -> bool:
  return (isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0
          and all(isinstance(m, Mapping) for m in x))


def _is_ids(x) -> bool:
  """Whether `x` is an already encoded prompt: a non-empty list of token ids."""
  return (isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0
          and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in x))


@dataclasses.dataclass(frozen=True)
class SampleOutput:
  """What `sample(..., return_output=True)` returns.

  Attributes:
    text: the responses (a str for a single prompt, else a list).
    tokens: [B, G] response ids (pad after each row's first stop token).
    lengths: [B] response ids before the first stop token.
    nfe: model forward passes of the batched decode.
    prompt_tokens, prompt_valid: [B, P] the encoded, left-padded prompts.
    output: the decoder's `DecodeOutput`.
  """
  text: str | list[str]
  tokens: np.ndarray
  lengths: np.ndarray
  nfe: int
  prompt_tokens: np.ndarray
  prompt_valid: np.ndarray
  output: Any


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class Sampler:
  """A model, its tokenizer and one decoding method with its options.

  Attributes:
    params: the model parameters.
    cfg: their ModelConfig.
    tokenizer: a `checkpoints.Tokenizer` (HF files) or a `data.tokenizers` tokenizer.
    method: a `decoding.registry` name.
    options: the method's options (gen_length, block_length, threshold, ...), checked here.
    prompt_len: prompts are left padded to at least this many tokens (a training run's
      fixed prompt region), or None.
    mesh: a `jax.sharding.Mesh` to decode on, or None for one device.
    data_parallel: with a mesh, `decoding.generate`'s data_parallel ("shard_map" or "spmd";
      None: its default).
  """
  params: Any
  cfg: ModelConfig
  tokenizer: Any
  method: str
  options: Mapping[str, Any]
  prompt_len: int | None
  mesh: Any
  data_parallel: str | None

  def __init__(self, params, cfg: ModelConfig, tokenizer,
               method: str = registry.DEFAULT_METHOD, *,
               prompt_len: int | None = None, mesh=None, data_parallel: str | None = None,
               **options):
    decoding.api.check_options(method, options)  # also rejects an unknown method
    if takes_drafter(method) and (options.get("drafter_params") is None
                                  or options.get("drafter_cfg") is None):
      raise ValueError(f"method {method!r} drafts with a second model: pass drafter_params= "
                       "and drafter_cfg=, or Sampler.load(..., drafter_model=<dir>).")
    for name, value in (("params", params), ("cfg", cfg), ("tokenizer", tokenizer),
                        ("method", method), ("options", dict(options)),
                        ("prompt_len", prompt_len), ("mesh", mesh),
                        ("data_parallel", data_parallel)):
      object.__setattr__(self, name, value)

  def replace(self, **changes) -> "Sampler":
    """A copy with fields changed; `options=` replaces the options, other keys are options."""
    fields = {f: getattr(self, f) for f in ("params", "cfg", "tokenizer", "method",
                                            "prompt_len", "mesh", "data_parallel")}
    options = dict(changes.pop("options", self.options))
    for key in list(changes):
      if key in fields:
        fields[key] = changes.pop(key)
    return Sampler(**fields, **{**options, **changes})

  @classmethod
  def load(cls, path, method: str = registry.DEFAULT_METHOD, *, kind: str = "auto", dtype: str | None = None,
           adapter=None, merge_lora: bool = False, step: int | None = None, mesh=None,
           drafter_model=None, strict: bool = True, **options) -> "Sampler":
    """A sampler for a checkpoint directory or "demo" (see the module docstring).

    Args:
      path: "demo", a HF model dir, a converted dir or a training workdir.
      method: the decoding method.
      kind: "auto" (detected from the files) or the kind `path` must be.
      dtype: "bfloat16" / "float32" for HF checkpoints; None keeps the checkpoint's, except
        a bfloat16 one on CPU, which computes in float32 (`loading.platform_dtype`).
      adapter, merge_lora: a PEFT LoRA adapter for a HF checkpoint (load_pretrained).
      step: the checkpoint step of a training workdir (default: latest).
      mesh: decode on this mesh (parameters placed on it at load).
      drafter_model: for a method that drafts with a second model ("speculative",
        "adaptive"): its path (any kind above, detected; HF weights in `dtype`), passed as
        drafter_params / drafter_cfg. It must share the target's tokenizer (checked on the
        ids when decoding). With path "demo" it defaults to the demo's drafter (the model
        trained with the decoder's `drafter_attention`, or for speculative the one its
        `drafter` option decodes with).
      strict: False loads a HF checkpoint whose files hold tensors the model does not use
        (a warning names them); by default that is an error (`loading.load_model`).
      **options: decoder options; they override the defaults a run or the demo provides.
    """
    from dllm_jax import loading  # the file formats; kept apart from the sampling logic
    if drafter_model is not None and not takes_drafter(method):
      drafted = registry.drafter_methods()
      raise ValueError(f"drafter_model applies to methods that draft with a second model "
                       f"({', '.join(drafted)}), not {method!r}.")
    if drafter_model is None and loading.is_demo(path, kind) and "drafter" in options:
      drafter_model = "demo"  # speculative's drafter kind picks the demo model it drafts with
    model = loading.load_model(path, method, kind=kind, dtype=dtype, adapter=adapter,
                               merge_lora=merge_lora, step=step, mesh=mesh, strict=strict)
    options = {**model.options(method), **options}
    if drafter_model is not None:
      options.update(load_drafter(drafter_model, method, options, dtype=dtype, mesh=mesh))
    return cls(model.params, model.cfg, model.tokenizer, method, prompt_len=model.prompt_len,
               mesh=mesh, **options)

  # --- encoding ---

  def encode(self, prompts) -> tuple[np.ndarray, np.ndarray]:
    """Prompts (see `sample`) -> ([B, P] int32 tokens, [B, P] bool valid), left padded."""
    rows = [encode_chat(self.tokenizer, p) if _is_messages(p) else
            [int(i) for i in p] if _is_ids(p) else encode_text(self.tokenizer, p)
            for p in _as_batch(prompts)[0]]
    longest = max(len(r) for r in rows)
    return base.pad_prompts(rows, base.output_pad_id(self.cfg),
                            length=max(longest, self.prompt_len or 0))

  def _decode_options(self, max_new_tokens: int | None) -> dict:
    options = dict(self.options)
    if max_new_tokens is not None:
      options["gen_length"] = int(max_new_tokens)
    return options

  def _text(self, ids, stop) -> str:
    return cut_at_stop(decode_text(self.tokenizer, ids), stop)[0]

  # --- sampling ---

  def sample(self, prompts, *, max_new_tokens: int | None = None, stop: Sequence[str] = (),
             rng=None, seed: int | None = None, stream: bool = False,
             return_output: bool = False):
    """Decodes prompts and returns their responses as text.

    Args:
      prompts: a string, a list of strings (a ragged batch), a chat conversation
        ([{"role": "user", "content": ...}, ...], through the tokenizer's chat template), a
        list of conversations, or a list of already encoded prompts (token-id lists,
        special tokens included, used as they are).
      max_new_tokens: response slots (the decoder's gen_length); default the sampler's.
      stop: strings that end a response (the text is cut before the first one).
      rng, seed: a PRNG key, or an int seed for one (default seed 0).
      stream: yield text deltas after every decode step instead (see `stream`).
      return_output: return a `SampleOutput` (tokens, lengths, nfe, ...) instead of text.

    Returns:
      a str for a single prompt or conversation, else a list of str (or a SampleOutput).
    """
    stop = _check_stop(stop)
    if stream:
      if return_output:
        raise ValueError("return_output=True cannot be combined with stream=True; the stream "
                         "yields text only.")
      return self.stream(prompts, max_new_tokens=max_new_tokens, stop=stop, rng=rng, seed=seed)
    single = _as_batch(prompts)[1]
    tokens, valid = self.encode(prompts)
    out = jax.device_get(decoding.generate(
        self.params, self.cfg, (tokens, valid), method=self.method, rng=_key(rng, seed),
        mesh=self.mesh, data_parallel=self.data_parallel,
        **self._decode_options(max_new_tokens)))
    response, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = [self._text(response[i, :lengths[i]], stop) for i in range(len(tokens))]
    text = texts[0] if single else texts
    if not return_output:
      return text
    return SampleOutput(text=text, tokens=response, lengths=lengths, nfe=int(out.nfe),
                        prompt_tokens=tokens, prompt_valid=valid, output=out)

  def stream(self, prompts, *, max_new_tokens: int | None = None, stop: Sequence[str] = (),
             rng=None, seed: int | None = None) -> Iterator[str | list[str]]:
    """Yields text deltas after each decode step that adds text (a str for a single prompt,
    else one str per row); their concatenation equals `sample`'s text for the same call.

    A row's text grows with its decided prefix: the response slots decided so far, up to the
    first undecided one (a diffusion decoder may decide later slots first; they show once
    the gap fills). Runs on one device with the methods `decoding.stream` supports.
    """
    stop = _check_stop(stop)
    if self.mesh is not None:
      raise ValueError("streaming runs on one device; load the sampler without a mesh.")
    single = _as_batch(prompts)[1]
    tokens, valid = self.encode(prompts)
    stops = base.stop_ids(self.cfg)
    shown = [""] * len(tokens)
    events = decoding.stream(self.params, self.cfg, (tokens, valid), method=self.method,
                             rng=_key(rng, seed), **self._decode_options(max_new_tokens))
    for event in events:
      if event.output is not None:
        out = jax.device_get(event.output)
        final = [self._text(np.asarray(out.tokens)[i, :int(out.lengths[i])], stop)
                 for i in range(len(tokens))]
        deltas = [_final_delta(f, s) for f, s in zip(final, shown)]
      else:
        deltas = []
        for i in range(len(tokens)):
          ids = _decided_prefix(event.response[i], event.decided[i], stops)
          text, stopped = cut_at_stop(decode_text(self.tokenizer, ids), stop)
          if not stopped:
            text = text[:len(text) - _held_back(text, stop)]
          new = text[len(shown[i]):] if text.startswith(shown[i]) else ""
          shown[i] += new
          deltas.append(new)
      if any(deltas):
        yield deltas[0] if single else deltas


def takes_drafter(method: str) -> bool:
  """Whether `method` drafts with a second model (it takes drafter_params / drafter_cfg)."""
  return registry.check(method) in registry.drafter_methods()


def load_drafter(path, method: str, options: Mapping, *, dtype: str | None = None,
                 mesh=None) -> dict:
  """{"drafter_params", "drafter_cfg"} of the drafter checkpoint at `path` ("demo" or any
  directory kind `loading` detects; HF weights in `dtype`), for `method` with `options`."""
  from dllm_jax import loading
  # It loads as the kind it drafts as: speculative's `drafter` option, else (adaptive) D2F.
  as_method = options.get("drafter", "d2f") if method == "speculative" else "d2f"
  hf = str(path) != "demo" and loading.detect_kind(Path(path)) == "hf"
  drafter = loading.load_model(path, as_method, mesh=mesh, dtype=dtype if hf else None)
  return {"drafter_params": drafter.params, "drafter_cfg": drafter.cfg}


def _final_delta(final: str, shown: str) -> str:
  if not final.startswith(shown):  # a tokenizer whose prefixes decode unstably
    raise RuntimeError(f"streamed text {shown!r} is not a prefix of the final text {final!r}; "
                       "this tokenizer cannot be streamed: use stream=False.")
  return final[len(shown):]


def _decided_prefix(response, decided, stops) -> list[int]:
  """The row's ids up to its first undecided slot or first stop token."""
  ids = []
  for token, done in zip(np.asarray(response).tolist(), np.asarray(decided).tolist()):
    if not done or token in stops:
      break
    ids.append(token)
  return ids


def _as_batch(prompts) -> tuple[list, bool]:
  """(list of prompts, whether a single prompt was given)."""
  if isinstance(prompts, str) or _is_messages(prompts):
    return [prompts], True
  if isinstance(prompts, Sequence) and prompts and all(
      isinstance(p, str) or _is_messages(p) or _is_ids(p) for p in prompts):
    return list(prompts), False
  raise ValueError("prompts must be a string, a list of strings, a chat conversation "
                   "([{'role': 'user', 'content': ...}]), a list of conversations or a list "
                   f"of token-id lists; got {type(prompts).__name__} {str(prompts)[:60]!r}.")


def _check_stop(stop) -> tuple[str, ...]:
  if isinstance(stop, str):
    stop = (stop,)
  stop = tuple(stop)
  if not all(isinstance(s, str) and s for s in stop):
    raise ValueError(f"stop must be non-empty strings, got {stop!r}.")
  return stop


def _key(rng, seed):
  if rng is not None and seed is not None:
    raise ValueError("pass rng or seed, not both.")
  if rng is not None:
    return rng
  return jax.random.key(0 if seed is None else int(seed))


__all__ = ["Sampler", "SampleOutput", "cut_at_stop", "decode_text", "encode_chat",
           "encode_text", "load_drafter", "takes_drafter"]
