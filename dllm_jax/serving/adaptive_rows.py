"""Task-adaptive decoding served by the engine: per row and round, parallel, verified or AR.

Shape legend: B slots, A admitted rows, p this admission's prompt bucket, P the largest,
G gen_length, k draft_length.

    engine = Engine(target_params, target_cfg, methods="adaptive",
                    options=dict(drafter_params=d_params, drafter_cfg=d_cfg, draft_length=8,
                                 task_modes={"sum": "ar", "sort": "parallel"}, gen_length=64),
                    slots=8)
    engine.submit(prompt, options=dict(task="sum"), seed=3)

A lane serves one drafter, one rule and one tag map: `drafter_params` / `drafter_cfg` are
lane options (given once; a request naming them is refused), and the thresholds and
`task_modes` belong to the lane's option set like any other option. The thresholds stay
traced (the lane's traced, held in the state). A request's `task` is a row option: the tag
it names (one of the lane's `task_modes`, or none) is turned into the mode it forces
(`AdaptiveOptions.forced_modes`) and handed to the row's init as its `row_inputs` entry, so
one lane serves every task of the mix.

`decoding.adaptive` keeps every cursor per row: the committed count `n`, both caches'
lengths, the mode, the acceptance counts and trust streak, the rounds the row was live and
the forwards a one-row decode of it counts; with [B] keys (`serving.request_keys`) a row's
round-i draws come from fold_in(rng[b], i) (`speculative.round_keys`). So a row admitted
later decodes as it would alone, whatever modes the other rows are in: a model's forward
runs for the whole batch when any live row needs it, and a row reads only its own slots.
Admission runs round 0 (the drafter's first block, the modes, the target's verifying
prefill); a step is one round. The loop's all-AR second phase (`_generate`) is the same
computation, so the engine keeps the general round. The drafter lane option, the two caches
and their re-padding are speculative's (`speculative_rows.DraftedRows`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dllm_jax.decoding import adaptive, base
from dllm_jax.decoding import speculative as spec
from dllm_jax.models.config import ModelConfig
from dllm_jax.serving import rows
from dllm_jax.serving import speculative_rows


@dataclasses.dataclass(frozen=True)
class AdaptiveStatic:
  """The lane's options and the drafter's config (its params are the lane's:
  `DraftedRows.lane_params`). Split, `opts` holds canonical thresholds (the lane's traced
  options carry the real ones) and no tag map (`row_input` reads the unsplit one)."""
  opts: adaptive.AdaptiveOptions
  drafter_cfg: ModelConfig

  @property
  def gen_length(self) -> int:
    return self.opts.gen_length


class AdaptiveRows(speculative_rows.DraftedRows):
  """Adaptive rows: round 0 (draft, modes, verifying prefill) admits a row; one round a
  step."""

  row_options = ("task",)
  # The tag map is the lane's (its split static part drops it; `row_input` reads it).
  lane_options = speculative_rows.DraftedRows.lane_options + ("task_modes",)

  def __init__(self):
    super().__init__(method="", needs_mask=False)

  def make_options(self, cfg: ModelConfig, options: dict) -> AdaptiveStatic:
    if "tasks" in options:
      raise ValueError("tasks= is generate's list of one tag per prompt; a request names its "
                       "own tag with task=<tag> (one of the lane's task_modes).")
    options = rows.invariant_options(self.method, options)
    opts = base.make_options(adaptive.AdaptiveOptions, {
        k: v for k, v in options.items() if k not in ("drafter_params", "drafter_cfg")})
    spec.check_drafter(cfg, options.get("drafter_params"), options.get("drafter_cfg"),
                       self.method, *adaptive.DRAFTER)
    return AdaptiveStatic(opts, options["drafter_cfg"])

  def row_input(self, opts: AdaptiveStatic, options: dict) -> int:
    """The mode code the request's `task` forces (-1: none; the rule decides)."""
    return int(opts.opts.forced_modes([options.get("task")], 1)[0])

  def drafter_capacity(self, static: AdaptiveStatic, prompt_len: int) -> int:
    return adaptive.drafter_capacity(prompt_len, static.opts)

  def split(self, opts: AdaptiveStatic):
    static, traced = opts.opts.split()
    return AdaptiveStatic(static, opts.drafter_cfg), traced

  def mask_id(self, cfg: ModelConfig, static: AdaptiveStatic):
    return static.drafter_cfg.mask_token_id  # the diffusion drafter's blank

  def check(self, cfg, tokens, valid, opts: AdaptiveStatic):
    adaptive.AdaptiveDecoder(cfg, opts.opts, opts.drafter_cfg).check(tokens, valid)

  def init(self, params, cfg, static: AdaptiveStatic, traced, tokens, valid, keys, mesh=None,
           rules=None, row_inputs=None):
    tparams, dparams = params
    forced = (jnp.full((tokens.shape[0],), -1, jnp.int32) if row_inputs is None
              else jnp.asarray(row_inputs, jnp.int32))
    return adaptive._init(tparams, dparams, tokens, valid, forced, keys, traced, tcfg=cfg,
                          dcfg=static.drafter_cfg, opts=static.opts)

  def step(self, params, cfg, static: AdaptiveStatic, state, mesh=None, rules=None):
    tparams, dparams = params
    return adaptive._step(tparams, dparams, state, tcfg=cfg,
                          dcfg=static.drafter_cfg, opts=static.opts)

  def with_traced(self, state, traced):
    return state.replace(traced=traced)

  def progress(self, static: AdaptiveStatic, state):
    # response[:n] is committed (final); nfe: the forwards a one-row decode of the row counts.
    return state.response, state.n, state.done, state.finite, state.forwards


rows.register(adaptive.AdaptiveDecoder, AdaptiveRows())
