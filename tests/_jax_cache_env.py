"""`compilation_cache_env()`: the environment variables that give a child Python process the
test process's persistent XLA compilation cache.

A CLI test in a fresh process compiles the same decode program the test process has usually
compiled already (the same model, shapes and options). When the session has a persistent
compilation cache (`jax_compilation_cache_dir`), passing it on lets the child load that
program instead of compiling it again; the child still imports, loads, decodes and prints for
real. Without a cache configured this returns {} and nothing changes.
"""

from __future__ import annotations

import sys

_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


def compilation_cache_env() -> dict[str, str]:
  """{JAX_COMPILATION_CACHE_DIR: ..., JAX_PERSISTENT_CACHE_MIN_*: ...} or {} (no cache)."""
  jax = sys.modules.get("jax")
  if jax is None or not jax.config.jax_compilation_cache_dir:
    return {}
  return {name.upper(): str(getattr(jax.config, name)) for name in _SETTINGS}
