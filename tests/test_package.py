"""`import dllm_jax` is cheap and reaches every subpackage the README names."""

import ast
import os
import subprocess
import sys

import dllm_jax
from conftest import REPO

SUBPACKAGES = ("checkpoints", "data", "decoding", "diffusion", "models", "parallel", "training")


def test_import_is_lazy_and_cheap():
  code = ("import sys, dllm_jax; print(dllm_jax.__version__); "
          "print(sorted(m for m in sys.modules if m.startswith(('jax', 'flax', 'dllm_jax.'))))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                       text=True, check=True).stdout.splitlines()
  assert out[0] == dllm_jax.__version__ and out[1] == "[]"  # nothing heavy until it is used


def test_subpackages_and_version():
  assert isinstance(dllm_jax.__version__, str) and dllm_jax.__version__[0].isdigit()
  for name in SUBPACKAGES:
    module = getattr(dllm_jax, name)
    assert module.__name__ == f"dllm_jax.{name}"
  assert set(SUBPACKAGES) <= set(dir(dllm_jax))
  assert callable(dllm_jax.parallel.mesh.make_mesh)
  assert callable(dllm_jax.training.checkpoint.load_params)
  assert dllm_jax.training.load_params is dllm_jax.training.checkpoint.load_params
  assert callable(dllm_jax.training.train)
  assert callable(dllm_jax.parallel.place_params)
  try:
    dllm_jax.trainer
  except AttributeError as e:
    assert "has no attribute 'trainer'" in str(e)
  else:
    raise AssertionError("dllm_jax.trainer should not exist")


def test_the_study_is_not_in_the_library():
  """The speed/quality study lives beside its scripts (experiments/studylib): dllm_jax/study is
  gone, `dllm_jax.study` is no attribute, and no module of the library imports the study or
  anything else from experiments/."""
  package = os.path.join(REPO, "dllm_jax")
  assert not os.path.exists(os.path.join(package, "study"))
  assert os.path.isfile(os.path.join(REPO, "experiments", "studylib", "__init__.py"))
  assert "study" not in dllm_jax.SUBPACKAGES and "study" not in dir(dllm_jax)
  try:
    dllm_jax.study
  except AttributeError:
    pass
  else:
    raise AssertionError("dllm_jax.study should not exist")
  offenders, checked = [], 0
  for root, _, files in os.walk(package):
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(root, name)
      with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
      checked += 1
      for node in ast.walk(tree):
        if isinstance(node, ast.Import):
          modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:  # `from M import a`: M, M.a
          modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
          continue
        offenders += [f"{os.path.relpath(path, REPO)}:{node.lineno}: {m}" for m in modules
                      if m.split(".")[0] in ("studylib", "experiments")
                      or m == "dllm_jax.study" or m.startswith("dllm_jax.study.")]
  assert checked > 50, checked  # the walk saw the library
  assert not offenders, offenders


def test_a_missing_extra_is_named_with_its_install(monkeypatch, capsys):
  """dllm_jax.eval / dllm_jax.serve without their extras: an ImportError naming the pip
  install; under `python -m` one `error:` line and exit status 2."""
  import pytest
  from dllm_jax import _extras
  monkeypatch.setattr(_extras.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ImportError, match=r"needs FastAPI, uvicorn: pip install 'dllm_jax\[serve\]'"):
    _extras.require("dllm_jax.serve", "serve", {"fastapi": "FastAPI", "uvicorn": "uvicorn"})
  monkeypatch.setattr(_extras.sys, "argv", ["-m"])
  with pytest.raises(SystemExit) as exit_info:
    _extras.require("dllm_jax.eval", "eval", {"lm_eval": "lm-evaluation-harness"})
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: dllm_jax.eval needs lm-evaluation")
  _extras.require("x", "y", {})  # nothing missing: nothing happens
