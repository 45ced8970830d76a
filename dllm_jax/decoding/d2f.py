"""D2F pipelined parallel decoding on a block-causal model with an exact K/V cache.

Shape legend: B batch, P padded prompt length, G = N * k response slots in N blocks of k,
W forward window slots, V vocab.

How it works, in full: docs/decoders.md, `decoding.d2f`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dllm_jax.decoding import base, llada, protocol, sampling, unmasking as unmasking_lib
from dllm_jax.decoding import d2f_state as ds
from dllm_jax.decoding.d2f_state import D2FOptions, D2FState
from dllm_jax.models import kv_cache as kvc
from dllm_jax.models import masks
from dllm_jax.models import transformer as model_lib
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Transformer
from dllm_jax.parallel import mesh as mesh_lib
from dllm_jax.parallel import sharding

Array = jnp.ndarray


def d2f_options(cfg: ModelConfig, *, gen_length: int = base.GEN_LENGTH,
              block_length: int | None = None, max_active_blocks: int | None = None,
              tau_add: float = 0.1, tau_act: float = 0.95, tau_conf: float = 0.9,
              rule: str = "threshold", steps_per_block: int | None = None,
              temperature: float = 0.0, remasking: str = "probability",
              use_cache: bool = True, window: str = "fitted", block_size=None,
              unmasking: str = "even",
              entropy_bound: float = unmasking_lib.DEFAULT_ENTROPY_BOUND,
              batch_invariant: bool = False):
  """Checks the decode settings (ValueError naming the fix).

  Returns (D2FOptions, the static part: a jit argument; Thresholds, the traced part).
  """
  if block_size is not None:
    raise ValueError(f"block_size={block_size!r}: the option is called block_length (the "
                     "same name in every decoding method); pass block_length instead.")
  if not isinstance(gen_length, (int, np.integer)) or gen_length <= 0:
    raise ValueError(f"gen_length must be a positive int, got {gen_length!r}.")
  block = base.resolve_block_length(block_length, gen_length)
  if gen_length % block:
    raise ValueError(f"gen_length ({gen_length}) must be a positive multiple of block_length "
                     f"({block}); round it up to "
                     f"{max(1, math.ceil(gen_length / block)) * block}.")
  n = gen_length // block
  active = n if max_active_blocks is None else max_active_blocks
  if not isinstance(active, (int, np.integer)) or not 1 <= active <= n:
    raise ValueError(f"max_active_blocks={max_active_blocks!r} must be an int in [1, {n}] "
                     f"(the response has {n} blocks); pass None for no bound.")
  for name, tau in (("tau_add", tau_add), ("tau_act", tau_act)):
    base.check_number(name, tau)
    if not 0.0 <= tau <= 1.0:
      raise ValueError(f"{name}={tau} is a fraction of a block and must lie in [0, 1].")
  base.check_number("tau_conf", tau_conf, allow_inf=True)
  if not tau_conf >= 0.0:
    raise ValueError(f"tau_conf={tau_conf} must be >= 0 (above 1: only the top-1 rule).")
  if rule not in ds.COMMIT_RULES:
    raise ValueError(f"Unknown commit rule {rule!r}; use one of {ds.COMMIT_RULES}.")
  unmasking_lib.check(unmasking, entropy_bound)
  if rule != "count" and unmasking != "even":
    raise ValueError(f"unmasking={unmasking!r} sets the count rule's schedule (block "
                     f"diffusion); the {rule!r} rule commits by threshold. Leave it 'even'.")
  if rule == "count" and unmasking == "entropy_bound":
    if steps_per_block not in (None, block):
      raise ValueError(
          f"steps_per_block={steps_per_block}: unmasking='entropy_bound' chooses how many "
          f"tokens each step commits, so the steps per block are dynamic (at most "
          f"block_length={block}); leave steps_per_block unset.")
    steps_per_block = block  # the bound: every step commits at least one token
  if rule == "count":
    steps_per_block = block if steps_per_block is None else steps_per_block
    if not isinstance(steps_per_block, (int, np.integer)) or not \
        1 <= steps_per_block <= block:
      raise ValueError(f"steps_per_block={steps_per_block} must lie in [1, block_length="
                       f"{block}]: each step commits at least one token.")
  base.check_number("temperature", temperature, low=0.0)
  if remasking not in llada.REMASKING:  # LLaDA's / Dream's names are accepted too
    raise ValueError(f"Unknown remasking {remasking!r}; use one of {tuple(llada.REMASKING)}.")
  remasking = llada.REMASKING[remasking]
  if window not in ds.WINDOW_POLICIES:
    raise ValueError(f"Unknown window policy {window!r}; use one of {ds.WINDOW_POLICIES} "
                     "(fitted: forward only the blocks in flight; full: the widest window).")
  if cfg.mask_token_id is None:
    raise ValueError(f"model config {cfg.name!r} has no mask_token_id; D2F needs one.")
  pad = next((i for i in (cfg.pad_token_id, cfg.eos_token_id) if i is not None), 0)
  opts = D2FOptions(
      block_length=int(block), num_blocks=n, max_active=int(active), rule=rule,
      steps_per_block=int(steps_per_block) if rule == "count" else 0,
      remasking=remasking, use_cache=base.check_flag("use_cache", use_cache),
      mask_id=cfg.mask_token_id, stop_ids=base.stop_ids(cfg), pad_id=pad, window=window,
      unmasking=unmasking, sampled=bool(temperature > 0),
      batch_invariant=base.check_flag("batch_invariant", batch_invariant))
  return opts, ds.Thresholds.create(block, tau_add, tau_act, tau_conf, temperature,
                                    entropy_bound)


# ----------------------------------------------------------------------------- model calls

def _proposals(logits: Array, opts: D2FOptions, traced: ds.Thresholds, rng: Array,
               slots: Array):
  """[B, T, V] logits -> proposed tokens, their gate value, their ranking score [B, T].

  The gate is what the commit rule tests besides the ranking: the proposal's probability,
  or (count rule with unmasking="entropy_bound") the entropy of the model's distribution
  (unscaled logits, [MASK] forbidden).

  `slots` [B, T] are the response slots the logits belong to. Random draws use one key per
  row and slot, so a row's samples depend neither on the batch or shard it is decoded in nor
  on the window that carried it: with one `rng` (this step's key), row r's key is
  `sampling.row_keys` for row `traced.row_offset + r`; with per-row keys (`rng` [B], this
  step's key of each row, as the serving engine passes) it is `rng[b]`; the slot is then
  folded in."""
  logits = sampling.forbid(logits, [opts.mask_id])
  if sampling.is_row_keys(rng):
    rows = rng                                                               # [B]
  else:
    rows = sampling.row_keys(rng, 0, logits.shape[0], traced.row_offset)     # [B]
  keys = jax.vmap(lambda key, s: jax.vmap(
      lambda j: jax.random.split(jax.random.fold_in(key, j)))(s))(rows, slots)  # [B, T, 2]
  temperature = traced.temperature if opts.sampled else 0.0  # 0.0: argmax, no draws
  x0 = sampling.map_rows(lambda lg, k, temperature: jax.vmap(
      lambda l, kk: sampling.gumbel_argmax(l, temperature, kk))(lg, k),
                         (logits, keys[..., 0]), temperature=temperature)
  scaled = sampling.scale(logits, temperature)
  prob = sampling.confidence(scaled, x0, "probability")
  gate = unmasking_lib.predictive_entropy(logits) if opts.unmasking == "entropy_bound" else prob
  score = prob if opts.remasking == "probability" else jax.vmap(jax.vmap(
      lambda s, x, k: sampling.confidence(s, x, opts.remasking, k)))(scaled, x0, keys[..., 1])
  return x0, gate, score


def _window_step(params, cfg: ModelConfig, opts: D2FOptions, state: D2FState, blocks: int,
                 rng: Array, with_prompt: bool = False):
  """Forwards each row's window of `blocks` blocks from its first uncached block.

  With `with_prompt` (the first forward, cache still empty) the prompt is forwarded in
  front of the window (block id 0, left-pad positions, padding invisible) and written to
  the cache by the same forward, as the reference does: there is no separate prefill.

  Returns proposals mapped back to response slots ([B, G]; zero probability outside the
  window), the cache with the prompt (first forward) and the final blocks [cached, ready)
  written, and the new `last_logits` (shifted-logits models: the raw output at the last
  written slot).
  """
  k, g, width = opts.block_length, opts.gen_length, blocks * opts.block_length
  start = state.cached * k
  slot = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None]          # [B, W]
  live = ~state.done
  valid = (slot < state.n_blocks[:, None] * k) & live[:, None]
  tokens = jnp.take_along_axis(state.response, jnp.minimum(slot, g - 1), axis=1)
  tokens = jnp.where(valid, tokens, opts.mask_id)
  prompt_len = state.prompt_valid.sum(-1, dtype=jnp.int32)
  write_len = jnp.where(live, (state.ready - state.cached) * k, 0)
  ids, positions, head = 1 + slot // k, prompt_len[:, None] + slot, 0
  if with_prompt:
    head = state.prompt.shape[1]
    tokens = jnp.concatenate([state.prompt, tokens], axis=1)
    ids = jnp.concatenate([jnp.zeros_like(state.prompt), ids], axis=1)
    positions = jnp.concatenate([masks.left_pad_positions(state.prompt_valid), positions], 1)
    valid = jnp.concatenate([state.prompt_valid, valid], axis=1)
    write_len = write_len + head
  model = Transformer(cfg.replace(shift_logits=False))
  call = functools.partial(model.apply, {"params": params}, tokens, block_ids=ids,
                           positions=positions, valid=valid, cache=state.cache,
                           write_len=write_len)
  offset = jnp.arange(g, dtype=jnp.int32)[None] - start[:, None]           # [B, G]

  def proposals(logits, first_slot, out_width, out_valid):
    """Proposals of window slots [first_slot, first_slot + out_width) per row -> [B, G],
    and [B] whether those logits (where `out_valid`) were all finite."""
    finite = sampling.all_finite(logits, out_valid)
    slots = (start + first_slot)[:, None] + jnp.arange(logits.shape[1], dtype=jnp.int32)
    x0, prob, score = _proposals(logits, opts, state.traced, rng, slots)
    rel = offset - first_slot[:, None]
    inside = (rel >= 0) & (rel < out_width)
    back = lambda a: jnp.take_along_axis(a, jnp.clip(rel, 0, out_width - 1), axis=1)
    return (back(x0), jnp.where(inside, back(prob), 0.0),
            jnp.where(inside, back(score), sampling.NEG_INF), finite)

  last = state.last_logits
  if cfg.shift_logits:  # slot j is predicted by the output at j - 1 (before the window: cached)
    logits, cache = call()
    last_written = jnp.take_along_axis(
        logits, jnp.maximum(write_len - 1, 0)[:, None, None], axis=1)[:, 0]
    before = logits[:, head - 1] if with_prompt else state.last_logits
    logits = jnp.concatenate([before[:, None], logits[:, head:-1]], axis=1)
    last = jnp.where((write_len > 0)[:, None], last_written, state.last_logits)
    return proposals(logits, jnp.zeros_like(start), width, valid[:, head:]), cache, last
  # Slots forwarded only to be written (the prompt, final blocks [cached, ready)) need
  # their K/V, not the LM head: project only the slots that can still commit.
  hidden, cache = call(head=False)
  zero = jnp.zeros_like(start)
  if with_prompt or blocks == 1:
    logits = model_lib.project(params, cfg, hidden[:, head:])
    return proposals(logits, zero, width, valid[:, head:]), cache, last
  lead = jnp.where(live, state.ready - state.cached, 0)  # write-only blocks per row
  narrow = (blocks - 1) * k

  def skip_one_block():  # every live row writes >= 1 block: <= blocks - 1 can commit
    first = lead * k
    at = jnp.minimum(first[:, None] + jnp.arange(narrow, dtype=jnp.int32)[None], width - 1)
    return proposals(model_lib.project(params, cfg, hidden, at), first, narrow,
                     jnp.take_along_axis(valid, at, axis=1))

  everything = lambda: proposals(model_lib.project(params, cfg, hidden), zero, width, valid)
  return jax.lax.cond(jnp.all((lead >= 1) | ~live), skip_one_block, everything), cache, last


def _canvas_step(params, cfg: ModelConfig, opts: D2FOptions, state: D2FState, rng: Array):
  """No cache: the full block-causal forward of prompt ++ appended blocks ([B, G] out)."""
  k, g = opts.block_length, opts.gen_length
  slot = jnp.arange(g, dtype=jnp.int32)
  answer_valid = (slot[None] < state.n_blocks[:, None] * k) & ~state.done[:, None]
  prompt_len = state.prompt_valid.sum(-1, dtype=jnp.int32)
  tokens = jnp.concatenate([state.prompt, state.response], axis=1)
  valid = jnp.concatenate([state.prompt_valid, answer_valid], axis=1)
  positions = jnp.concatenate([masks.left_pad_positions(state.prompt_valid),
                               prompt_len[:, None] + slot[None]], axis=1)
  ids = jnp.concatenate([jnp.zeros(state.prompt.shape[1], jnp.int32), 1 + slot // k])
  logits = Transformer(cfg).apply({"params": params}, tokens, block_ids=ids,
                                  positions=positions, valid=valid)[:, state.prompt.shape[1]:]
  slots = jnp.broadcast_to(slot[None], state.response.shape)
  return _proposals(logits, opts, state.traced, rng, slots) + (
      sampling.all_finite(logits, answer_valid),)


# ----------------------------------------------------------------------------- sharding

def _constrain(state: D2FState, mesh, rules) -> D2FState:
  """Pins per-row state to batch sharding (cache kv heads over `tensor` when they divide)."""
  if mesh is None:
    return state
  batch_axes = nn.logical_to_mesh_axes(("batch",), rules)[0]

  def by_batch(x):
    rows = PartitionSpec(batch_axes, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rows))

  rows = ("prompt", "prompt_valid", "response", "decided", "n_blocks", "cached", "ready",
          "block_steps", "eos_seen", "done", "forwards", "finite")
  state = state.replace(**{f: by_batch(getattr(state, f)) for f in rows})
  if state.last_logits is not None:
    state = state.replace(last_logits=by_batch(state.last_logits))
  cache = state.cache
  if cache is not None:
    heads = nn.logical_to_mesh_axes(("kv_heads",), rules)[0]
    names = () if heads is None else (heads if isinstance(heads, tuple) else (heads,))
    if cache.k.shape[3] % int(np.prod([mesh.shape[a] for a in names])):
      heads = None
    kv = NamedSharding(mesh, PartitionSpec(None, batch_axes, None, heads, None))
    cache = cache.replace(k=jax.lax.with_sharding_constraint(cache.k, kv),
                          v=jax.lax.with_sharding_constraint(cache.v, kv),
                          block_ids=by_batch(cache.block_ids), length=by_batch(cache.length))
  return state.replace(cache=cache)


# ----------------------------------------------------------------------------- the loop

def _init(params, prompt, valid, rng, traced, *, cfg: ModelConfig, opts: D2FOptions, mesh=None,
          rules=mesh_lib.DEFAULT_RULES) -> D2FState:
  b, p = prompt.shape
  g, n = opts.gen_length, opts.num_blocks
  prompt = prompt.astype(jnp.int32)
  zeros = jnp.zeros((b,), jnp.int32)
  cache = kvc.init_cache(cfg, b, p + g) if opts.use_cache else None
  last = jnp.zeros((b, cfg.vocab_size), jnp.float32) if opts.use_cache and cfg.shift_logits \
      else None
  state = D2FState(
      prompt=prompt, prompt_valid=valid, response=jnp.full((b, g), opts.mask_id, jnp.int32),
      decided=jnp.zeros((b, g), bool), n_blocks=zeros, cached=zeros, ready=zeros,
      block_steps=jnp.zeros((b, n), jnp.int32), eos_seen=jnp.zeros((b,), bool),
      done=jnp.zeros((b,), bool), forwards=zeros, steps=jnp.zeros((), jnp.int32),
      forward_slots=jnp.zeros((), jnp.int32), rng=rng, traced=traced,
      finite=jnp.ones((b,), bool), cache=cache, last_logits=last)
  state = _constrain(ds.admit(opts, state), mesh, rules)
  return _step(params, state, cfg=cfg, opts=opts, mesh=mesh, rules=rules, first=True)


def _step(params, state: D2FState, *, cfg: ModelConfig, opts: D2FOptions, mesh=None,
          rules=mesh_lib.DEFAULT_RULES, first: bool = False) -> D2FState:
  """One loop step: one forward, commits, cursor moves, at most one block appended per row.

  `first` marks the first forward, which also writes the prompt into the (empty) cache.
  Only block 0 exists then, so its window is one block.
  """
  if sampling.is_row_keys(state.rng):  # per-row keys: the row's own forward count
    rng = sampling.row_step_keys(state.rng, state.forwards)
  else:
    rng = jax.random.fold_in(state.rng, state.steps)
  cache, last = state.cache, state.last_logits
  k = opts.block_length
  if not opts.use_cache:
    x0, prob, score, finite = _canvas_step(params, cfg, opts, state, rng)
    width = state.prompt.shape[1] + opts.gen_length
  elif first:
    (x0, prob, score, finite), cache, last = _window_step(params, cfg, opts, state, 1, rng,
                                                          with_prompt=True)
    width = state.prompt.shape[1] + k
  else:
    windows = opts.window_blocks
    run = lambda blocks, s: _window_step(params, cfg, opts, s, blocks, rng)
    if len(windows) == 1:
      (x0, prob, score, finite), cache, last = run(windows[0], state)
      width = windows[0] * k
    else:  # the smallest window that holds every live row's uncached blocks
      span = jnp.max(jnp.where(state.done, 0, state.n_blocks - state.cached))
      # The first window >= span (a count, not a searchsorted loop), the widest past it.
      index = jnp.minimum(jnp.sum(jnp.asarray(windows, jnp.int32) < span, dtype=jnp.int32),
                          len(windows) - 1)
      (x0, prob, score, finite), cache, last = jax.lax.switch(
          index, [functools.partial(run, w) for w in windows], state)
      width = jnp.asarray(windows, jnp.int32)[index] * k
  commit = ds.commit_mask(opts, state, prob, score)
  finite = state.finite & (finite | state.done)
  state = ds.apply_commits(opts, state, commit, x0).replace(
      cache=cache, last_logits=last, finite=finite,
      forward_slots=state.forward_slots + width)
  return _constrain(ds.admit(opts, state), mesh, rules)


def _keep_going(opts: D2FOptions, state: D2FState) -> Array:
  # Every live row commits at least one token per step, so G steps always suffice.
  return (state.steps < opts.gen_length) & ~jnp.all(state.done)


def output(opts: D2FOptions, state: D2FState) -> base.DecodeOutput:
  """The decode record: tokens cut at the first stop, lengths, NFE (= steps)."""
  tokens, lengths, _ = base.finalize(state.response, state.decided, opts.stop_ids,
                                     opts.pad_id)
  return base.decode_output(tokens, lengths, state.steps, state.steps,
                            state.decided.sum(1, dtype=jnp.int32), state.done, state.finite,
                            opts.pad_id)


# ----------------------------------------------------------------------------- the decoder

def block_diffusion_options(cfg: ModelConfig, *, gen_length: int = base.GEN_LENGTH,
                            block_length: int | None = None, steps_per_block=None,
                            temperature: float = 0.0, remasking: str = "probability",
                            use_cache: bool = True, block_size=None, unmasking: str = "even",
                            entropy_bound: float = unmasking_lib.DEFAULT_ENTROPY_BOUND,
                            batch_invariant: bool = False):
  """`block_diffusion_generate`'s settings as (D2FOptions, Thresholds): D2F with one block in
  flight, no threshold (tau_conf = inf) and the count rule with the `unmasking` schedule."""
  return d2f_options(
      cfg, gen_length=gen_length, block_length=block_length, block_size=block_size,
      max_active_blocks=1, tau_add=1.0, tau_act=1.0, tau_conf=math.inf, rule="count",
      steps_per_block=steps_per_block, temperature=temperature, remasking=remasking,
      use_cache=use_cache, unmasking=unmasking, entropy_bound=entropy_bound,
      batch_invariant=batch_invariant)


@dataclasses.dataclass(frozen=True)
class D2FDecoder(protocol.Decoder):
  """D2F's pipelined block decoding (`opts` is the `D2FOptions`; the traced part the
  `Thresholds`). On a mesh (`on_mesh`) it pins its state's rows to the batch sharding."""
  mesh: object = None
  rules: object = None

  init_forwards = True
  attention = "block_causal"

  @classmethod
  def functions(cls):
    """(the settings builder, the `*_generate` function whose keywords are the options)."""
    return d2f_options, d2f_generate

  @classmethod
  def option_names(cls) -> tuple[str, ...]:
    return _keywords(cls.functions()[1])

  @classmethod
  def per_row_options(cls, traced) -> tuple[str, ...]:
    # The traced `Thresholds` hold tau_add / tau_act as counts: name the options they hold.
    return tuple(n for n in ("temperature", "tau_add", "tau_act", "tau_conf", "entropy_bound")
                 if n in cls.option_names())

  @classmethod
  def plan(cls, cfg: ModelConfig, **options) -> protocol.Plan:
    opts, traced = cls.functions()[0](cfg, **options)
    return protocol.Plan(cls(cfg, opts), traced)

  @classmethod
  def run_defaults(cls, block: int) -> dict:
    return {"block_length": block}

  @property
  def _kw(self) -> dict:
    kw = dict(cfg=self.cfg, opts=self.opts)
    return kw if self.mesh is None else dict(kw, mesh=self.mesh, rules=self.rules)

  def check(self, tokens, valid) -> None:
    base.check_prompts(self.cfg, tokens, valid, self.opts.gen_length,
                       block_length=self.opts.block_length)

  def init(self, params, tokens, valid, rng, traced, row_inputs=None):
    return _init(params, tokens, valid, rng, traced, **self._kw)

  def step(self, params, state):
    return _step(params, state, **self._kw)

  def running(self, state):
    return _keep_going(self.opts, state)

  def view(self, state):
    return state.response, state.decided

  def output(self, state):
    return output(self.opts, state)

  def stats(self, state):
    """The final state without its cache: per-row `forwards`, `block_steps`, cursors."""
    return state.replace(cache=None, last_logits=None)

  def with_offset(self, traced, offset):
    return traced.replace(row_offset=offset)

  def pad(self, state, prompt_len):
    # Left-pad the kept prompt; the cache (prompt and response in order) gets empty slots.
    extra = prompt_len - state.prompt.shape[1]
    state = state.replace(prompt=protocol.pad_axis(state.prompt, 1, extra, 0, self.opts.pad_id),
                          prompt_valid=protocol.pad_axis(state.prompt_valid, 1, extra, 0, False))
    if state.cache is not None:
      state = state.replace(cache=protocol.append_cache_slots(state.cache,
                                                              prompt_len + self.gen_length))
    return state

  def on_mesh(self, mesh, rules) -> "D2FDecoder":
    return dataclasses.replace(self, mesh=mesh, rules=rules)


class BlockDiffusionDecoder(D2FDecoder):
  """Block diffusion: D2F with one block in flight and the count rule."""

  @classmethod
  def functions(cls):
    return block_diffusion_options, block_diffusion_generate

  @classmethod
  def run_defaults(cls, block: int) -> dict:
    return {"block_length": block, "steps_per_block": block}


@functools.lru_cache(maxsize=None)  # read on every generate call's option check
def _keywords(fn) -> tuple[str, ...]:
  """The decode options of a `*_generate` function: its keyword-only parameters, less those
  the drivers own (placement, return values, non-finite handling, the old block_size)."""
  return tuple(p.name for p in inspect.signature(fn).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _DRIVER_KEYWORDS)


_DRIVER_KEYWORDS = ("mesh", "rules", "return_state", "on_nonfinite", "block_size")


# ----------------------------------------------------------------------------- public API

def d2f_generate(params, cfg: ModelConfig, prompt_tokens, prompt_valid=None, rng=None, *,
                 gen_length: int = base.GEN_LENGTH, block_length: int | None = None,
                 tau_add: float = 0.1, tau_act: float = 0.95, tau_conf: float = 0.9,
                 max_active_blocks: int | None = None, temperature: float = 0.0,
                 remasking: str = "probability", use_cache: bool = True,
                 window: str = "fitted", batch_invariant: bool = False,
                 on_nonfinite: str = "raise", mesh=None, rules=None,
                 return_state: bool = False, block_size=None):
  """D2F pipelined parallel decoding of a left-padded prompt batch.

  Args:
    params: model parameters (a block-causal D2F student, e.g. LLaDA/Dream + D2F LoRA).
    prompt_tokens, prompt_valid: [B, P] left-padded prompts (`base.pad_prompts`); valid
      None means no padding.
    rng: PRNG key (used when temperature > 0 or remasking="random"), or [B] keys, one per
      row (a row's noise then depends only on its key; docs/decoders.md).
    gen_length: G response slots, a multiple of block_length.
    block_length: k (default 32, capped at G). tau_add, tau_act: decoded fractions that
      append / fully activate a block. tau_conf: commit threshold on the token probability.
    max_active_blocks: bound on blocks in flight (None: no bound, like the reference).
    temperature, remasking: token sampling and the ranking of the top-1 fallback.
    use_cache: False recomputes the whole block-causal canvas every step (same tokens).
    window: "fitted" (default) forwards each step only the blocks still in flight, from a
      bucketed set of widths; "full" the widest window the settings allow (same tokens;
      kept for side-by-side benchmarks).
    batch_invariant: rank on `sampling.RANK_GRID`, so a row's tokens are the same alone, in
      a batch and on a mesh; False (default) ranks the exact scores as the D2F reference
      does (ties to the lowest slot).
    on_nonfinite: "raise" (NonFiniteLogitsError naming rows whose logits were NaN/inf) or
      "flag" (return them with `finite` False, lengths 0).
    mesh, rules: decode data-parallel over the batch and tensor-parallel over the params
      on a `parallel.mesh` mesh (same tokens as one device).
    return_state: also return the final `D2FState` (without its cache): per-row
      `forwards`, `block_steps`, cursors.
    block_size: the old name of block_length; passing it raises a ValueError saying so.
  Returns:
    base.DecodeOutput (and the state when return_state).
  """
  return protocol.decode_batch(
      D2FDecoder, params, cfg, prompt_tokens, prompt_valid, rng, on_nonfinite=on_nonfinite,
      with_stats=return_state, mesh=mesh, rules=rules, gen_length=gen_length,
      block_length=block_length, block_size=block_size, max_active_blocks=max_active_blocks,
      tau_add=tau_add, tau_act=tau_act, tau_conf=tau_conf, temperature=temperature,
      remasking=remasking, use_cache=use_cache, window=window,
      batch_invariant=batch_invariant)


def block_diffusion_generate(params, cfg: ModelConfig, prompt_tokens, prompt_valid=None,
                             rng=None, *, gen_length: int = base.GEN_LENGTH,
                             block_length: int | None = None,
                             steps_per_block: int | None = None, temperature: float = 0.0,
                             remasking: str = "probability", use_cache: bool = True,
                             on_nonfinite: str = "raise", mesh=None, rules=None,
                             return_state: bool = False, block_size=None,
                             unmasking: str = "even",
                             entropy_bound: float = unmasking_lib.DEFAULT_ENTROPY_BOUND,
                             batch_invariant: bool = False):
  """Block diffusion (BD3-style semi-AR) decoding: the one-block special case of D2F.

  One block at a time; within a block of k masks and s = steps_per_block steps (default k:
  one token per step), step i commits the `unmasking` schedule's count of most confident
  masked slots: "even" (default, LLaDA's: k // s, +1 for i < k % s) or "cosine"
  (MaskGIT's). A finished block is written to the cache by the next block's first forward
  (the first forward also writes the prompt), so `nfe = N * s` exactly. With
  unmasking="entropy_bound" each step commits the longest prefix of the ranked masked slots
  whose entropies sum, less their largest, to at most `entropy_bound` (at least one): the
  steps per block are dynamic (at most k) and nfe counts the forwards actually run
  (`unmasking.py` states each rule exactly). Other arguments as in `d2f_generate`.
  """
  return protocol.decode_batch(
      BlockDiffusionDecoder, params, cfg, prompt_tokens, prompt_valid, rng,
      on_nonfinite=on_nonfinite, with_stats=return_state, mesh=mesh, rules=rules,
      gen_length=gen_length, block_length=block_length, block_size=block_size,
      steps_per_block=steps_per_block, temperature=temperature, remasking=remasking,
      use_cache=use_cache, unmasking=unmasking, entropy_bound=entropy_bound,
      batch_invariant=batch_invariant)
