"""`generate` dispatch and option checking, and streaming vs the fused loop."""

import functools

import jax
import numpy as np
import pytest

from dllm_jax import decoding
from dllm_jax.decoding import api, ar, base, buckets, llada, streaming
from dllm_jax.models import get_preset
from dllm_jax.parallel import mesh as mesh_lib
from test_decoding_llada import PROMPTS, random_params

G = 16


@pytest.fixture(scope="module")
def model():
  cfg = get_preset("tiny").replace(eos_token_id=None)
  return cfg, random_params(cfg)


def test_generate_dispatches_to_the_decoders(model):
  cfg, params = model
  batch = base.pad_prompts(PROMPTS, 0)
  # The direct calls get the batch `generate` builds (3 rows -> bucket 4, length 5 -> 16), so
  # each pair shares one compiled program; bucketed == unbucketed is test_decoding_buckets'.
  padded = buckets.pad_batch(np.asarray(batch[0]), np.asarray(batch[1]), 16, 4, 0)
  via_api = api.generate(params, cfg, PROMPTS, method="dream", gen_length=G, block_length=8,
                         steps=8)
  direct = llada.llada_generate(params, cfg, *padded, gen_length=G, block_length=8, steps=8,
                                remasking="entropy")
  assert via_api.tokens.shape == (3, G)
  np.testing.assert_array_equal(via_api.tokens, np.asarray(direct.tokens)[:3])
  pair = decoding.generate(params, cfg, (np.asarray(batch[0]), np.asarray(batch[1])),
                           method="ar", gen_length=12)
  np.testing.assert_array_equal(pair.tokens, np.asarray(
      ar.ar_generate(params, cfg, *padded, gen_length=12).tokens)[:3])


@pytest.mark.parametrize("method,options,match", [
    ("diffusion", {}, "Unknown decoding method 'diffusion'.*'fast_dllm'"),
    ("llada", {"gen_len": 16}, r"Unknown option\(s\) \['gen_len'\].*'gen_length'"),
    ("fast_dllm", {"tau": 0.5}, r"\['tau'\].*'threshold'"),
    ("ar", {"steps": 4}, r"\['steps'\].*'top_p'"),
    ("d2f", {"tau_conff": 0.9}, r"\['tau_conff'\].*'tau_conf'"),
    ("block_diffusion", {"steps": 4}, r"\['steps'\].*'steps_per_block'"),
    ("d2f", {"return_state": True}, r"\['return_state'\]"),
])
def test_bad_method_or_option_lists_the_valid_ones(method, options, match):
  with pytest.raises(ValueError, match=match):
    api.generate(None, get_preset("tiny"), [[5, 6]], method=method, **options)


@pytest.mark.parametrize("prompts", [[], [[]], "5 6", [5, 6]])
def test_bad_prompts(prompts):
  with pytest.raises(ValueError, match="prompt"):
    api.generate(None, get_preset("tiny"), prompts, method="llada", gen_length=8)


def test_d2f_dispatch_passes_prompts_options_and_mesh(monkeypatch):
  """What `generate` hands D2F's decoder (no compile needed): the left-padded prompts, the
  static spec, the traced thresholds and, on a mesh, the mesh."""
  from dllm_jax.decoding import d2f, protocol
  calls = []

  def recorder(params, tokens, valid, rng, traced, row_inputs=None, *, decoder, **kw):
    calls.append((np.asarray(tokens), np.asarray(valid), decoder, traced))
    b = tokens.shape[0]
    return base.DecodeOutput(tokens=np.zeros((b, 4), np.int32), lengths=np.zeros(b, np.int32),
                             nfe=np.int32(1), steps=np.int32(1),
                             committed=np.zeros(b, np.int32), done=np.ones(b, bool))

  monkeypatch.setattr(protocol, "run", recorder)
  monkeypatch.setattr(protocol, "run_batch", recorder)  # a batch without a mesh
  cfg = get_preset("tiny")
  out = api.generate(None, cfg, [[5, 6, 7], [8]], method="d2f", gen_length=8, block_length=4,
                     tau_conf=0.8, pad_to=None, batch_buckets=None)
  tokens, valid, decoder, traced = calls[-1]
  np.testing.assert_array_equal(tokens, [[5, 6, 7], [0, 0, 8]])
  np.testing.assert_array_equal(valid, [[1, 1, 1], [0, 0, 1]])
  assert isinstance(decoder, d2f.D2FDecoder) and decoder.mesh is None
  assert (decoder.opts.gen_length, decoder.opts.block_length) == (8, 4)
  np.testing.assert_allclose(np.asarray(traced.tau_conf), 0.8)
  mesh = mesh_lib.make_mesh({"data": 1})
  out = api.generate(random_params(cfg), cfg, [[5, 6, 7], [8]], method="d2f", mesh=mesh,
                     gen_length=8, block_length=4)
  assert calls[-1][2].mesh is mesh and out.tokens.shape == (2, 4)


def test_llada_stream_replays_the_fused_loop(model):
  cfg, params = model
  kw = dict(gen_length=G, block_length=8, steps=6, remasking="random")
  rng = jax.random.key(3)
  events = list(streaming.stream(params, cfg, PROMPTS, method="llada", rng=rng, **kw))
  fused = api.generate(params, cfg, PROMPTS, method="llada", rng=rng, **kw)
  assert [e.step for e in events] == list(range(1, 7))
  schedule = llada.transfer_schedule(8, 3, 2)
  for e, k in zip(events, schedule):
    np.testing.assert_array_equal(e.new.sum(1), k)
  assert all(e.output is None for e in events[:-1])
  out = events[-1].output
  np.testing.assert_array_equal(out.tokens, fused.tokens)
  assert int(out.nfe) == int(fused.nfe) == 6
  np.testing.assert_array_equal(sum(e.new.astype(int) for e in events), 1)


def test_ar_stream_yields_one_token_per_row_and_step(model):
  cfg, params = model
  kw = dict(gen_length=12, temperature=1.0, top_k=10, top_p=0.9)
  rng = jax.random.key(7)
  events = list(streaming.stream(params, cfg, PROMPTS, method="ar", rng=rng, **kw))
  assert len(events) == 12 and events[0].step == 0
  for i, e in enumerate(events):
    assert e.new[:, i].all() and e.new.sum() == len(PROMPTS)
  fused = api.generate(params, cfg, PROMPTS, method="ar", rng=rng, **kw)
  np.testing.assert_array_equal(events[-1].output.tokens, fused.tokens)
  np.testing.assert_array_equal(events[-1].response, fused.tokens)


def test_stream_rejects_unknown_methods_and_options(model):
  cfg, params = model
  with pytest.raises(ValueError, match="Unknown decoding method 'beam'"):
    next(streaming.stream(params, cfg, PROMPTS, method="beam"))
  with pytest.raises(ValueError, match="threshhold"):
    next(streaming.stream(params, cfg, PROMPTS, method="fast_dllm", threshhold=0.5))
