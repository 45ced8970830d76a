"""The scaling sweep: exact forward counts, breakevens, the skip rule and every output file.

One micro sweep (width 64, G in {8, 16}, batch 1, blocks of 4) runs once per module; the
NFE of each decoder is checked against its schedule, restated here from the algorithms:
AR G (the prefill yields the first token), LLaDA steps = G, Fast-dLLM G at any cache mode
(one token per step), block diffusion N * s, D2F its steps with the overlap of adjacent
blocks worked out below (their first forward carries the prompt: no separate prefill).
"""

import importlib.util
import json
import os

import numpy as np
import pytest
from ml_collections import config_dict

from studylib import scaling

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K, TAU_ACT_COUNT = 4, 2  # block size; tau_act = 0.5 of 4 slots = 2 decided tokens


def load_config(mode=None):
  spec = importlib.util.spec_from_file_location("scaling_config",
                                                os.path.join(REPO, "configs", "scaling.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if mode is None else module.get_config(mode)


def micro_config():
  c = load_config()
  c.prompt_len = 4
  c.block_length = K
  c.d2f_tau_act = 0.5
  c.lengths = config_dict.ConfigDict({"sweep": (8, 16), "batch": 1, "width": 64})
  c.batches = config_dict.ConfigDict({"sweep": (1,), "gen_length": 8, "width": 64})
  c.widths = config_dict.ConfigDict({"sweep": (64,), "gen_length": 8, "batch": 1})
  c.repeats, c.timing_budget_s = 2, 0.0
  # Cap just below a full-canvas decode of G=16: LLaDA and no-cache Fast-dLLM skip there.
  cfg = scaling.width_config(64, vocab_size=c.vocab_size, max_seq_len=20)
  c.max_cell_tflop = 0.999 * scaling.estimate_flops(cfg, [(16, 20, 20)], 1) / 1e12
  return c


def expected_nfe(decoder: str, g: int) -> int:
  n = g // K
  if decoder in ("ar", "llada", "fast_dllm_none", "fast_dllm_prefix", "fast_dllm_dual"):
    return g
  if decoder == "block_diffusion":
    return n * K
  if decoder == "d2f":
    # One token per fully activated block per step; block i + 1 is fully activated once
    # block i has TAU_ACT_COUNT tokens, so adjacent blocks overlap for K - TAU_ACT_COUNT
    # steps.
    return g - (n - 1) * (K - TAU_ACT_COUNT)
  raise KeyError(decoder)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("scaling")
  doc = scaling.run(micro_config(), workdir)
  return doc, workdir


@pytest.mark.slow
def test_nfe_matches_each_schedule(sweep):
  doc, _ = sweep
  seen = {(c["decoder"], c["gen_length"]) for c in doc["cells"]}
  assert len(seen) == 12 and len(doc["cells"]) == 12  # 7 decoders x 2 G, less 2 skipped
  for c in doc["cells"]:
    assert c["nfe"] == expected_nfe(c["decoder"], c["gen_length"]), c
    if c["decoder"] != "d2f":  # the FLOP model counts the same forwards
      assert c["nfe_plan"] == c["nfe"], c
    assert c["t_fwd_s"] == pytest.approx(c["wall_s"] / c["nfe"])
    assert c["tokens_per_s"] == pytest.approx(c["gen_length"] * c["batch"] / c["wall_s"])
    assert c["wall_s"] == pytest.approx(float(np.median(c["wall_all_s"])))
    assert len(c["wall_all_s"]) == 1  # a zero timing budget stops after one timed call


@pytest.mark.slow
def test_breakeven_is_relative_to_ar_of_the_same_cell(sweep):
  doc, _ = sweep
  ar = {c["gen_length"]: c for c in doc["cells"] if c["decoder"] == "ar"}
  for c in doc["cells"]:
    ref = ar[c["gen_length"]]
    assert c["breakeven"] == pytest.approx(c["t_fwd_s"] / ref["t_fwd_s"])
    assert c["vs_ar"] == pytest.approx(ref["wall_s"] / c["wall_s"])
  assert all(ar[g]["breakeven"] == 1.0 for g in ar)


@pytest.mark.slow
def test_skipped_cells_are_listed_with_their_reason(sweep):
  doc, workdir = sweep
  skipped = {(s["decoder"], s["gen_length"]) for s in doc["skipped"]}
  assert skipped == {("llada", 16), ("fast_dllm_none", 16)}
  assert all("max_cell_tflop" in s["reason"] for s in doc["skipped"])
  table = (workdir / "scaling.md").read_text()
  assert "llada G=16 batch=1 width=64: estimated" in table
  assert table.count("\n| ") == 1 + 12  # header + one row per measured cell


@pytest.mark.slow
def test_outputs_are_written_and_valid(sweep):
  doc, workdir = sweep
  on_disk = json.loads((workdir / "scaling.json").read_text())
  scaling.validate(on_disk)
  assert on_disk["cells"] == json.loads(json.dumps(doc["cells"]))
  assert on_disk["machine"]["platform"] == "cpu" and len(on_disk["machine"]["loadavg_after"]) == 3
  for name in ("cost_vs_length.png", "breakeven_vs_width.png"):
    assert (workdir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  broken = json.loads(json.dumps(doc))
  broken["cells"][0]["nfe"] = 0
  with pytest.raises(ValueError, match="nfe"):
    scaling.validate(broken)


def test_grid_is_three_deduplicated_lines():
  c = load_config()
  assert scaling.grid(c) == [(64, 1, 64), (256, 1, 64), (1024, 1, 64), (256, 8, 64),
                             (64, 1, 256), (64, 1, 768)]
  full = load_config("full")
  assert len(scaling.grid(full)) == 5 + 3 + 5  # shared centre cells counted once
  assert full.dtype == "bfloat16" and load_config().dtype == "float32"
  point = load_config("1b")  # the accelerator check's weight-streaming point
  assert scaling.grid(point) == [(256, 1, 768), (256, 1, 1792)]
  assert point.dtype == "bfloat16" and point.decoders == ("ar", "fast_dllm_dual", "d2f")
  scaling.check_config(point)
  models = {d: scaling.width_config(d, vocab_size=point.vocab_size,
                                    max_seq_len=point.prompt_len + 256, dtype=point.dtype)
            for d in (768, 1792)}
  assert not [name for name in point.decoders for d in models  # no cell would be skipped
              if scaling._skip_reason(scaling.DECODERS[name], point, models[d], 256, 1)]


def test_width_rule_and_parameter_counts():
  counts = {d: scaling.width_config(d, vocab_size=260, max_seq_len=64).num_params()
            for d in (64, 256, 768, 1792)}
  assert counts[64] < 2e5 and 1e6 < counts[256] < 5e6 and 8e7 < counts[768] < 1.1e8
  assert 1.0e9 < counts[1792] < 1.3e9  # the accelerator mode's ~1B model
  bf16 = scaling.width_config(64, vocab_size=260, max_seq_len=64, dtype="bfloat16")
  assert (bf16.param_dtype, bf16.dtype) == ("bfloat16", "bfloat16")
  cfg = scaling.width_config(768, vocab_size=260, max_seq_len=64)
  assert (cfg.n_layers, cfg.n_heads, cfg.resolved_head_dim, cfg.mlp_dim) == (12, 12, 64, 2304)
  assert cfg.eos_token_id is None and cfg.eot_token_id is None
  with pytest.raises(ValueError, match="multiple of 64"):
    scaling.width_config(100, vocab_size=260, max_seq_len=64)


def test_flop_estimate_matches_a_hand_count():
  cfg = scaling.width_config(64, vocab_size=260, max_seq_len=64)
  # 2 layers of (attention, MLP, 2 norm scales), the final norm, the head.
  dense = 2 * (64 * 64 * 4 + 3 * 64 * 192 + 2 * 64) + 64 + 64 * 260
  attn = 4 * 2 * 64  # 2 layers x (QK + AV) x 2 FLOPs x width
  assert scaling.estimate_flops(cfg, [(3, 5, 7)], 2) == 2 * 3 * (2 * dense * 5 + attn * 5 * 7)


@pytest.mark.parametrize("change, message", [
    ({"decoders": ("ar", "lada")}, "Unknown decoder"),
    ({"decoders": ("llada",)}, "must include 'ar'"),
    ({"repeats": 0}, "repeats"),
    ({"block_length": 0}, "block_length"),
])
def test_bad_config_is_rejected_before_compiling(tmp_path, change, message):
  c = load_config()
  for key, value in change.items():
    setattr(c, key, value)
  with pytest.raises(ValueError, match=message):
    scaling.run(c, tmp_path)
  assert not list(tmp_path.iterdir())


def test_unknown_mode_is_rejected():
  with pytest.raises(ValueError, match="full"):
    load_config("gpu")
