"""Finished rows leave the forward: a batch decoded in stages of shrinking batch.

Shape legend: B batch rows, b a stage's rows (b < B).

One `lax.while_loop` over a batch steps until its slowest row is done, and every step
forwards every row, the finished ones too: a batch whose rows finish at different steps
(threshold decoders, early stops) pays its slowest row's step count at full width and can
cost more than decoding its rows one at a time. `run` decodes in stages of static sizes
B > b_1 > ... > 1 (`stage_sizes`, each half the one before, rounded up):

    start  (B rows)  init, then step while more rows are live than the next stage holds
    stage  (b rows)  gather the live rows (and finished ones, to fill b) and step likewise
    merge            scatter each stage's rows back into the stage before; the output

Each is one jitted program with static shapes (the loops are `lax.while_loop`s); the host
reads one flag between them. A batch whose rows finish together runs `start` alone (one
program, as `protocol.run`); a stage's program is compiled only when a decode reaches it.

Exactness: a row's state depends on its own inputs and on the shared scalars (step
counters), which run on unchanged, so the staged decode equals the one-loop decode when
the decoder freezes finished rows (`Decoder.compacts`) and the forward gives a row the same
numbers at any batch size (what `batch_invariant` decoding asks for; otherwise a row can
differ on near-ties, as between any two batch compositions). A row's random keys follow its
global index, which `Decoder.with_row_ids` stores per row before any gather.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dllm_jax.decoding import sampling

# Each stage holds 1 / SHRINK of the rows of the one before (rounded up). Halving keeps at
# most twice the live rows in the forward; a stage's program compiles only when reached.
SHRINK = 2


def stage_sizes(batch: int) -> tuple[int, ...]:
  """(B, ceil(B / 2), ..., 1): the row counts of the stages; (1,) for one row."""
  sizes = [batch]
  while sizes[-1] > 1:
    sizes.append(-(-sizes[-1] // SHRINK))
  return tuple(sizes)


# ----------------------------------------------------------------------------- rows

def row_axes(decoder, state):
  """The row axis of every state leaf (`Decoder.row_axes`; None: shared), with a random key
  shared by the batch (one key, raw or typed) marked shared."""
  def fix(path, axis, leaf):
    name = getattr(path[-1], "name", getattr(path[-1], "key", None)) if path else None
    return None if name == "rng" and not sampling.is_row_keys(leaf) else axis
  return jax.tree_util.tree_map_with_path(fix, decoder.row_axes(state), state,
                                          is_leaf=lambda x: x is None)


def take_rows(decoder, state, rows):
  """The rows `rows` [b] of every per-row leaf; shared leaves as they are."""
  return jax.tree_util.tree_map(
      lambda axis, x: x if axis is None else jnp.take(x, rows, axis=axis),
      row_axes(decoder, state), state, is_leaf=lambda x: x is None)


def put_rows(decoder, state, rows, part):
  """`state` with rows `rows` [b] replaced by `part`'s, and the shared leaves `part`'s (the
  counters it ran on)."""
  def put(axis, x, y):
    return y if axis is None else x.at[(slice(None),) * axis + (rows,)].set(y)
  return jax.tree_util.tree_map(put, row_axes(decoder, state), state, part,
                                is_leaf=lambda x: x is None)


def _live_first(decoder, state, size: int):
  """[size] row indices: the live rows in row order, then finished ones."""
  return jnp.argsort(decoder.done(state).astype(jnp.int32), stable=True)[:size]


def _loop_while_crowded(decoder, params, state, until: int):
  """Steps while `running` and more than `until` rows are live; (state, still running)."""
  crowded = lambda s: decoder.running(s) & (jnp.sum(~decoder.done(s), dtype=jnp.int32) > until)
  state = jax.lax.while_loop(crowded, functools.partial(decoder.step, params), state)
  return state, decoder.running(state)


def _result(decoder, state, with_stats: bool):
  """The output (and stats) of a state whose rows are in their batch order."""
  state = decoder.without_row_ids(state)
  out = decoder.output(state)
  return (out, decoder.stats(state)) if with_stats else out


# ----------------------------------------------------------------------------- programs

@functools.partial(jax.jit, static_argnames=("decoder", "until", "with_stats"))
def start(params, tokens, valid, rng, traced, row_inputs=None, *, decoder, until: int,
          with_stats: bool = False):
  """init and the first stage: (state, still running, the output were it final)."""
  state = decoder.with_row_ids(decoder.init(params, tokens, valid, rng, traced, row_inputs))
  state, more = _loop_while_crowded(decoder, params, state, until)
  return state, more, _result(decoder, state, with_stats)


@functools.partial(jax.jit, static_argnames=("decoder", "size", "until"))
def stage(params, state, *, decoder, size: int, until: int):
  """The next stage: (its `size` rows after their loop, their indices [size], running)."""
  rows = _live_first(decoder, state, size)
  part, more = _loop_while_crowded(decoder, params, take_rows(decoder, state, rows), until)
  return part, rows, more


@functools.partial(jax.jit, static_argnames=("decoder", "with_stats"))
def merge(state, rows, part, *, decoder, with_stats: bool = False):
  """`part`'s rows back into `state`: (state, its output)."""
  state = put_rows(decoder, state, rows, part)
  return state, _result(decoder, state, with_stats)


# ----------------------------------------------------------------------------- the driver

def run(params, tokens, valid, rng, traced, row_inputs=None, *, decoder,
        with_stats: bool = False):
  """The decode of a [B, P] batch in stages (module doc): `protocol.run`'s result, with
  finished rows leaving the forward. For a decoder that `compacts`, B > 1."""
  sizes = stage_sizes(tokens.shape[0])
  state, more, result = start(params, tokens, valid, rng, traced, row_inputs,
                              decoder=decoder, until=sizes[1], with_stats=with_stats)
  stack = []
  for size, until in zip(sizes[1:], sizes[2:] + (0,)):
    if not bool(more):
      break
    part, rows, more = stage(params, state, decoder=decoder, size=size, until=until)
    stack.append((state, rows))
    state = part
  for parent, rows in reversed(stack):
    state, result = merge(parent, rows, state, decoder=decoder, with_stats=with_stats)
  return result
