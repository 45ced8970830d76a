"""Shared fixtures.

`run_devices(code, devices=8)` runs a Python snippet in a fresh interpreter whose JAX sees
`devices` fake CPU devices (XLA_FLAGS is read once, at import, so multi-device tests need
their own process). It returns the snippet's stdout and fails the test with its stderr.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The study is not part of the library: its modules are the package experiments/studylib,
# which `python experiments/<script>.py` finds beside the script. The tests of the study, and
# the configs that import it (configs/study.py, scaling.py, ...), find it through this entry,
# appended so that no installed module is shadowed by a script's name. Subprocess snippets
# that import it put "experiments" on their own path.
EXPERIMENTS = os.path.join(REPO, "experiments")
if EXPERIMENTS not in sys.path:
  sys.path.append(EXPERIMENTS)

# The tests compile hundreds of tiny programs and run each a few times, so LLVM's optimisation
# of the generated CPU code costs far more than it saves: at backend optimisation level 0 a D2F
# test file takes half the CPU time (the same HLO; only the machine code is less optimised).
# Set before JAX starts in this process and inherited by the subprocesses tests start; the
# timed notebook and the demo build run at the default level, as a user's would.
#
# At level 0, XLA's older LLVM-IR fusion emitters (`--xla_cpu_use_fusion_emitters=false`)
# compile a tiny decode loop about 3x faster than the default MLIR fusion emitters (measured:
# 42 -> 13 s of backend compile for 12 decode programs; 164 -> 107 CPU-s on three decoding
# and training test files). Both emit the same HLO's semantics; the tests compare runs made
# under the same flags, or against references with tolerances, so the results stand.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if "jax" not in sys.modules and TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

# Files that take minutes, started first so that pytest-xdist's two workers (setup.cfg's
# addopts: `--dist loadfile --no-loadscope-reorder` hands files out in this order) finish
# together instead of one running the last long file alone.
LONG_FILES = (
    "test_notebooks.py", "test_serving_engine.py", "test_readme.py", "test_decoding_contract.py",
    "test_decoding_d2f.py", "test_decoding_multidevice.py", "test_demo.py", "test_sampler.py",
    "test_decoding_data_parallel.py", "test_serving_rows.py", "test_study.py",
    "test_decoding_multihost.py", "test_decoding_buckets.py", "test_decoding_d2f_window.py",
    "test_models.py", "test_decoding_speculative.py")


def pytest_configure(config):
  """One persistent XLA compilation cache for the whole run (the xdist workers and every
  subprocess a test starts inherit the variable): a program compiled by one worker, module
  or subprocess is loaded, not compiled again, by the others. Timed notebook runs and tests
  that count compiles opt out (`no_compile_cache`)."""
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile
    config._dllm_jax_cache_dir = tempfile.mkdtemp(prefix="dllm_jax_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = config._dllm_jax_cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_unconfigure(config):
  made = getattr(config, "_dllm_jax_cache_dir", None)
  if made:  # the process that made the cache (the xdist controller) removes it
    import shutil
    shutil.rmtree(made, ignore_errors=True)
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


def _machine_lock_dir(config) -> str:
  """A directory every xdist worker of this run sees (the controller's base temp's parent)."""
  base = config._tmp_path_factory.getbasetemp()
  return str(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Tests marked `exclusive` run with the machine to themselves: a test that times itself
  against a budget "on 2 cores" (the quickstart notebook) must not share them with the other
  xdist worker. Every other test holds a shared lock from its setup to its teardown (module
  and session fixtures included); an exclusive one takes the lock exclusively, so it starts
  once the other worker's current test ends and that worker waits until it is done. New
  shared holders pass a turnstile that the exclusive test holds while it waits, so a
  stream of short tests cannot starve it."""
  import fcntl
  root = _machine_lock_dir(item.config)
  exclusive = item.get_closest_marker("exclusive") is not None
  with open(os.path.join(root, "dllm_jax_machine.turnstile"), "a") as turnstile, \
       open(os.path.join(root, "dllm_jax_machine.lock"), "a") as lock:
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
      fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    finally:
      if not exclusive:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
      if exclusive:
        fcntl.flock(turnstile, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONG_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable otherwise


@pytest.fixture
def no_compile_cache():
  """Turns the persistent compilation cache off for one test that counts compiles, so that
  each counted event is a compile. (In jax 0.10 the backend-compile event wraps the cache
  lookup, so a load from disk is counted too; JAX's own cache_hits/cache_misses events tell
  the two apart, see test_study_compile_cache.py.)"""
  import jax
  saved = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", saved)


@contextlib.contextmanager
def backend_compiles():
  """Collects one entry per XLA backend compile run while the block runs (a list)."""
  import jax
  from jax._src import dispatch
  compiles = []

  def listen(event, duration, **kw):
    if event == dispatch.BACKEND_COMPILE_EVENT:
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def xla_flags(devices: int = 1) -> str:
  """XLA_FLAGS for a test subprocess: `devices` fake CPU devices and the test compile flags."""
  return f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}"


def run_python(code: str, devices: int = 8, timeout: float = 600.0, xla_extra: str = "") -> str:
  """Runs `code` with `devices` fake CPU devices (and `xla_extra` XLA flags); returns stdout,
  raises with stderr."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{xla_flags(devices)} {xla_extra}")
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)
  if proc.returncode:
    raise AssertionError(f"subprocess exited with {proc.returncode}\n--- stdout ---\n"
                         f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
  return proc.stdout


@pytest.fixture
def run_devices():
  """The `run_python` helper (see the module docstring)."""
  return run_python


def tiny_training_config(objective: str = "ar", init_from: str | None = None, **options):
  """A seconds-sized training config: tiny model, 2-digit addition, 1 CPU device.

  `options` are the objective's; a D2F student (init_from = a run to distil) gets LoRA.
  """
  from dllm_jax.training import config as config_lib
  c = config_lib.base_config()
  c.model.preset = "tiny"
  c.data.tasks = "arithmetic:1"
  c.data.train_size, c.data.eval_size = 4096, 64
  c.objective.name = objective
  c.objective.options = options
  if objective in ("block_diffusion", "d2f"):
    c.data.block_size = options.get("block_size")
  if objective == "d2f":
    c.model.lora_rank, c.model.lora_alpha = 4, 4.0
    c.opt.trainable = "lora"
  c.train.init_from = init_from
  c.opt.lr, c.opt.warmup_steps, c.opt.schedule = 1e-2, 2, "constant"  # HLO independent of steps
  c.train.steps, c.train.batch_size = 6, 16
  c.train.log_every, c.train.eval_every, c.train.eval_batches = 1, 0, 1
  c.train.ckpt_every, c.train.keep = 2, 3
  c.mesh.shape = {"data": 1}
  return config_lib.finalize(c)


@pytest.fixture(scope="session")
def tiny_config():
  """`tiny_training_config(objective="ar", **objective_options)` (a locked ConfigDict)."""
  return tiny_training_config


@pytest.fixture(scope="session")
def _compile_cache_dir(tmp_path_factory):
  """The run's persistent cache (pytest_configure) when there is one, else a fresh one."""
  return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="module")
def compile_cache(_compile_cache_dir):
  """Persistent XLA compilation cache while a module runs (use via `usefixtures`): a step
  compiled again, e.g. by a resumed run, loads from disk instead of recompiling."""
  import jax
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  saved = {n: getattr(jax.config, n) for n in names}
  for name, value in zip(names, (_compile_cache_dir, 0, 0)):
    jax.config.update(name, value)
  yield _compile_cache_dir
  for name, value in saved.items():
    jax.config.update(name, value)


@pytest.fixture(scope="session")
def demo_cache(request):
  """$DLLM_JAX_CACHE pointing at a session cache holding the built demo (one build).

  Under pytest-xdist the workers share one cache (the run's shared temp directory); a file
  lock makes the first worker build it while the others wait, instead of each training the
  demo again.
  """
  import fcntl
  from dllm_jax import demo
  base = Path(_machine_lock_dir(request.config))
  root = base / "dllm_jax_cache"
  saved = os.environ.get(demo.CACHE_ENV)
  os.environ[demo.CACHE_ENV] = str(root)
  with open(base / "dllm_jax_cache.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not demo.is_built(demo.demo_dir()):  # trained at the default XLA level, as a user's
      env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(
          TEST_XLA_FLAGS, "").strip())
      proc = subprocess.run([sys.executable, "-c", "from dllm_jax import demo; demo.ensure()"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
      if proc.returncode:
        raise AssertionError(f"building the demo failed:\n{proc.stderr[-6000:]}")
  yield root
  if saved is None:
    os.environ.pop(demo.CACHE_ENV, None)
  else:
    os.environ[demo.CACHE_ENV] = saved


@pytest.fixture(scope="session")
def run_cache(request):
  """`run_cache(key, build)`: build()'s result, computed once per test run and shared by every
  xdist worker (a pickle under the run's shared temp directory; a file lock makes the first
  worker build it while the others wait). For deterministic, expensive setup that several
  files repeat, e.g. a tiny model trained for a few hundred steps: a loaded result is the
  pickled one, so the first caller gets exactly what the others load (build it as host
  numpy arrays)."""
  import fcntl
  import pickle
  root = os.path.join(_machine_lock_dir(request.config), "dllm_jax_run_cache")
  os.makedirs(root, exist_ok=True)

  def get(key: str, build):
    path = os.path.join(root, key)
    with open(path + ".lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      if not os.path.exists(path):
        with open(path + ".tmp", "wb") as f:
          pickle.dump(build(), f)
        os.replace(path + ".tmp", path)
    with open(path, "rb") as f:
      return pickle.load(f)

  return get


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
  """Drops JAX's compiled programs after each test module.

  A few hundred modules' worth of executables kept alive in one process made XLA:CPU crash
  while compiling (a segfault inside `backend_compile_and_load`, at the same test every run);
  programs are rarely shared between modules, so this costs almost no recompiles.
  """
  yield
  if "jax" in sys.modules:
    sys.modules["jax"].clear_caches()
