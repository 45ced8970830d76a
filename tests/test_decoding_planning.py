"""A decode call's host-side planning: options checked once per distinct set
(`option_cache`), and a hybrid's drafter prompt checks (`speculative.check_drafter_prompts`).

The cache must never change what a call does: an option set that fails its check fails
every time, values that compare equal but mean different things (1, 1.0, True; 0.0, -0.0)
key apart, a value with no hash is checked on every call, and the traced dict a call gets is
its own.
"""

import numpy as np
import pytest

from dllm_jax.decoding import adaptive, api, option_cache, protocol
from test_decoding_speculative import CFG, random_params

DIFFUSION = CFG  # the tiny preset has a mask id: a D2F-style drafter
SHORT_WINDOW = CFG.replace(max_seq_len=24)


@pytest.fixture(autouse=True)
def fresh_cache():
  option_cache.clear()
  yield
  option_cache.clear()


def test_one_option_set_is_checked_once_and_its_traced_dict_is_each_calls_own():
  first = protocol.plan("ar", CFG, {"gen_length": 8, "temperature": 0.5})
  first.traced["temperature"] = "spoiled"
  second = protocol.plan("ar", CFG, {"gen_length": 8, "temperature": 0.5})
  assert second.decoder.opts is first.decoder.opts  # the cached split
  assert float(second.traced["temperature"]) == 0.5
  other = protocol.plan("ar", CFG, {"gen_length": 8, "temperature": 0.7})
  assert float(other.traced["temperature"]) == pytest.approx(0.7)
  assert other.decoder.opts == first.decoder.opts  # one static program for the sweep


def test_values_that_compare_equal_key_apart():
  assert option_cache.key({"early_stop": True}) != option_cache.key({"early_stop": 1})
  assert option_cache.key({"x": 1}) != option_cache.key({"x": 1.0})
  assert option_cache.key({"x": 0.0}) != option_cache.key({"x": -0.0})
  assert option_cache.key({"m": {"a": 1}}) != option_cache.key({"m": (("a", 1),)})
  assert option_cache.key({"x": np.float32(0.5)}) != option_cache.key({"x": 0.5})
  # A cached True must not let an int flag through: the check runs for the int's own key.
  protocol.plan("ar", CFG, {"gen_length": 8, "early_stop": True})
  with pytest.raises(ValueError, match="early_stop must be True or False"):
    protocol.plan("ar", CFG, {"gen_length": 8, "early_stop": 1})


def test_a_failing_set_fails_every_time_and_an_unhashable_value_is_not_cached():
  for _ in range(2):
    with pytest.raises(ValueError, match="temperature"):
      protocol.plan("ar", CFG, {"gen_length": 8, "temperature": -1.0})
  assert option_cache.key({"stop": [1, 2], "m": {"a": (3,)}}) is not None
  assert option_cache.key({"x": np.zeros(2)}) is None
  assert option_cache.key({"m": {"a": np.zeros(2)}}) is None
  assert not option_cache._entries  # pylint: disable=protected-access


def test_the_cache_is_bounded(monkeypatch):
  monkeypatch.setattr(option_cache, "MAX_ENTRIES", 2)
  for g in (4, 5, 6, 7):
    protocol.plan("ar", CFG, {"gen_length": g})
  assert len(option_cache._entries) == 2  # pylint: disable=protected-access
  assert protocol.plan("ar", CFG, {"gen_length": 4}).decoder.gen_length == 4


def test_adaptive_task_map_is_cached_and_checked():
  target, drafter = random_params(CFG, 0), random_params(CFG, 1)
  options = dict(gen_length=8, draft_length=2, drafter_params=drafter, drafter_cfg=DIFFUSION,
                 task_modes={"x": "ar", "y": "verify"})
  a = protocol.plan("adaptive", CFG, dict(options, tasks=["x"]))
  b = protocol.plan("adaptive", CFG, dict(options, tasks=["y"]))
  assert (a.decoder.plain, b.decoder.plain) == (adaptive.AR, adaptive.VERIFY)
  assert b.drafter_params is drafter and a.drafter_params is None
  with pytest.raises(ValueError, match="unknown task tag 'z'"):
    protocol.plan("adaptive", CFG, dict(options, tasks=["z"]))
  with pytest.raises(ValueError, match="task_modes\\['x'\\]='fast'"):
    protocol.plan("adaptive", CFG, dict(options, task_modes={"x": "fast"}, tasks=["x"]))
  del target


@pytest.mark.parametrize("method,extra", [("speculative", {"drafter": "d2f"}),
                                          ("adaptive", {})])
def test_a_diffusion_drafter_rejects_its_mask_id_in_a_prompt(method, extra):
  target, drafter = random_params(CFG, 0), random_params(CFG, 1)
  prompt = [[5, 6, DIFFUSION.mask_token_id, 8]]
  with pytest.raises(ValueError, match=f"contains the mask id {DIFFUSION.mask_token_id}"):
    api.generate(target, CFG, prompt, method=method, gen_length=4, draft_length=2,
                 drafter_params=drafter, drafter_cfg=DIFFUSION, **extra)


def test_an_ar_drafter_takes_any_prompt_and_a_drafters_window_is_its_own():
  target, drafter = random_params(CFG, 0), random_params(CFG, 1)
  prompt = [[5, 6, CFG.mask_token_id, 8]]  # the target is causal: any id is a prompt token
  out = api.generate(target, CFG, prompt, method="speculative", drafter="ar", gen_length=4,
                     draft_length=2, drafter_params=drafter, drafter_cfg=CFG)
  assert np.asarray(out.tokens).shape == (1, 4)
  with pytest.raises(ValueError, match="max_seq_len=24 of 'tiny'"):
    api.generate(target, CFG, [[5, 6, 7, 8]], method="speculative", drafter="d2f",
                 gen_length=32, draft_length=2, drafter_params=drafter,
                 drafter_cfg=SHORT_WINDOW, pad_to=None)
