"""Executes notebooks/*.ipynb top to bottom (nbclient, a python3 kernel from this venv).

Each notebook's tagged "parameters" cell is replaced before executing: its defaults are read by
running the cell's source, the test's overrides are applied (an unknown name is an error), and
the cell becomes plain `NAME = value` lines. The kernel runs in a temporary directory, with
this checkout first on PYTHONPATH and JAX on the CPU.

  quickstart.ipynb  trains its three models from scratch (a fresh workdir) and must finish in
                    QUICKSTART_LIMIT_S on 2 CPU cores; its wall time is printed to the terminal.
                    It is marked `exclusive` (conftest): no other test runs while it does,
                    so the budget is measured on the 2 cores, not on one left by the other
                    xdist worker (that made it 1.6-2x slower: 186 s alone, 307-370 s in CI).
  llada_d2f.ipynb   runs against a tiny LLaDA-8B-Instruct stand-in and D2F adapter written in
                    the published layouts (tests/tiny_llada.py), at the notebook's own
                    published D2F settings except for the lengths. Its time is not checked, so
                    its kernel compiles with the tests' flags and the run's compilation cache
                    (conftest), like every other test subprocess.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import test_eval_harness
import tiny_llada
from conftest import xla_flags

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
QUICKSTART_LIMIT_S = 300.0
CELL_TIMEOUT_S = 600


def parameters_cell(nb) -> nbformat.NotebookNode:
  tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
  if len(tagged) != 1:
    raise AssertionError(f"expected exactly one cell tagged 'parameters', found {len(tagged)}")
  return tagged[0]


def inject_parameters(nb, overrides: dict) -> dict:
  """Replaces the parameters cell by its defaults updated with `overrides`; returns them."""
  cell = parameters_cell(nb)
  values: dict = {}
  exec(compile(cell.source, "<parameters cell>", "exec"), {}, values)  # pylint: disable=exec-used
  unknown = sorted(set(overrides) - set(values))
  if unknown:
    raise AssertionError(f"{unknown} are not parameters of this notebook; it has {sorted(values)}")
  values.update(overrides)
  cell.source = "# Parameters injected by tests/test_notebooks.py\n" + "\n".join(
      f"{name} = {value!r}" for name, value in values.items())
  return values


def kernel_env(timed: bool) -> dict:
  """The kernel's environment. A `timed` notebook compiles as on a user's runtime: XLA's
  default flags and no compilation cache; the others get the tests' compile flags and the
  run's cache (conftest)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
  if timed:
    env.pop("XLA_FLAGS", None)  # the notebook sets its own device count
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
      env.pop(name, None)
  else:
    env["XLA_FLAGS"] = xla_flags(1)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
  env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
  return env


def execute(name: str, overrides: dict, cwd: Path, *, timed: bool):
  """Runs notebook `name` in `cwd`; returns (executed notebook, wall seconds)."""
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  inject_parameters(nb, overrides)
  client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                          resources={"metadata": {"path": str(cwd)}})
  start = time.perf_counter()
  client.execute(env=kernel_env(timed))
  return nb, time.perf_counter() - start


def outputs_text(nb) -> str:
  """Every text output of every code cell (stdout, stderr, text/plain, text/markdown)."""
  parts = []
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      if out.output_type == "stream":
        parts.append(out.text)
      elif out.output_type in ("display_data", "execute_result"):
        for mime in ("text/markdown", "text/plain"):
          if mime in out.data:
            parts.append(out.data[mime])
  return "\n".join(parts)


def check_no_errors(nb):
  for i, cell in enumerate(nb.cells):
    if cell.cell_type != "code":
      continue
    assert cell.get("execution_count"), f"code cell {i} did not run"
    for out in cell.get("outputs", []):
      assert out.output_type != "error", f"cell {i}: {out.ename}: {out.evalue}"
      if out.output_type == "stream":
        assert "Traceback (most recent call last)" not in out.text, f"cell {i}:\n{out.text}"


def report_wall(name: str, wall: float, capsys, record_property):
  record_property(f"{name}_wall_s", round(wall, 1))
  with capsys.disabled():  # shown whatever pytest's capture setting (-q, -s, xdist)
    sys.stderr.write(f"\n[notebooks] {name} ran top to bottom in {wall:.1f} s\n")


def markdown_tables(nb) -> list[str]:
  return [out.data["text/markdown"] for cell in nb.cells for out in cell.get("outputs", [])
          if out.output_type == "display_data" and "text/markdown" in out.get("data", {})]


@pytest.mark.slow
@pytest.mark.exclusive  # its budget is "on 2 cores": not shared with the other xdist worker
def test_quickstart_runs_top_to_bottom_within_five_minutes(tmp_path, capsys, record_property):
  nb, wall = execute("quickstart.ipynb", {"WORKDIR": str(tmp_path / "quickstart")}, tmp_path,
                     timed=True)
  report_wall("quickstart.ipynb", wall, capsys, record_property)
  check_no_errors(nb)
  text = outputs_text(nb)
  answers, speed = markdown_tables(nb)
  for label in ("ar", "llada", "dream (entropy order)", "fast-dllm dual cache", "d2f",
                "block diffusion"):
    assert f"| {label} |" in answers or f" {label} |" in answers.splitlines()[0], label
    assert f"| {label} |" in speed, f"the speed table has no row for {label}:\n{speed}"
  for method in ("ar", "llada", "dream", "fast_dllm", "d2f", "block_diffusion"):
    assert f"| {method} |" in speed, method
  for column in ("accuracy", "tokens/s", "NFE/prompt", "tokens/forward"):
    assert column in speed.splitlines()[0], column
  assert any("image/png" in out.get("data", {}) for c in nb.cells for out in c.get("outputs", [])
             if out.output_type == "display_data"), "no Pareto plot was displayed"
  assert "step 1:" in text and "answer:" in text                      # the streamed answer
  assert "tokens equal one device's: True" in text                    # the mesh check
  assert "max |logits - float64 reference|" in text                   # the HF checkpoint
  assert (tmp_path / "quickstart" / "quickstart_pareto.png").stat().st_size > 10_000
  assert wall <= QUICKSTART_LIMIT_S, (
      f"quickstart.ipynb took {wall:.0f} s, over its {QUICKSTART_LIMIT_S:.0f} s budget on CPU: "
      "lower TRAIN_STEPS or the model size in the notebook")


@pytest.mark.slow
def test_llada_d2f_runs_on_a_tiny_checkpoint_in_the_published_layout(tmp_path, capsys,
                                                                      record_property):
  model = tiny_llada.write_llada_instruct(tmp_path / "LLaDA-8B-Instruct")
  adapter = tiny_llada.write_d2f_adapter(tmp_path / "D2F_LLaDA_LoRA")
  # Section 6's lm-eval run on a 4-question GSM8K-format task written here (no download).
  tasks = test_eval_harness.write_task(tmp_path / "tasks", test_eval_harness.questions(4))
  nb, wall = execute("llada_d2f.ipynb", {"MODEL_DIR": str(model), "ADAPTER_DIR": str(adapter),
                                         "DTYPE": "float32", "GEN_LENGTH": 64,
                                         "BLOCK_LENGTH": 16,
                                         "EVAL_TASKS": [test_eval_harness.TASK],
                                         "EVAL_INCLUDE_PATH": str(tasks), "EVAL_NUM_FEWSHOT": 0,
                                         "EVAL_LIMIT": 4}, tmp_path, timed=False)
  report_wall("llada_d2f.ipynb", wall, capsys, record_property)
  check_no_errors(nb)
  (table,) = markdown_tables(nb)
  rows = table.splitlines()[2:]
  assert [r.split("|")[1].strip() for r in rows] == [
      "LLaDA (vanilla)", "Fast-dLLM (dual cache)", "D2F"], table
  for column in ("tokens/s", "NFE", "tokens/forward", "vs LLaDA"):
    assert column in table.splitlines()[0], column
  nfe = {r.split("|")[1].strip(): int(r.split("|")[6]) for r in rows}
  assert all(n >= 1 for n in nfe.values()), nfe
  text = outputs_text(nb)
  assert "steps, " in text and "host round trip" in text             # the streamed answer
  assert "loaded with the adapter merged" in text
  assert f"{test_eval_harness.TASK} {{'exact_match,strict-match'" in text  # lm-eval's scores
  assert "D2F under lm-eval: " in text and "tokens per forward" in text
