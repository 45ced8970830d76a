"""Per-row block bookkeeping of pipelined block decoding (D2F), as pure array functions.

Shape legend: B batch, P padded prompt length, G = N * k response slots, N blocks of k slots.

How it works, in full: docs/decoders.md, `decoding.d2f_state`.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding import base, sampling, unmasking
from dllm_jax.models import kv_cache as kvc

Array = jnp.ndarray
COMMIT_RULES = ("threshold", "count")
WINDOW_POLICIES = ("fitted", "full")


def bucket_sizes(cap: int) -> tuple[int, ...]:
  """Window widths in blocks, 1 .. cap: every size up to 4, then about x1.5 apart (6, 8, 12,
  16, 24, ...), and cap itself. The smallest bucket that holds n blocks is at most 1.5 n."""
  sizes, n = [], 1
  while n < cap:
    sizes.append(n)
    n = n + 1 if n < 4 else (n * 3 // 2 if (n & (n - 1)) == 0 else n * 4 // 3)
  return tuple(sizes) + (cap,)


def fraction_to_count(tau: float, block_length: int) -> int:
  """Smallest decoded-token count c with c / block_length >= tau (float64, like the
  reference)."""
  return next(c for c in range(block_length + 1) if c / block_length >= tau)


@dataclasses.dataclass(frozen=True)
class D2FOptions:
  """The static (hashable) part of a decode: everything that shapes the compiled loop.

  Attributes:
    block_length: k, slots per block.
    num_blocks: N = G // k.
    max_active: most blocks in flight (active) at once; N means no bound (the reference).
    rule: "threshold" (D2F: probability above tau_conf, plus the top-1 of a fully activated
      block) or "count" (block diffusion: block step i commits the `unmasking` schedule's
      count, e.g. k // s, +1 for i < k % s).
    steps_per_block: s of the "count" rule (0 for "threshold"; k, the bound, for
      unmasking="entropy_bound").
    remasking: confidence kind that ranks positions (sampling.CONFIDENCE_KINDS); the
      threshold itself always reads the probability of the proposed token.
    use_cache: exact K/V cache of final blocks; False recomputes the whole canvas per step.
    window: "fitted" forwards, per step, the smallest bucketed window that holds every
      row's uncached blocks (`bucket_sizes`); "full" forwards the widest window the
      settings allow (A blocks, or A + 1 when some row must write a final block).
    mask_id, stop_ids, pad_id: special ids from the model config.
    unmasking: the count rule's schedule, "even", "cosine" or "entropy_bound"
      (`unmasking.py`); "even" for the threshold rule.
    sampled: temperature > 0 (its value is traced, `Thresholds.temperature`); False compiles
      the greedy proposal (argmax) with no sampling code in the loop.
    batch_invariant: rank on `sampling.RANK_GRID` (a row's tokens are the same alone, in a
      batch and on a mesh); False ranks the exact scores, ties to the lowest slot, as the
      D2F reference's argmax does (`sampling` module doc).
  """
  block_length: int
  num_blocks: int
  max_active: int
  rule: str
  steps_per_block: int
  remasking: str
  use_cache: bool
  mask_id: int
  stop_ids: tuple[int, ...]
  pad_id: int
  window: str = "fitted"
  unmasking: str = "even"
  sampled: bool = False
  batch_invariant: bool = False

  @property
  def gen_length(self) -> int:
    return self.block_length * self.num_blocks

  @property
  def window_blocks(self) -> tuple[int, ...]:
    """Forward window widths in blocks, ascending; each step runs the smallest one that
    holds its widest row's span `n_blocks - cached` (`lax.switch`).

    In flight are at most `max_active` active blocks plus the final blocks still to be
    written; those were active one step earlier, so together with the active ones they
    number at most `max_active`, plus the one block appended this step: A + 1 (capped at
    N). "full" keeps only A and A + 1; "fitted" every bucket up to A + 1.
    """
    small = min(self.max_active, self.num_blocks)
    large = min(self.max_active + 1, self.num_blocks)
    if self.window == "fitted":
      return bucket_sizes(large)
    return (small,) if small == large else (small, large)


@flax.struct.dataclass
class Thresholds:
  """The traced part of a decode: changing these never recompiles (sweep them freely).

  Attributes:
    add_count: [] int32, a block is appended once the last block has this many decided
      tokens (tau_add as a count).
    act_count: [] int32, a block is fully activated once its predecessor has this many
      (tau_act as a count).
    tau_conf: [] float32, the commit threshold on the proposal's probability.
    temperature: [] float32, 0 is greedy (exactly: argmax); else Gumbel-max sampling.
    row_offset: [] int32, the global index of row 0 (a data-parallel shard of a batch
      passes its first row's): row r draws its random keys as row `row_offset + r`.
    entropy_bound: [] float32, the count rule's entropy bound (unmasking="entropy_bound").
  """
  add_count: Array
  act_count: Array
  tau_conf: Array
  temperature: Array
  row_offset: Array = 0
  entropy_bound: Array = unmasking.DEFAULT_ENTROPY_BOUND

  @classmethod
  def create(cls, block_length: int, tau_add: float, tau_act: float, tau_conf: float,
             temperature: float = 0.0,
             entropy_bound: float = unmasking.DEFAULT_ENTROPY_BOUND):
    # NumPy scalars: the jitted decoder transfers them with its other arguments.
    return cls(add_count=np.asarray(fraction_to_count(tau_add, block_length), np.int32),
               act_count=np.asarray(fraction_to_count(tau_act, block_length), np.int32),
               tau_conf=np.asarray(tau_conf, np.float32),
               temperature=np.asarray(temperature, np.float32),
               row_offset=np.asarray(0, np.int32),
               entropy_bound=np.asarray(entropy_bound, np.float32))


@flax.struct.dataclass
class D2FState:
  """Decode state, one row per prompt; every field has a static shape.

  Attributes:
    prompt, prompt_valid: [B, P] left-padded prompt and its real-token mask.
    response: [B, G] int32 tokens; the mask id where undecided.
    decided: [B, G] bool.
    n_blocks, cached, ready: [B] int32 block cursors (docs/decoders.md).
    block_steps: [B, N] int32 forwards in which each block had masked slots to decode.
    eos_seen: [B] bool a stop token was committed (no block is appended after it).
    done: [B] bool the row needs no more forwards.
    forwards: [B] int32 loop forwards in which the row was live.
    steps: [] int32 loop iterations (one batched forward each).
    forward_slots: [] int32 slots the forwards carried, summed over steps (per row of the
      batch; the first forward's prompt included): the window policy's cost measure.
    rng: PRNG key.
    traced: the decode's Thresholds.
    finite: [B] bool every forward gave the row finite logits (over its valid slots).
    cache: KVCache of P + G slots, or None without a cache.
    last_logits: [B, V] float32 model output at the last cached slot, which predicts the
      slot after it for models with shifted logits (Dream); None otherwise.
  """
  prompt: Array
  prompt_valid: Array
  response: Array
  decided: Array
  n_blocks: Array
  cached: Array
  ready: Array
  block_steps: Array
  eos_seen: Array
  done: Array
  forwards: Array
  steps: Array
  forward_slots: Array
  rng: Array
  traced: Thresholds
  finite: Array
  cache: kvc.KVCache | None
  last_logits: Array | None


def block_counts(opts: D2FOptions, decided: Array) -> Array:
  """[B, G] bool -> [B, N] int32 decided tokens per block."""
  b = decided.shape[0]
  return decided.reshape(b, opts.num_blocks, opts.block_length).sum(-1, dtype=jnp.int32)


def admit(opts: D2FOptions, state: D2FState) -> D2FState:
  """Appends at most one block per row, then marks rows with nothing left to decode done.

  A block is appended while fewer than N exist, no stop token was committed, fewer than
  `max_active` blocks are in flight and the last block (the prompt when there is none) has
  `traced.add_count` decided tokens. A row is done when no block is active (nothing can be
  appended any more: the last block is final, so only N or a stop token prevents it), or
  as soon as its first decided stop token has only decided tokens before it: the response
  up to that stop can no longer change, so its remaining forwards would be wasted.
  """
  counts = block_counts(opts, state.decided)
  last = jnp.clip(state.n_blocks - 1, 0, opts.num_blocks - 1)
  last_count = jnp.take_along_axis(counts, last[:, None], axis=1)[:, 0]
  last_count = jnp.where(state.n_blocks == 0, opts.block_length, last_count)
  grow = (~state.done & (state.n_blocks < opts.num_blocks) & ~state.eos_seen
          & (state.n_blocks - state.ready < opts.max_active)
          & (last_count >= state.traced.add_count))
  n_blocks = state.n_blocks + grow.astype(jnp.int32)
  settled = base.first_stop_decided(state.response, state.decided, opts.stop_ids)
  done = state.done | (state.ready >= n_blocks) | settled
  return state.replace(n_blocks=n_blocks, done=done)


def commit_mask(opts: D2FOptions, state: D2FState, prob: Array, score: Array) -> Array:
  """[B, G] bool: the slots this step decides, given per-slot proposals' gate value and
  ranking score ([B, G] float32; slots outside the forward window may hold anything). The
  gate is the proposal's probability (threshold rule) or its predictive entropy (count rule
  with unmasking="entropy_bound"; unused by the other count schedules)."""
  b, k, n = state.decided.shape[0], opts.block_length, opts.num_blocks
  block = jnp.arange(opts.gen_length, dtype=jnp.int32) // k
  active = ((block[None] >= state.ready[:, None]) & (block[None] < state.n_blocks[:, None])
            & ~state.done[:, None])
  cand = (active & ~state.decided).reshape(b, n, k)
  score = jnp.where(cand, score.reshape(b, n, k), sampling.NEG_INF)
  if opts.rule == "threshold":
    counts = block_counts(opts, state.decided)
    before = jnp.concatenate([jnp.full((b, 1), k, jnp.int32), counts[:, :-1]], axis=1)
    full = before >= sampling.by_row(state.traced.act_count, 2)  # [B, N]
    above = cand & (prob.reshape(b, n, k) > sampling.by_row(state.traced.tau_conf, 3))
    best = sampling.best_mask(score, cand, invariant=opts.batch_invariant)
    fallback = full & ~jnp.any(above, -1)
    commit = above | (best & fallback[..., None])
  elif opts.rule == "count" and opts.unmasking == "entropy_bound":
    commit = unmasking.entropy_bound_mask(
        score.reshape(b * n, k), prob.reshape(b * n, k), cand.reshape(b * n, k),
        _per_block(state.traced.entropy_bound, n), invariant=opts.batch_invariant
    ).reshape(b, n, k)
  elif opts.rule == "count":
    s = opts.steps_per_block
    per_step = jnp.asarray(unmasking.counts(opts.unmasking, k, s))         # [s]
    quota = per_step[jnp.minimum(state.block_steps, s - 1)]                # [B, N]
    commit = sampling.top_k_mask(score.reshape(b * n, k), quota.reshape(b * n),
                                 invariant=opts.batch_invariant)
    commit = commit.reshape(b, n, k) & cand
  else:
    raise ValueError(f"Unknown commit rule {opts.rule!r}; use one of {COMMIT_RULES}.")
  return commit.reshape(b, opts.gen_length)


def _per_block(value, n: int):
  """A traced option for the B * N rows of blocks: a [B] value (one per row) repeated per
  block; a shared one as is."""
  return jnp.repeat(value, n) if jnp.ndim(value) == 1 else value


def apply_commits(opts: D2FOptions, state: D2FState, commit: Array, x0: Array) -> D2FState:
  """Writes committed tokens and moves the block cursors after one forward.

  The forward wrote blocks [cached, ready) into the cache, so `cached` becomes `ready`;
  `ready` then advances over every block that is now fully decided (a chain of them may
  become final at once, as in the reference's front-to-back scan).
  """
  b, k, n = state.decided.shape[0], opts.block_length, opts.num_blocks
  live = ~state.done
  response = jnp.where(commit, x0, state.response)
  decided = state.decided | commit
  is_stop = jnp.zeros_like(commit)
  for s in opts.stop_ids:
    is_stop = is_stop | (x0 == s)
  eos_seen = state.eos_seen | jnp.any(commit & is_stop, axis=1)

  block = jnp.arange(n, dtype=jnp.int32)[None]
  had_work = jnp.any((~state.decided).reshape(b, n, k), -1) & (
      block >= state.ready[:, None]) & (block < state.n_blocks[:, None]) & live[:, None]
  finished = block_counts(opts, decided) == k
  first_open = jnp.min(jnp.where((block >= state.ready[:, None]) & ~finished, block, n), 1)
  ready = jnp.where(live, jnp.minimum(first_open, state.n_blocks), state.ready)
  return state.replace(
      response=response, decided=decided, eos_seen=eos_seen,
      cached=jnp.where(live, state.ready, state.cached), ready=ready,
      block_steps=state.block_steps + had_work.astype(jnp.int32),
      forwards=state.forwards + live.astype(jnp.int32), steps=state.steps + 1)
