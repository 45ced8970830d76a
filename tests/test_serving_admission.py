"""Admission control: a bounded queue answers at once, a cancelled row's slot is reused.

One engine shape for every test (2 slots, bucket 16, admit size 2), so the whole file compiles
a d2f lane's two programs (and an ar lane's, for the two-lane compile check); each output is
checked against its prompt decoded alone.
"""

import jax
import numpy as np
import pytest

from conftest import backend_compiles

from dllm_jax.decoding import generate
from dllm_jax.models import get_preset
from dllm_jax.serving import (CancelledError, Engine, QueueFullError, RequestError, Result,
                              StreamUpdate, request_keys)
from test_decoding_d2f import peaked_params

CFG = get_preset("tiny")
G = 12
OPTIONS = dict(gen_length=G, block_length=4, batch_invariant=True)
SHAPE = dict(slots=2, max_prompt_len=16, prompt_buckets=(16,), admit_sizes=(2,),
             max_steps_per_run=1)


@pytest.fixture(scope="module")
def params():
  return peaked_params()


def alone(params, prompt, seed, **options) -> tuple:
  one = generate(params, CFG, [prompt], method="d2f", rng=request_keys([seed]),
                 **{**OPTIONS, **options})
  return tuple(np.asarray(one.tokens[0])[:int(one.lengths[0])].tolist())


def results_of(events) -> dict:
  return {e.request_id: e for e in events if isinstance(e, Result)}


def test_full_queue_answers_at_once(params):
  """max_queue=1 with 2 slots: 3 requests fit (2 take the free slots at the next step, 1
  waits); the 4th is a QueueFullError at once, touching no slot. Once the queue drains,
  submissions are accepted again."""
  engine = Engine(params, CFG, methods="d2f", options=OPTIONS, max_queue=1, **SHAPE)
  ids = [engine.submit([5, 6, 7], seed=i) for i in range(4)]
  assert engine.queue_depth() == {"d2f": 3} and engine.occupancy == 0
  first = engine.step()
  refused = results_of(first)[ids[3]]
  assert refused.status == "error" and isinstance(refused.error, QueueFullError)
  assert isinstance(refused.error, RequestError) and "max_queue=1" in str(refused.error)
  assert engine.occupancy == 2 and engine.queue_depth() == {"d2f": 1}
  # 2 running, 1 waiting: the lane is full now.
  late = engine.submit([8], seed=9)
  done = results_of(first + engine.run_until_idle())
  assert isinstance(done[late].error, QueueFullError)
  assert [done[i].tokens for i in ids[:3]] == [alone(params, [5, 6, 7], i) for i in range(3)]
  again = engine.submit([8], seed=9)
  assert results_of(engine.run_until_idle())[again].tokens == alone(params, [8], 9)
  assert engine.metrics().errors == 2


def test_cancelled_row_frees_its_slot_for_the_next_request(params):
  """Cancelling a running request frees its slot at once; the next admission takes that slot,
  and the new row decodes exactly as alone (the cancelled row is retired, not resumed),
  beside a row that kept running."""
  engine = Engine(params, CFG, methods="d2f", options=OPTIONS, **SHAPE)
  lane = engine.lanes["d2f"]
  keep = engine.submit([5, 6, 7], seed=1)
  drop = engine.submit([9, 10, 11, 12], seed=2)
  events = engine.step()
  slot = next(b for b, live in enumerate(lane.slots) if live and live.request.id == drop)
  assert engine.occupancy == 2
  assert engine.cancel(drop) and not engine.cancel(drop) and not engine.cancel(12345)
  assert engine.occupancy == 1 and lane.slots[slot] is None
  late = engine.submit([13, 14], seed=3)
  events += engine.step()
  assert lane.slots[slot] is not None and lane.slots[slot].request.id == late
  events += engine.run_until_idle()
  results = results_of(events)
  assert results[drop].status == "cancelled" and isinstance(results[drop].error,
                                                            CancelledError)
  assert results[keep].tokens == alone(params, [5, 6, 7], 1)
  assert results[late].tokens == alone(params, [13, 14], 3)
  # The cancelled request streams nothing after its cancel.
  after = events.index(results[drop])
  assert not any(isinstance(e, StreamUpdate) and e.request_id == drop for e in events[after:])
  assert engine.occupancy == 0 and engine.queue_depth() == {"d2f": 0}


def test_cancel_a_queued_request(params):
  engine = Engine(params, CFG, methods="d2f", options=OPTIONS, max_queue=0, **SHAPE)
  ids = [engine.submit([5], seed=i) for i in range(2)]
  assert engine.queue_depth() == {"d2f": 2}
  assert engine.cancel(ids[1]) and engine.queue_depth() == {"d2f": 1}
  results = results_of(engine.run_until_idle())
  assert results[ids[1]].status == "cancelled" and results[ids[0]].ok


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_max_queue_is_checked(params, bad):
  with pytest.raises(ValueError, match="max_queue"):
    Engine(params, CFG, methods="d2f", options=OPTIONS, max_queue=bad, **SHAPE)


def test_no_compiles_after_warmup_on_a_two_lane_engine(params):
  """Loaded params are committed to a device, and so is every state a run returns; warmup's
  admissions go into an empty state, which must be committed too, or the first admission
  into a state a run returned compiles `_admit` again."""
  committed = jax.device_put(params, jax.devices()[0])
  engine = Engine(committed, CFG, methods={"ar": dict(gen_length=G), "d2f": OPTIONS}, **SHAPE)
  engine.warmup()
  with backend_compiles() as compiles:
    ids = []
    for wave in range(3):  # later waves wait for slots a run freed
      ids += [engine.submit([5 + wave, 6, 7 + i], method=m, seed=i)
              for m in engine.lanes for i in range(2)]
      engine.step()
    engine.run_until_idle()
  assert compiles == []
  assert all(engine.pop_result(i).ok for i in ids)
