"""Checked options, built once per distinct option set.

A decode call checks its options (every field's type and range, a hybrid's task map) and
splits them into the static part (the jit key) and the traced [] arrays. At a small model a
batch-1 decode is a few hundred microseconds, and doing both on every call is a measurable
share of it (the adaptive decoder's plan cost ~20 us a call, AR's ~8). `checked` keeps the
result per distinct option set.

The key is strict: every value with its type (so 1, 1.0 and True, which compare equal, are
three keys) and floats by their repr (0.0 and -0.0 differ; NaN, never equal to itself, is
always rebuilt). Mappings and sequences key by their items in order. A set holding a value
with no hash (an array: a traced sweep's value) is rebuilt on every call, as is any set
whose check fails (the error is raised each time). Options dataclasses are frozen, so a
cached instance is shared safely; the traced dict is copied per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

MAX_ENTRIES = 512
_NO_KEY = object()
_entries: dict = {}
_lock = threading.Lock()


_EXACT = (int, bool, str, type(None))


def _frozen(value):
  """A hashable stand-in that tells apart what `==` conflates, or _NO_KEY."""
  kind = type(value)
  if kind in _EXACT:
    return kind, value
  if kind is float:
    return kind, repr(value)
  if isinstance(value, Mapping):
    items = tuple((_frozen(k), _frozen(v)) for k, v in value.items())
    return _NO_KEY if any(_NO_KEY in item for item in items) else (Mapping, items)
  if isinstance(value, (list, tuple)):
    items = tuple(_frozen(v) for v in value)
    return _NO_KEY if _NO_KEY in items else (type(value), items)
  try:
    hash(value)
  except TypeError:
    return _NO_KEY
  if isinstance(value, float) or type(value).__name__.startswith(("float", "complex")):
    return type(value), repr(value)
  return type(value), value


def key(options: Mapping):
  """The strict cache key of an options dict, or None when a value has no hash."""
  items = tuple((name, _frozen(value)) for name, value in sorted(options.items()))
  return None if any(f is _NO_KEY for _, f in items) else items


def checked(cls, options: Mapping, build: Callable, split: Callable):
  """(opts, static, traced) of `options`: `opts = build(cls, options)` (which checks them,
  raising ValueError naming the fix) and `static, traced = split(opts)`, computed once per
  distinct option set; the traced dict is a fresh copy."""
  k = key(options)
  entry = None if k is None else _entries.get((cls, split, k))
  if entry is None:
    opts = build(cls, dict(options))
    entry = (opts, *split(opts))
    if k is not None:
      with _lock:
        while len(_entries) >= MAX_ENTRIES:
          _entries.pop(next(iter(_entries)))
        _entries[(cls, split, k)] = entry
  opts, static, traced = entry
  return opts, static, dict(traced)


def clear() -> None:
  """Forgets every cached option set."""
  with _lock:
    _entries.clear()
