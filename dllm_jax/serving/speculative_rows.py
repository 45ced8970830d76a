"""Speculative decoding served by the engine: a drafter proposes, the AR target verifies, per row.

Shape legend: B slots, A admitted rows, p this admission's prompt bucket, P the largest,
G gen_length, k draft_length, L layers, K kv heads, Dh head dim.

    engine = Engine(target_params, target_cfg, methods="speculative",
                    options=dict(drafter_params=d_params, drafter_cfg=d_cfg, drafter="d2f",
                                 draft_length=4, gen_length=64), slots=8)

A lane serves one drafter: `drafter_params` / `drafter_cfg` are lane options (given once, to
the engine; a request that names them is refused) and the params ride beside the target's
as the lane's params `(target_params, drafter_params)`, traced arguments of the lane's
jitted programs, never jit-static. The target's sampling (temperature, top_k, top_p) is per
row (the state's `traced`, [B] each: `speculative.sampling_options`), so requests with
their own values share a sampling-capable lane; every other option (drafter kind,
draft_length, draft_steps) is fixed per lane.

`decoding.speculative` keeps every cursor per row: the committed count `n`, both K/V caches'
lengths (target [L, B, P + G, K, Dh]; drafter [L, B, max(P + G, 2k + 1), K, Dh]), the AR
drafter's `pending`, and with [B] keys (`serving.request_keys`) a row's round-i draws come
from fold_in(rng[b], i) (`speculative.round_keys`). So a row admitted later decodes as it
would alone. Admission runs the method's round 0 (the drafter's first block and the
target's verifying prefill over prompt ++ drafts) for the admitted rows; a step is one
round for every slot (drafter forwards, one target forward, per-row acceptance and
rollback of both caches by `kv_cache.truncate`); finished and retired rows stay `done`
and commit nothing.

`pad` turns an admission built at bucket p into one built at P: both caches hold the prompt
in their first p slots and each row's response after them (speculative's diffusion drafter
reads the prompt width as the target cache's capacity - G), so P - p empty slots (NO_KEY)
are prepended to both caches and their lengths move by P - p; the drafter cache is cut
back to its capacity at P (its trailing slots are never written). `DraftedRows` holds what
speculative shares with adaptive decoding (`adaptive_rows`): the drafter lane option, the
two caches, their re-padding and window check.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base
from dllm_jax.decoding import speculative as spec
from dllm_jax.models import transformer
from dllm_jax.models.config import ModelConfig
from dllm_jax.parallel import sharding
from dllm_jax.serving import rows


@dataclasses.dataclass(frozen=True)
class SpeculativeStatic:
  """The lane's jit-static part: speculative's options and the drafter's config (the
  drafter's params are the lane's, not here: `DraftedRows.lane_params`)."""
  opts: spec.SpeculativeOptions
  drafter_cfg: ModelConfig

  @property
  def gen_length(self) -> int:
    return self.opts.gen_length

  @property
  def drafter_forwards(self) -> int:
    """Drafter forwards per round: k for an AR drafter, `steps` for a diffusion one."""
    return self.opts.draft_length if self.opts.drafter == "ar" else self.opts.steps


class DraftedRows(rows.RowDecoder):
  """Rows of an AR target with a drafter beside it (speculative, adaptive): the drafter is a
  lane option, the lane's params are (target params, drafter params), and each row has a
  target cache `tcache` ([L, B, P + G, K, Dh]) and a drafter cache `dcache`, both holding
  the prompt in their first p slots. The static part has `opts` and `drafter_cfg`;
  subclasses say how many slots the drafter's cache needs (`drafter_capacity`)."""

  lane_options = ("drafter_params", "drafter_cfg")
  cache_fields = ("tcache", "dcache")

  def drafter_capacity(self, static, prompt_len: int) -> int:
    raise NotImplementedError

  def lane_params(self, params, cfg: ModelConfig, static, options: dict, mesh, rules):
    drafter = options["drafter_params"]
    if mesh is not None:
      drafter = sharding.place_params(drafter, mesh, rules, abstract=functools.partial(
          transformer.abstract_params, static.drafter_cfg))
    return params, drafter

  def gen_length(self, static) -> int:
    return static.opts.gen_length

  def check_window(self, cfg: ModelConfig, static, prompt_len: int) -> None:
    opts, dcfg = static.opts, static.drafter_cfg
    base.check_window(cfg, prompt_len, opts.gen_length)
    base.check_window(dcfg, prompt_len, opts.gen_length)
    spec.check_drafter_capacity(dcfg, opts, self.drafter_capacity(static, prompt_len))

  def pad(self, cfg, static, state, prompt_len: int):
    g = static.opts.gen_length
    extra = prompt_len - (state.tcache.capacity - g)
    return state.replace(
        tcache=rows.prepend_cache_slots(state.tcache, extra, prompt_len + g),
        dcache=rows.prepend_cache_slots(state.dcache, extra,
                                        self.drafter_capacity(static, prompt_len)))

class SpeculativeRows(DraftedRows):
  """Speculative rows: round 0 (draft + verifying prefill) admits a row; one round a step."""

  sampling_options = ("temperature",)

  def __init__(self):
    super().__init__(method="", needs_mask=False)

  def make_options(self, cfg: ModelConfig, options: dict) -> SpeculativeStatic:
    decoder = spec.SpeculativeDecoder.plan(
        cfg, **rows.invariant_options(self.method, options)).decoder
    return SpeculativeStatic(decoder.opts, decoder.drafter_cfg)

  def drafter_capacity(self, static: SpeculativeStatic, prompt_len: int) -> int:
    return spec._drafter_capacity(prompt_len, static.opts)

  def split(self, opts: SpeculativeStatic):
    # The target's sampling is traced per row (temperature 0 keeps its own program, the
    # greedy rule: `base.ZERO_IS_STATIC`); every other option is static.
    static, traced = base.split_options(opts.opts, {"temperature": 0.0, "top_k": 0,
                                                    "top_p": 1.0}, {"top_k": np.int32})
    return SpeculativeStatic(static, opts.drafter_cfg), traced

  def mask_id(self, cfg: ModelConfig, static: SpeculativeStatic):
    # A diffusion drafter reads [MASK] as a blank; the AR target has no such id.
    return None if static.opts.drafter == "ar" else static.drafter_cfg.mask_token_id

  def check(self, cfg, tokens, valid, opts: SpeculativeStatic):
    spec.SpeculativeDecoder(cfg, opts.opts, opts.drafter_cfg).check(tokens, valid)

  def init(self, params, cfg, static: SpeculativeStatic, traced, tokens, valid, keys, mesh=None,
           rules=None):
    tparams, dparams = params
    return spec._init(tparams, dparams, tokens, valid, keys, tcfg=cfg,
                      dcfg=static.drafter_cfg, opts=static.opts, traced=traced)

  def step(self, params, cfg, static: SpeculativeStatic, state, mesh=None, rules=None):
    tparams, dparams = params
    return spec._step(tparams, dparams, state, tcfg=cfg, dcfg=static.drafter_cfg,
                      opts=static.opts)

  def with_traced(self, state, traced):
    return state.replace(traced=traced)

  def progress(self, static: SpeculativeStatic, state):
    # response[:n] is committed (final); a row's forwards: its rounds, each one target
    # forward and the drafter's forwards (as `speculative_generate` counts a one-row batch).
    nfe = state.rounds * (1 + static.drafter_forwards)
    return state.response, state.n, state.done, state.finite, nfe


rows.register(spec.SpeculativeDecoder, SpeculativeRows())
