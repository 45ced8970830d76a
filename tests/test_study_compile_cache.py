"""The study's persistent compilation cache (experiments/studylib/compile_cache.py).

Each check runs in a fresh interpreter without the test run's shared cache
($JAX_COMPILATION_CACHE_DIR and its threshold, conftest.py), since JAX fixes its cache
directory at the first compile of a process. The study itself is replaced by a stand-in that
compiles one program and counts JAX's cache misses (compiled) and hits (loaded from disk), so
what is tested is the script's wiring and the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from conftest import REPO, xla_flags

# experiments/study.py, run as `python experiments/study.py --workdir W`, with study.run
# replaced by a stand-in that compiles one program and prints what the process saw.
SCRIPT_WITH_STAND_IN = """
import json, runpy, sys
import numpy as np
sys.path.insert(0, "experiments")
from studylib import study

def stand_in(config, workdir, log=print):
  import jax, jax.numpy as jnp
  events = []
  jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
  jax.jit(lambda x: jnp.tanh(x) * 3 + 1)(np.arange(7.0)).block_until_ready()
  print(json.dumps({"cache_dir": jax.config.jax_compilation_cache_dir,
                    "misses": events.count("/jax/compilation_cache/cache_misses"),
                    "hits": events.count("/jax/compilation_cache/cache_hits")}))

study.run = stand_in
sys.argv = ["experiments/study.py", "--workdir", sys.argv[1]]
runpy.run_path("experiments/study.py", run_name="__main__")
"""


def without_test_cache() -> dict:
  """os.environ less the test run's shared cache and its threshold: what a user's shell has."""
  return {k: v for k, v in os.environ.items()
          if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}


def run_script(workdir, **env_extra) -> dict:
  env = without_test_cache()
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), **env_extra)
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT_WITH_STAND_IN),
                         str(workdir)], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_study_script_caches_its_programs_in_the_workdir_and_a_rerun_loads_them(tmp_path):
  workdir = tmp_path / "w"
  first = run_script(workdir)
  assert first["cache_dir"] == str(workdir / "xla_cache")
  assert (first["misses"], first["hits"]) == (1, 0)
  entries = sorted(p.name for p in (workdir / "xla_cache").iterdir())
  assert entries, "the first run wrote nothing to the cache"
  second = run_script(workdir)
  assert (second["misses"], second["hits"]) == (0, 1), "the rerun compiled instead of loading"
  assert sorted(p.name for p in (workdir / "xla_cache").iterdir()) == entries


def test_a_cache_directory_the_user_chose_wins(tmp_path):
  chosen = tmp_path / "mine"
  seen = run_script(tmp_path / "w", JAX_COMPILATION_CACHE_DIR=str(chosen),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  assert seen["cache_dir"] == str(chosen) and (seen["misses"], seen["hits"]) == (1, 0)
  assert any(chosen.iterdir()) and not (tmp_path / "w" / "xla_cache").exists()


def test_a_refused_study_command_leaves_no_workdir_with_the_cache_on(tmp_path):
  """The cache directory appears at the first compile, not when the script starts."""
  proc = subprocess.run([sys.executable, "experiments/study.py", "--config.data.eval_size=100",
                         f"--workdir={tmp_path}/w"], cwd=REPO, capture_output=True, text=True,
                        timeout=300, env=dict(without_test_cache(), JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0 and "Traceback" not in proc.stderr
  assert "data.eval_size=100" in proc.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "w").exists()
