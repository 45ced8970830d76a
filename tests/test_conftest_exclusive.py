"""conftest's `exclusive` marker: under two xdist workers, no test overlaps an exclusive one.

A small suite runs in a subprocess on two workers: one file holds an exclusive test, the other
a stream of short tests; every test records when it ran. Without the lock the short tests run
beside the exclusive one (checked: the same suite without the hook overlaps).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("dllm_conftest", {str(TESTS / "conftest.py")!r})
dllm_conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dllm_conftest)
HOOKED = True
if HOOKED:
  pytest_runtest_protocol = dllm_conftest.pytest_runtest_protocol
"""

RECORD = """
import json, os, time
import pytest

def record(name, seconds):
  start = time.time()
  time.sleep(seconds)
  with open(os.environ["SPANS"], "a") as f:
    f.write(json.dumps([name, start, time.time()]) + "\\n")
"""


def run_suite(tmp_path: Path, hooked: bool) -> list:
  tmp_path.mkdir()
  (tmp_path / "conftest.py").write_text(CONFTEST.replace("HOOKED = True", f"HOOKED = {hooked}"))
  (tmp_path / "test_a_exclusive.py").write_text(RECORD + textwrap.dedent("""
      def test_short_first():
        record("a0", 0.2)

      @pytest.mark.exclusive
      def test_exclusive():
        record("exclusive", 1.5)
      """))
  (tmp_path / "test_b_stream.py").write_text(RECORD + "\n".join(
      f"def test_{i}():\n  record('b{i}', 0.25)\n" for i in range(12)))
  spans = tmp_path / "spans.jsonl"
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
       "--dist", "loadfile", "-W", "ignore::pytest.PytestUnknownMarkWarning",
       # its own base temp: pytest's numbered ones under /tmp are pruned by count
       f"--basetemp={tmp_path / 'basetemp'}", str(tmp_path)],
      cwd=tmp_path, capture_output=True, text=True, timeout=300,
      env={**os.environ, "SPANS": str(spans)})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return [json.loads(line) for line in spans.read_text().splitlines()]


def overlapping(spans: list) -> list:
  (_, start, end), = [s for s in spans if s[0] == "exclusive"]
  return [name for name, s, e in spans if name != "exclusive" and s < end and e > start]


def test_no_test_runs_beside_an_exclusive_one(tmp_path):
  spans = run_suite(tmp_path / "hooked", hooked=True)
  assert len(spans) == 14
  assert overlapping(spans) == [], spans


def test_without_the_lock_the_stream_overlaps(tmp_path):
  """The check above can fail: the same suite without the hook runs tests beside it."""
  assert overlapping(run_suite(tmp_path / "plain", hooked=False))
