"""A decoder defined outside the package, registered with one call, runs behind every driver.

`LeftToRight` commits, per forward, the leftmost masked response slot of a bidirectional
model with its argmax token (or a sample at temperature > 0): LLaDA with one-slot blocks.
It is ~60 lines: options, state, and the protocol's methods. Registered as "left_to_right",
it gets `generate` (buckets and meshes included), `stream` and the serving `Engine` with no
other change; greedy, it equals `llada` at block_length=1, steps=G token for token.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import backend_compiles
from dllm_jax import serving
from dllm_jax.decoding import api, base, llada, protocol, registry, sampling, streaming
from dllm_jax.models import get_preset
from dllm_jax.parallel import mesh as mesh_lib
from test_decoding_llada import PROMPTS, random_params


@dataclasses.dataclass(frozen=True)
class LeftToRightOptions:
  gen_length: int = base.GEN_LENGTH
  temperature: float = 0.0

  def __post_init__(self):
    base.check_number("temperature", self.temperature, low=0.0)

  def split(self):  # temperature is traced: a sweep never recompiles
    return base.split_options(self, {"temperature": 0.0}, {})


@flax.struct.dataclass
class LeftToRightState:
  canvas: jax.Array       # [B, P + G]
  valid: jax.Array        # [B, P + G]
  positions: jax.Array    # [B, P + G]
  step: jax.Array         # [] loop iterations
  forwards: jax.Array     # [B] slots the row committed (one per forward it was live in)
  done: jax.Array         # [B]
  rng: jax.Array          # one key, or [B] keys (one per row)
  traced: dict
  finite: jax.Array       # [B]


class LeftToRight(protocol.Decoder):
  options = LeftToRightOptions

  def init(self, params, tokens, valid, rng, traced, row_inputs=None):
    canvas, cvalid, positions = base.init_canvas(tokens, valid, self.gen_length,
                                                 self.cfg.mask_token_id)
    b = tokens.shape[0]
    return LeftToRightState(canvas, cvalid, positions, jnp.zeros((), jnp.int32),
                            jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), rng, traced,
                            jnp.ones((b,), bool))

  def step(self, params, state):
    logits = llada.bidirectional_logits(params, self.cfg, state.canvas, state.valid,
                                        state.positions)
    b, live = logits.shape[0], ~state.done
    # Each row's leftmost mask: its own cursor, so a row may join a batch at any step.
    slot = state.canvas.shape[1] - self.gen_length + jnp.minimum(state.forwards,
                                                                 self.gen_length - 1)
    logits = logits[jnp.arange(b), slot]
    finite = sampling.all_finite(logits) | state.done
    logits = sampling.forbid(logits, (self.cfg.mask_token_id,))
    if sampling.is_row_keys(state.rng):  # one key per row (a served request's)
      keys = sampling.row_step_keys(state.rng, state.forwards)
    else:
      keys = sampling.row_keys(state.rng, state.step, b, state.traced.get("row_offset", 0))
    temperature = base.traced_option(self.opts, state.traced, "temperature")
    token = sampling.map_rows(lambda lg, k, temperature: sampling.gumbel_argmax(
        lg, temperature, k), (logits, keys), temperature=temperature)
    token = jnp.where(live, token, state.canvas[jnp.arange(b), slot])
    forwards = state.forwards + live
    return state.replace(canvas=state.canvas.at[jnp.arange(b), slot].set(token),
                         step=state.step + 1, forwards=forwards,
                         done=state.done | (forwards >= self.gen_length),
                         finite=state.finite & finite)

  def running(self, state):
    return state.step < self.gen_length

  def view(self, state):
    response = state.canvas[:, -self.gen_length:]
    return response, response != self.cfg.mask_token_id

  def output(self, state):
    response, decided = self.view(state)
    pad = base.output_pad_id(self.cfg)
    tokens, lengths, _ = base.finalize(response, decided, base.stop_ids(self.cfg), pad)
    return base.decode_output(tokens, lengths, state.step, state.step, state.forwards,
                              state.done, state.finite, pad)


@pytest.fixture(scope="module")
def model():
  registry.register("left_to_right", LeftToRight)  # the one line that adds a method
  cfg = get_preset("tiny").replace(eos_token_id=None)
  yield cfg, random_params(cfg)
  registry.unregister("left_to_right")


def test_a_registered_decoder_is_a_method(model):
  assert "left_to_right" in registry.names()
  assert api.option_names("left_to_right") == ["gen_length", "temperature", "on_nonfinite"]
  with pytest.raises(ValueError, match="Unknown option"):
    api.generate(None, model[0], PROMPTS, method="left_to_right", steps=4)


def test_greedy_equals_llada_with_one_slot_blocks(model):
  cfg, params = model
  ours = api.generate(params, cfg, PROMPTS, method="left_to_right", gen_length=8)
  ref = api.generate(params, cfg, PROMPTS, method="llada", gen_length=8, block_length=1,
                     steps=8, early_stop=False)
  np.testing.assert_array_equal(np.asarray(ours.tokens), np.asarray(ref.tokens))
  assert int(ours.nfe) == int(ref.nfe) == 8


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_alone_batched_streamed_and_sharded_agree(model, temperature):
  cfg, params = model
  kw = dict(gen_length=8, temperature=temperature)
  rng = jax.random.key(3)
  batch = api.generate(params, cfg, PROMPTS, method="left_to_right", rng=rng, **kw)
  events = list(streaming.stream(params, cfg, PROMPTS, method="left_to_right", rng=rng, **kw))
  np.testing.assert_array_equal(events[-1].output.tokens, batch.tokens)
  assert len(events) == 8 and all(e.new.sum(1).tolist() == [1, 1, 1] for e in events)
  mesh = mesh_lib.make_mesh({"data": 1})
  sharded = api.generate(params, cfg, PROMPTS, method="left_to_right", rng=rng, mesh=mesh,
                         **kw)
  np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(batch.tokens))
  if temperature == 0.0:  # greedy rows do not depend on the batch
    for i, prompt in enumerate(PROMPTS):
      alone = api.generate(params, cfg, [prompt], method="left_to_right", **kw)
      np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(batch.tokens)[i])


def test_a_temperature_sweep_compiles_once(model):
  cfg, params = model
  api.generate(params, cfg, PROMPTS, method="left_to_right", gen_length=8, temperature=0.5)
  size = protocol.compiled_programs()[0]
  for t in (0.6, 0.7, 1.3):
    api.generate(params, cfg, PROMPTS, method="left_to_right", gen_length=8, temperature=t)
  assert protocol.compiled_programs()[0] == size


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_served_by_the_engine_as_decoded_alone(model, temperature, no_compile_cache):
  """Served by `Engine` (2 slots for 5 requests, so rows join mid-decode beside others),
  each request equals its prompt decoded alone with its seed's keys, and after warmup
  serving compiles nothing. A sampled lane serves per-request temperatures, 0 included."""
  cfg, params = model
  engine = serving.Engine(params, cfg, methods="left_to_right",
                          options=dict(gen_length=8, temperature=temperature), slots=2,
                          max_prompt_len=8, prompt_buckets=(4, 8), admit_sizes=(1, 2),
                          max_steps_per_run=3)
  engine.warmup()
  temperatures = [temperature, 0.0, 1.3, temperature, 0.5] if temperature else [0.0] * 5
  prompts = PROMPTS + [[7, 8, 9, 10, 11, 12, 13], [6]]
  with backend_compiles() as compiles:
    ids = [engine.submit(p, seed=10 + i, options=dict(temperature=t))
           for i, (p, t) in enumerate(zip(prompts, temperatures))]
    results = {e.request_id: e for e in engine.run_until_idle()
               if isinstance(e, serving.Result)}
  assert compiles == []
  for i, (prompt, t) in enumerate(zip(prompts, temperatures)):
    alone = api.generate(params, cfg, [prompt], method="left_to_right", gen_length=8,
                         temperature=t, rng=serving.request_keys([10 + i]))
    assert results[ids[i]].ok
    assert results[ids[i]].tokens == tuple(np.asarray(alone.tokens)[0, :int(alone.lengths[0])])
    assert results[ids[i]].nfe == 8
