"""`env_without_jax(tmp_path)`: an environment in which importing JAX fails.

A command that must report a mistake before it loads JAX (a config typo, a mistyped CLI flag)
is run in a subprocess with this environment: a `jax` package first on PYTHONPATH whose
import raises. What runs to its end there never imported JAX.
"""

from __future__ import annotations

import os


def env_without_jax(tmp_path) -> dict[str, str]:
  """os.environ plus JAX_PLATFORMS=cpu and a PYTHONPATH led by a `jax` that cannot import."""
  poison = tmp_path / "no_jax" / "jax"
  poison.mkdir(parents=True, exist_ok=True)
  (poison / "__init__.py").write_text("raise ImportError('jax was imported')\n")
  path = os.pathsep.join(filter(None, [str(poison.parent), os.environ.get("PYTHONPATH")]))
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
