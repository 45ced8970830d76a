"""The `--config` flag of the experiments scripts: its file found from any directory, and a
bad override as one line.

    _CONFIG = _config_args.define("configs/x.py", "help")   # instead of DEFINE_config_file
    _config_args.run(main)                                  # instead of absl's app.run

A config path that exists relative to the working directory is used as given; otherwise
`configs/...` is this repository's, so the scripts run from any directory. A config file
found in neither place, or a `--config.key=value` override naming no key of the config, ends
the script with one line saying so (exit 1), where ml_collections would print a traceback.
`run` also keeps absl's log at WARNING unless `--verbosity` is given: at absl's default
(INFO) orbax logs every checkpoint read and write, about 170 lines in a study run.

The configs import no JAX, and the scripts import the package's JAX modules inside `main`, so
a bad flag, config file or override is reported in about a second, before JAX loads (which
takes several seconds).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fail(message: str):
  sys.exit(f"{os.path.basename(sys.argv[0])}: {message}")


def resolve(path: str) -> str:
  """`path` (optionally `file.py:argument`) as given if its file exists, else under REPO."""
  file = path.split(":")[0]
  if os.path.exists(file):
    return path
  if not os.path.isabs(file) and os.path.exists(os.path.join(REPO, file)):
    return os.path.join(REPO, path)
  _fail(f"config file {file!r} not found (a path relative to the working directory, or "
        "configs/... of this repository).")


def resolve_argv(argv: list[str]) -> list[str]:
  """argv with the file of `--config=F` / `--config F` resolved (see `resolve`)."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith("--config="):
      out[i] = "--config=" + resolve(arg.removeprefix("--config="))
    elif arg == "--config" and i + 1 < len(out):
      out[i + 1] = resolve(out[i + 1])
  return out


def define(default: str | None, help_string: str, **kwargs):
  """`config_flags.DEFINE_config_file("config", ...)` with sys.argv's config file resolved.

  The flag loads the config and registers the `--config.*` overrides here, at definition,
  so an override of a key the config lacks fails here (AttributeError/KeyError carrying
  ml_collections' "Did you mean" hint): it becomes one line.
  """
  sys.argv = resolve_argv(sys.argv)
  try:
    return config_flags.DEFINE_config_file(
        "config", None if default is None else resolve(default), help_string, **kwargs)
  except (AttributeError, KeyError) as e:
    _bad_override(e)


def _bad_override(e: Exception):
  hint = str(e.args[0] if e.args else e).replace("\\n", " ").replace("\n", " ")
  hint = " ".join(hint.replace("\\'", "'").strip("\"'").split()).replace("'", "")
  _fail(f"a --config override names no key of the config: {hint}")


def run(main) -> None:
  """`app.run(main)`; a config file given on the command line is loaded, and its overrides
  applied, while absl parses the flags, so an override of a key it lacks fails there (before
  `main`): that becomes one line. Errors raised once `main` runs propagate unchanged. The log
  stays at WARNING unless `--verbosity` (`-v`) is passed: `--verbosity=0` for absl's INFO log."""
  started = False

  def wrapped(argv):
    nonlocal started
    started = True
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint read/write at INFO
    return main(argv)

  try:
    app.run(wrapped)
  except (AttributeError, KeyError) as e:
    if started:
      raise
    _bad_override(e)
