"""Write a directory atomically: build it next to the target, then rename it into place.

A failure (exception, Ctrl-C) while writing removes the partial directory, so a converted or
exported checkpoint is either complete or absent. An existing target is replaced only with
`overwrite=True`, and then only after the new one is complete.

The temporary name is deterministic (`.<name>.partial`) so that every process of a multi-host
job writes to the same place; process 0 does the renames, then all processes synchronise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import jax


def _sync(tag: str):
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(tag)


@contextlib.contextmanager
def atomic_directory(target, overwrite: bool = False):
  """Yields an empty temporary directory that becomes `target` when the block succeeds."""
  target = Path(target).absolute()
  if target.exists() and not overwrite:
    raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it.")
  tmp = target.with_name(f".{target.name}.partial")
  old = target.with_name(f".{target.name}.old")
  lead = jax.process_index() == 0
  if lead:
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in (tmp, old):  # left by a crash of an earlier run
      shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
  _sync(f"atomic_directory:start:{target}")
  try:
    yield tmp
    _sync(f"atomic_directory:written:{target}")
  except BaseException:
    if lead:
      shutil.rmtree(tmp, ignore_errors=True)
    raise
  if lead:
    if target.exists():
      os.rename(target, old)
      os.rename(tmp, target)
      shutil.rmtree(old)
    else:
      os.rename(tmp, target)
  _sync(f"atomic_directory:done:{target}")
