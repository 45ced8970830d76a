"""`import dllm_jax` is cheap and reaches every subpackage the README names."""

import subprocess
import sys

import dllm_jax
from conftest import REPO

SUBPACKAGES = ("checkpoints", "data", "decoding", "diffusion", "models", "parallel", "study",
               "training")


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
