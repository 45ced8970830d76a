"""The filters for orbax/tensorstore's after-failure noise drop exactly that noise."""

import asyncio
import logging
import sys
import types

import pytest

from dllm_jax.training import quiet


def _closed_loop_error():
  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(print)
  except RuntimeError:
    return sys.exc_info()
  raise AssertionError("a closed loop accepted a callback")


def test_closed_loop_tracebacks_are_dropped_and_others_kept(capsys):
  quiet.install()
  sys.excepthook(*_closed_loop_error())
  assert capsys.readouterr().err == ""
  try:
    raise RuntimeError("Event loop is closed")  # same text, not from call_soon_threadsafe
  except RuntimeError:
    sys.excepthook(*sys.exc_info())
  assert "Event loop is closed" in capsys.readouterr().err
  assert quiet.is_closed_loop_noise(*_closed_loop_error())


def _unraisable_of_coroutine(filename):
  """sys.unraisablehook's argument for a coroutine defined in `filename` that raised."""
  namespace = {}
  code = compile("async def read():\n  pass\n", filename, "exec")
  exec(code, namespace)  # pylint: disable=exec-used
  error = ValueError("OUT_OF_RANGE: Error reading array")
  return types.SimpleNamespace(object=namespace["read"](), exc_type=ValueError, exc_value=error,
                               exc_traceback=None, err_msg=None)


@pytest.mark.parametrize("filename,dropped", [
    ("/x/orbax/checkpoint/_src/serialization/serialization.py", True),
    ("/x/tensorstore/__init__.py", True),
    ("/home/me/my_job.py", False),
])
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_unraisables_of_orbax_coroutines_are_dropped(filename, dropped):
  """A read coroutine of a failed orbax restore raising as it is closed unawaited: dropped by
  the installed hook (pytest's own hook behind it turns what it receives into a warning,
  an error here); any other coroutine's unraisable exception is passed on."""
  quiet.install()
  unraisable = _unraisable_of_coroutine(filename)
  try:
    assert quiet.is_abandoned_read(unraisable) is dropped
    assert not quiet.is_abandoned_read(types.SimpleNamespace(object=print))
    if dropped:
      sys.unraisablehook(unraisable)
  finally:
    unraisable.object.close()


@pytest.mark.parametrize("message,kept", [
    ("Task exception was never retrieved\nfuture: <Task finished coro=<async_deserialize() "
     "defined at /x/orbax/checkpoint/_src/serialization/serialization.py:394>>", False),
    ("Task exception was never retrieved\nfuture: <Task finished coro=<my_job()>>", True),
    ("Exception in callback orbax_thing()", True),
])
def test_asyncio_records_of_orbax_tasks_are_dropped(message, kept):
  record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)
  assert quiet.AsyncioNoiseFilter().filter(record) is kept


def test_read_only_notes_are_dropped_only_inside_the_context(caplog):
  logger = logging.getLogger("absl")
  with caplog.at_level(logging.WARNING, logger="absl"):
    with quiet.read_only_notes():
      logger.warning("Given directory is read only=%s", "/x")
      logger.warning("something else")
    logger.warning("Given directory is read only=%s", "/y")
  assert [r.getMessage() for r in caplog.records] == [
      "something else", "Given directory is read only=/y"]
