"""experiments/bench_step.py at toy size: the spy records exactly the model calls a step
makes (so the bare program is the step's forward work and nothing else), and the report and
JSON carry every table."""

import importlib.util
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from studylib import step_bench

K = 2


def toy_config():
  path = os.path.join(os.path.dirname(__file__), "..", "configs", "bench_step.py")
  spec = importlib.util.spec_from_file_location("bench_step_cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.scales = ("tiny",)
  c.decoders = ("ar", "d2f", "speculative")
  c.batches = (1,)
  c.gen_length, c.block_length, c.draft_length = 8, 4, K
  c.min_prompt_len, c.max_prompt_len = 3, 6
  c.points, c.repeats, c.inner = (0.5,), 1, 1
  c.batch_cost_rows = 2
  c.dtype_scales = ("tiny",)
  return c


@pytest.mark.slow
def test_bench_step_records_the_steps_model_calls(tmp_path):
  result = step_bench.run(toy_config(), str(tmp_path))
  by_name = {r["decoder"]: r for r in result["records"]}
  forwards = {name: [c for c in r["forward_calls"][0] if c == "forward"]
              for name, r in by_name.items()}
  # AR and D2F: one model forward per step; speculative with an AR drafter: K drafter
  # forwards (one token each) and the target's verifying forward.
  assert len(forwards["ar"]) == 1 and len(forwards["d2f"]) == 1
  assert len(forwards["speculative"]) == K + 1
  for r in result["records"]:
    assert r["step_best_s"] > 0 and r["bare_best_s"] > 0
    assert r["step_loop_best_s"] > 0 and r["bare_loop_best_s"] > 0
    assert r["bare_flops"] > 0 and r["step_flops"] >= 0.8 * r["bare_flops"], r
  assert {r["decoder"] for r in result["batch_cost"]} == set(by_name)
  assert [r["batch"] for r in result["dtypes"]] == [1]
  stored = json.loads((tmp_path / "bench_step.json").read_text())
  assert stored["records"][0]["decoder"] == "ar"
  report = (tmp_path / "bench_step.md").read_text()
  assert "step / bare" in report and "batch / rows" in report and "bf16 / f32" in report
  assert "in a loop" in report


def test_looped_program_runs_every_call_inside_its_loop():
  """The in-loop timing's program returns fn's output, and the compiled loop's body holds
  fn's work (its matmul and tanh): no call is hoisted out of the loop or dropped."""
  w = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 64
  x = jnp.ones((2, 8), jnp.float32)
  fn = lambda w, x, on: jnp.where(on, jnp.tanh(x @ w), 0.0)  # noqa: E731
  program = step_bench.looped(fn, 4)
  zero = jnp.zeros((), jnp.int32)
  args = (zero, w, x, jnp.ones((), bool))
  np.testing.assert_array_equal(np.asarray(program(*args)), np.asarray(fn(*args[1:])))
  hlo = program.lower(*args).compile().as_text()
  body = _computation_with_callees(hlo, re.search(r"while\(.*?body=(%[\w.\-]+)", hlo).group(1))
  assert " dot(" in body and " tanh(" in body, body
  with pytest.raises(ValueError, match="loop_steps"):
    step_bench.looped(fn, 0)


def _computation_with_callees(hlo: str, name: str) -> str:
  """The text of HLO computation `name` and of every computation it calls (fusions etc.)."""
  start = hlo.index("\n" + name + " ")
  text = hlo[start:hlo.index("\n}", start)]
  callees = set(re.findall(r"(?:calls|to_apply|body|condition)=(%[\w.\-]+)", text)) - {name}
  return text + "".join(_computation_with_callees(hlo, c) for c in sorted(callees))
