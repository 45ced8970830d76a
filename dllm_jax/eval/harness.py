"""`DllmJaxLM`: the lm-evaluation-harness model `dllm_jax`, over a `Sampler`.

    lm_eval.simple_evaluate(model="dllm_jax", tasks=["gsm8k"],
                            model_args="checkpoint=/ckpt/LLaDA-8B-Instruct,method=d2f")
    DllmJaxLM.from_sampler(sampler, batch_size=8)   # a sampler already in memory

Shape legend: B batch, P padded sequence length, W scored columns.

`generate_until` groups the requests by task and generation settings, sorts each group by
prompt length (so a batch holds similar lengths: one prompt bucket, one compile) and hands
`batch_size` prompts at a time to `Sampler.sample`, which pads them, decodes with the method
and its options, cuts at the stop token and at the `until` strings. A prompt is encoded as
`Sampler` encodes raw text (the tokenizer's special tokens, e.g. BOS), or, when lm-eval
applied the chat template (`apply_chat_template`), as the rendered template (which writes its
own special tokens); a prompt longer than the window leaves room for the response by dropping
its oldest tokens, as lm-eval's HF model does. The response has `gen_length` slots: the
model args' or the checkpoint's gen_length when set (a paper's published setting), else the
task's `max_gen_toks`.

`loglikelihood` / `loglikelihood_rolling` score token ids split as lm-eval's HF model splits
them (trailing spaces of the context move to the continuation; an empty context becomes the
BOS, else EOS, token). A causal model is scored exactly (`likelihood.causal_loglikelihood`),
a masked-diffusion model by LLaDA's Monte-Carlo ELBO (`likelihood.diffusion_elbo`; its
`is_greedy` is False, as eval_llada.py reports with is_check_greedy off). Rolling windows
are lm-eval's (`get_rolling_token_windows`, one context token, each token predicted once)
over max_length - 1 tokens, since the scored sequence itself must fit the window.

Speed (`speed.py`) is recorded per task and returned by `get_model_info`, which lm-eval
writes into the results JSON under `config.dllm_jax.speed`; each generate_until call prints
one summary line per task on stderr.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, Sequence

from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from dllm_jax.decoding import registry
from dllm_jax.eval.args import EvalArgs, parse_model_args
from dllm_jax.eval.speed import SpeedMeter

log = logging.getLogger(__name__)

# Where each attention pattern's likelihood comes from with likelihood="auto".
_AUTO_LIKELIHOOD = {"causal": "ar", "selfspec": "ar", "bidirectional": "elbo"}
_KNOWN_GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature")


def load_sampler(args: EvalArgs):
  """The `Sampler` the parsed model args describe (loads the weights)."""
  from dllm_jax.sampler import Sampler
  mesh = None
  if args.mesh is not None:
    from dllm_jax.parallel import mesh as mesh_lib
    mesh = mesh_lib.make_mesh(args.mesh)
  return Sampler.load(args.checkpoint, args.method, mesh=mesh, **args.load, **args.options)


def _chunks(items: list, size: int):
  for start in range(0, len(items), size):
    yield items[start:start + size]


@register_model("dllm_jax")
class DllmJaxLM(LM):
  """lm-eval's `dllm_jax` model: any checkpoint `Sampler.load` reads, any decoding method.

  Model args: see `dllm_jax.eval.args` (checkpoint, method and its options, drafter_model,
  batch_size, likelihood, mc_num, ...).
  """

  def __init__(self, **model_args):
    super().__init__()
    args = parse_model_args(model_args)
    self._setup(load_sampler(args), args)

  @classmethod
  def from_sampler(cls, sampler, **model_args) -> "DllmJaxLM":
    """The model over a `Sampler` already built; model args other than the evaluation ones
    (batch_size, seed, likelihood, mc_num, ...) are decoder options that replace the
    sampler's."""
    lm = cls.__new__(cls)
    LM.__init__(lm)
    args = parse_model_args({"method": sampler.method, **model_args}, loads=False)
    if args.load or args.mesh is not None:
      raise ValueError(f"from_sampler uses the sampler's model as loaded; drop "
                       f"{sorted(args.load) + (['mesh'] if args.mesh else [])}.")
    lm._setup(sampler.replace(**args.options) if args.options else sampler, args)
    return lm

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
    from dllm_jax.eval.args import split_model_args
    return cls.create_from_arg_obj(split_model_args(arg_string), additional_config)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: Mapping, additional_config: dict | None = None):
    """lm-eval's `--batch_size` (always passed, default 1) applies unless the model args
    give batch_size themselves."""
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
    return cls(**{**extra, **arg_dict})

  def _setup(self, sampler, args: EvalArgs) -> None:
    self.sampler, self.args = sampler, args
    self.cfg, self.tokenizer = sampler.cfg, sampler.tokenizer
    self.batch_size = args.batch_size
    self.max_length = min(args.max_length or sampler.cfg.max_seq_len, sampler.cfg.max_seq_len)
    if self.max_length < 2:
      raise ValueError(f"max_length={self.max_length} leaves no room to score a token; "
                       "use at least 2.")
    self.speed = SpeedMeter()
    self._rendered: set[str] = set()     # contexts rendered by our chat template
    self._warned: set[str] = set()

  # --- tokens ---

  @property
  def _hf_tokenizer(self) -> bool:
    return hasattr(self.tokenizer, "apply_chat_template")

  @property
  def prefix_token_id(self) -> int:
    """The token an empty context becomes: BOS, else EOS."""
    tok = self.tokenizer
    ids = ((tok.bos_token_id, tok.eos_token_id) if self._hf_tokenizer
           else (tok.bos_id, tok.eos_id))
    return next(i for i in (*ids, self.cfg.bos_token_id, self.cfg.eos_token_id, 0)
                if i is not None)

  def _encode(self, text: str, special: bool) -> list[int]:
    from dllm_jax.sampler import encode_text
    if special:
      return encode_text(self.tokenizer, text)
    if self._hf_tokenizer:
      return self.tokenizer.encode(text, add_special_tokens=False)
    return list(self.tokenizer.encode(text))

  def _encode_context(self, context: str) -> list[int]:
    """A prompt's ids: raw text with the tokenizer's special tokens, or our rendered chat
    template as it is (the template writes them)."""
    return self._encode(context, special=context not in self._rendered)

  def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    if not context:
      return [self.prefix_token_id], self._encode(continuation, special=False)
    special = context not in self._rendered
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = self._encode(context + continuation, special)
    head = self._encode(context, special)
    return head, whole[len(head):]

  def _warn_once(self, key: str, message: str) -> None:
    if key not in self._warned:
      self._warned.add(key)
      log.warning(message)

  # --- chat template ---

  @property
  def tokenizer_name(self) -> str:
    return str(self.args.checkpoint).replace("/", "__")

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    return getattr(self.tokenizer, "chat_template", None) if chat_template else None

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    if not getattr(self.tokenizer, "chat_template", None):
      raise ValueError(f"the tokenizer of {self.args.checkpoint} has no chat template; run "
                       "without --apply_chat_template.")
    text = self.tokenizer.apply_chat_template(
        list(chat_history), add_generation_prompt=add_generation_prompt, tokenize=False)
    self._rendered.add(text)
    return text

  # --- generation ---

  def _gen_settings(self, gen_kwargs) -> tuple[tuple[str, ...], int, float | None]:
    """(until strings, gen_length, sampling temperature or None) of one request."""
    kwargs = dict(gen_kwargs or {})
    until = kwargs.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    ignored = sorted(set(kwargs) - set(_KNOWN_GEN_KWARGS))
    if ignored:
      self._warn_once("gen_kwargs", f"dllm_jax ignores the generation kwargs {ignored}; "
                      "decoder options go in --model_args.")
    max_gen = int(kwargs.get("max_gen_toks") or self.args.max_gen_toks)
    gen_length = int(self.sampler.options.get("gen_length", max_gen))
    temperature = None
    if kwargs.get("do_sample") and "temperature" not in self.args.options:
      temperature = float(kwargs.get("temperature") or 0.0) or None
    return tuple(s for s in until if s), gen_length, temperature

  def _prompt_ids(self, context: str, gen_length: int) -> list[int]:
    ids = self._encode_context(context)
    room = self.cfg.max_seq_len - gen_length
    if 0 < room < len(ids):
      self._warn_once("truncated", f"a prompt of {len(ids)} tokens is cut to its last {room} "
                      f"so that {gen_length} response slots fit the model window "
                      f"({self.cfg.max_seq_len}).")
      ids = ids[-room:]
    return ids

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each request's response: decoded in batches of `batch_size`, cut at its `until`."""
    out: list = [None] * len(requests)
    groups: dict = {}
    for i, request in enumerate(requests):
      key = (request.task_name or "", *self._gen_settings(request.args[1]))
      groups.setdefault(key, []).append(i)
    for (task, until, gen_length, temperature), rows in groups.items():
      sampler = (self.sampler if temperature is None
                 else self.sampler.replace(temperature=temperature))
      ids = {i: self._prompt_ids(requests[i].args[0], gen_length) for i in rows}
      rows = sorted(rows, key=lambda i: -len(ids[i]))   # similar lengths share a batch
      for chunk in _chunks(rows, self.batch_size):
        start = time.perf_counter()
        result = sampler.sample([ids[i] for i in chunk], max_new_tokens=gen_length,
                                stop=until, seed=self.args.seed, return_output=True)
        self._record(task, result, gen_length, temperature, time.perf_counter() - start)
        for i, text in zip(chunk, result.text):
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    for task in dict.fromkeys(key[0] for key in groups):
      print(self.speed.tasks[task].line(f"[dllm_jax] {self.sampler.method} {task or 'requests'}"),
            file=sys.stderr, flush=True)
    return out

  def _record(self, task: str, result, gen_length: int, temperature, wall_s: float) -> None:
    from dllm_jax.decoding import buckets
    rows, length = result.prompt_tokens.shape
    shape = (temperature is None, buckets.batch_size(rows),
             buckets.prompt_length(length, gen_length, self.cfg.max_seq_len), gen_length)
    self.speed.add(task, rows=rows, tokens=int(result.lengths.sum()), nfe=result.nfe,
                   wall_s=wall_s, compiled=self.speed.first_of_shape(shape))

  # --- likelihoods ---

  @property
  def likelihood(self) -> str:
    """"ar" (exact) or "elbo" (Monte Carlo), from the model args or the method's attention."""
    if self.args.likelihood != "auto":
      return self.args.likelihood
    attention = registry.get(self.sampler.method).attention
    if attention not in _AUTO_LIKELIHOOD:
      raise ValueError(f"method={self.sampler.method} decodes a {attention} model, which has "
                       "no likelihood of its own here: add likelihood=elbo (the masked-"
                       "diffusion ELBO, bidirectional) or likelihood=ar (causal) to the model "
                       "args, or evaluate likelihood tasks with method=llada / method=ar.")
    return _AUTO_LIKELIHOOD[attention]

  def _fit(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], int]:
    """(ids within the window, continuation tokens scored): the oldest ids go first."""
    seq = list(context) + list(continuation)
    return seq[-self.max_length:], min(len(continuation), self.max_length - 1)

  def _score(self, items: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    if not items:
      return []
    return self._score_ar(items) if self.likelihood == "ar" else self._score_elbo(items)

  def _padded(self, rows: list[list[int]]):
    import numpy as np
    from dllm_jax.decoding import base, buckets
    pad = base.output_pad_id(self.cfg)
    length = buckets.bucket(max(len(r) for r in rows), "pow2", low=buckets.MIN_PROMPT_BUCKET,
                            cap=self.cfg.max_seq_len)
    tokens, valid = base.pad_prompts(rows, pad, length=length)
    return buckets.pad_batch(np.asarray(tokens), np.asarray(valid), length,
                             buckets.batch_size(len(rows)), pad)

  def _score_ar(self, items) -> list[tuple[float, bool]]:
    import jax
    import numpy as np
    from dllm_jax.decoding import buckets
    from dllm_jax.eval import likelihood
    out: list = [None] * len(items)
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
    for chunk in _chunks(order, self.batch_size):
      tokens, valid = self._padded([items[i][0] for i in chunk])
      lengths = np.array([items[i][1] for i in chunk], np.int32)
      lengths = np.pad(lengths, (0, len(tokens) - len(chunk)), mode="edge")
      width = min(buckets.bucket(int(lengths.max()), "pow2"), tokens.shape[1] - 1)
      total, greedy = jax.device_get(likelihood.causal_loglikelihood(
          self.sampler.params, tokens, valid, lengths, cfg=self.cfg, width=width))
      for j, i in enumerate(chunk):
        out[i] = (float(total[j]), bool(greedy[j]))
    return out

  def _score_elbo(self, items) -> list[tuple[float, bool]]:
    import jax
    import numpy as np
    from dllm_jax.decoding import buckets
    from dllm_jax.eval import likelihood
    out = []
    for seq, length in items:
      if length == 0:             # nothing to score: log 1
        out.append((0.0, True))
        continue
      tokens, valid = self._padded([seq])
      width = min(buckets.bucket(length, "pow2"), tokens.shape[1] - 1)
      losses = jax.device_get(likelihood.diffusion_elbo(
          self.sampler.params, tokens[0], valid[0], length,
          likelihood.request_key(self.args.seed, seq), cfg=self.cfg, width=width,
          mc_num=self.args.mc_num, mc_batch=self.args.mc_batch_size))
      out.append((-float(np.mean(losses)), False))
    return out

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    """(log p(continuation | context), is_greedy) per request (see the module docstring)."""
    scores = self._score([self._fit(*self._encode_pair(*r.args)) for r in requests])
    for request, score in zip(requests, scores):
      self.cache_hook.add_partial("loglikelihood", request.args, score)
    return scores

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """log p(text) per request, summed over lm-eval's disjoint rolling windows."""
    items, owners = [], []
    for r, request in enumerate(requests):
      windows = lm_utils.get_rolling_token_windows(
          token_list=self._encode(request.args[0], special=False),
          prefix_token=self.prefix_token_id, max_seq_len=self.max_length - 1, context_len=1)
      for context, continuation in map(lm_utils.make_disjoint_window, windows):
        items.append(self._fit(context, continuation))
        owners.append(r)
    totals = [0.0] * len(requests)
    for (logprob, _), r in zip(self._score(items), owners):
      totals[r] += logprob
    for request, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
    return totals

  # --- what the results JSON records ---

  def get_model_info(self) -> dict:
    """lm-eval merges this into the results' `config`: the model, the method with its
    options, the likelihood estimator and the decode speed per task."""
    try:
      likelihood = self.likelihood
    except ValueError:
      likelihood = None
    return {"dllm_jax": {
        "checkpoint": self.args.checkpoint, "method": self.sampler.method,
        "options": _jsonable(self.sampler.options), "likelihood": likelihood,
        "mc_num": self.args.mc_num, "mc_batch_size": self.args.mc_batch_size,
        "seed": self.args.seed, "batch_size": self.batch_size,
        "num_parameters": self.cfg.num_params(), "dtype": self.cfg.dtype,
        "speed": self.speed.report()}}


def _jsonable(options: Mapping) -> dict:
  """Decoder options as JSON values (a drafter model becomes its config's name)."""
  out = {}
  for key, value in options.items():
    if key == "drafter_params":
      continue
    if key == "drafter_cfg":
      value = getattr(value, "name", str(value))
    elif not isinstance(value, (str, int, float, bool, type(None), list, tuple)):
      value = repr(value)
    out[key] = list(value) if isinstance(value, tuple) else value
  return out
