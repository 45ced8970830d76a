"""Keeps the leftovers of a failed orbax restore off the console and out of the log.

When one array of a checkpoint cannot be read, orbax's restore raises at once and closes its
asyncio event loop while tensorstore is still finishing the other reads. Each of those then
reports into the closed loop: a `RuntimeError: Event loop is closed` traceback printed from a
tensorstore thread, an `asyncio` "Task exception was never retrieved" record per failed
read, and, for a read coroutine that nothing awaits any more and that raises as the garbage
collector closes it, an "Exception ignored in: <coroutine object ...>" traceback: hundreds of
lines on a busy machine, printed after the one error that matters.

`read_only_notes()` also drops the three WARNING lines orbax logs whenever a checkpoint is
opened read-only (which `load_params` does by design).

`install()` adds a filter for exactly these kinds of output (a closed-loop RuntimeError
raised in `call_soon_threadsafe`; an asyncio record about an orbax/tensorstore task; an
unraisable exception of an orbax/tensorstore coroutine) to `sys.excepthook`,
`sys.unraisablehook`, `threading.excepthook` and the `asyncio` logger. The
checkpoint code installs it the first time a restore fails, for the rest of the process: the
reads may finish long after the error was raised. Everything else passes through unchanged.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import traceback

_installed = False


def is_closed_loop_noise(exc_type, exc, tb) -> bool:
  """A `RuntimeError('Event loop is closed')` raised inside `call_soon_threadsafe`."""
  if exc_type is not RuntimeError or str(exc) != "Event loop is closed":
    return False
  return any(frame.name == "call_soon_threadsafe" for frame in traceback.extract_tb(tb))


def _from_orbax(text: str) -> bool:
  return "orbax" in text or "tensorstore" in text


def is_abandoned_read(unraisable) -> bool:
  """An unraisable exception of a coroutine defined in orbax or tensorstore (a read of a
  failed restore, raising as it is closed unawaited): `sys.unraisablehook`'s argument."""
  code = getattr(unraisable.object, "cr_code", None)
  return code is not None and _from_orbax(code.co_filename)


class AsyncioNoiseFilter(logging.Filter):
  """Drops asyncio's never-retrieved-exception records of orbax / tensorstore tasks."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if "exception was never retrieved" not in message:
      return True
    text = message
    if record.exc_info and record.exc_info[2] is not None:
      text += "".join(traceback.format_tb(record.exc_info[2]))
    return not _from_orbax(text)


def install() -> None:
  """Installs the filters (idempotent) and collects the failed read tasks under them."""
  global _installed
  if not _installed:
    _installed = True
    logging.getLogger("asyncio").addFilter(AsyncioNoiseFilter())

    excepthook = sys.excepthook

    def quiet_excepthook(exc_type, exc, tb):
      if not is_closed_loop_noise(exc_type, exc, tb):
        excepthook(exc_type, exc, tb)

    unraisablehook = sys.unraisablehook

    def quiet_unraisablehook(unraisable):
      if not (is_closed_loop_noise(unraisable.exc_type, unraisable.exc_value,
                                   unraisable.exc_traceback) or is_abandoned_read(unraisable)):
        unraisablehook(unraisable)

    thread_hook = threading.excepthook

    def quiet_thread_hook(args):
      if not is_closed_loop_noise(args.exc_type, args.exc_value, args.exc_traceback):
        thread_hook(args)

    sys.excepthook = quiet_excepthook
    sys.unraisablehook = quiet_unraisablehook
    threading.excepthook = quiet_thread_hook
  gc.collect()  # unretrieved task exceptions are reported when their tasks are collected


class _ReadOnlyNotes(logging.Filter):
  _PREFIXES = ("CheckpointManagerOptions.read_only=True", "Given directory is read only")

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(self._PREFIXES)


@contextlib.contextmanager
def read_only_notes():
  """While active, orbax's notes about opening a checkpoint read-only are dropped."""
  logger, note_filter = logging.getLogger("absl"), _ReadOnlyNotes()
  logger.addFilter(note_filter)
  try:
    yield
  finally:
    logger.removeFilter(note_filter)
