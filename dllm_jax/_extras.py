"""Optional dependencies (setup.cfg extras) checked where a subpackage needs them."""

from __future__ import annotations

import importlib.util
import sys


def require(package: str, extra: str, modules: dict[str, str]) -> None:
  """Raises ImportError naming the `pip install` that provides every missing module of
  `modules` ({import name: what it is}); under `python -m <package>` (the package's own
  command line) it exits with that one line instead of a traceback."""
  missing = [what for name, what in modules.items() if importlib.util.find_spec(name) is None]
  if not missing:
    return
  message = (f"{package} needs {', '.join(missing)}: pip install 'dllm_jax[{extra}]' (or "
             f"pip install -e '.[{extra}]' in a checkout).")
  if sys.argv[:1] == ["-m"]:  # still importing the package that `python -m` runs
    print("error: " + message, file=sys.stderr)
    sys.exit(2)
  raise ImportError(message)
