"""A persistent XLA compilation cache under the study's workdir.

A rerun of the study, to finish an interrupted run or to print a finished one's report again,
compiles the same programs as the first run did: every model's train and eval steps and every
cell's decode loop, even when every model is cached and the journal replays every decoding
round. With `enable(workdir)` the first run writes each compiled program to
`<workdir>/xla_cache/` and later runs load it instead of compiling.

The cache cannot change a figure. JAX keys an entry by the program's HLO, the compile
options, the XLA flags and the jax/jaxlib versions, so a changed model, option or flag is a
miss and compiles as usual. Timed decoding never includes a compile: runner.py times each cell
after an untimed first call, whose time (`compile_s` in study.json) is a load from disk on a
rerun.

The cache is a property of the process (JAX reads its directory at the first compile), so
the study's script turns it on, not `study.run`. A directory the user already chose
(`JAX_COMPILATION_CACHE_DIR`, or `jax_compilation_cache_dir` set before) wins, and the study
shares it. JAX trusts its cache, so keep the workdir somewhere only you can write.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

DIR_NAME = "xla_cache"
# Where a user sets JAX's threshold: by default JAX caches only programs that took over 1 s to
# compile, and many of the study's decode loops compile in less (loading any of them is
# faster than compiling it), so without this variable `enable` caches every program.
MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def enable(workdir) -> str:
  """Points JAX's persistent compilation cache at `<workdir>/xla_cache`, unless a cache
  directory is already set; returns the directory in use.

  Nothing is written until the first compile, so a command refused before it compiles
  leaves no workdir behind. Caches every program, however fast it compiled, unless
  $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise. Call it before the process
  compiles anything: JAX fixes the directory at its first compile.
  """
  chosen = jax.config.jax_compilation_cache_dir
  if chosen:
    return chosen
  path = Path(workdir) / DIR_NAME
  jax.config.update("jax_compilation_cache_dir", str(path))
  if MIN_COMPILE_TIME_ENV not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return str(path)
