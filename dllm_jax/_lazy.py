"""Attributes of a package that load on first use (PEP 562), so importing it stays cheap.

    __getattr__, __dir__ = _lazy.attach(__name__, {"Transformer": "transformer", "mesh": None})

maps each name to the submodule that defines it (None: the name is that submodule). With
`submodules=True` any other submodule is an attribute too (`decoding.sampling`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys


def attach(package: str, names: dict[str, str | None], submodules: bool = False):
  """(__getattr__, __dir__) for `package`; a loaded name is cached in its globals."""

  def __getattr__(name: str):
    if name in names:
      module = importlib.import_module(f"{package}.{names[name] or name}")
      value = module if names[name] is None else getattr(module, name)
    elif (submodules and not name.startswith("_")
          and importlib.util.find_spec(f"{package}.{name}") is not None):
      value = importlib.import_module(f"{package}.{name}")
    else:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    setattr(sys.modules[package], name, value)
    return value

  def __dir__() -> list[str]:
    return sorted(set(vars(sys.modules[package])) | set(names))

  return __getattr__, __dir__
