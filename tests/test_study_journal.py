"""The decode journal (studylib/journal.py): an interrupted study's timed rounds are replayed, not
decoded again, and only when the cells, params, prompts, seed and repeats are the same."""

import json

import numpy as np
import pytest

from dllm_jax.data.tasks import Example, TaskSuite
from studylib import journal as journal_lib
from studylib import runner
from tests.test_study import RowIndexLayout, answered

SUITE = TaskSuite.parse("arithmetic:1")
EXAMPLES = [Example(f"{i}+1=", str(i + 1), str(i + 1), "arithmetic") for i in range(7)]


class Interrupted(Exception):
  pass


def _cells(calls, offsets=(1, 2), params=None):
  """Cells answering prompt i with i + offset (offset 1 is right), logging (label, first row)."""

  def decoder(label, offset):
    def decode(params, tokens, valid, rng):
      calls.append((label, int(tokens[0, 0])))
      return answered(tokens, offset)
    return decode

  params = {"w": np.arange(4.0)} if params is None else params
  return [runner.Cell(decoder(f"c{offset}", offset), params, "ar", f"c{offset}", {"k": 2}, 2)
          for offset in offsets]


def _run(cells, journal=None, on_batch=None, **kw):
  return runner.run_cells(cells, layout=RowIndexLayout(), suite=SUITE, examples=EXAMPLES,
                          prompt_len=3, journal=journal, on_batch=on_batch, **kw)


DRAFTER = {"drafter": ({"w": np.ones(3)}, "cfg d=3")}  # a model a hybrid closes over


def _open(path, cells, repeats=1, examples=EXAMPLES, models=DRAFTER):
  return journal_lib.Journal(path, runner.fingerprint(cells, examples, 3, 0, repeats, models),
                             len(cells))


def _counts(result):
  return (result.num_prompts, result.num_correct, result.response_tokens, result.nfe,
          result.loop_steps, result.per_task)


def test_an_interrupted_decode_resumes_from_its_complete_rounds(tmp_path):
  """Seven prompts at batch 2 are four rounds of two cells. Killed inside round 2 (round 0
  and 1 whole, round 2's first cell done), the rerun replays rounds 0-1 from the journal and
  decodes round 2 again for both cells (side by side) and round 3: the tallies equal an
  uninterrupted run's, and the replayed rounds keep the walls they were timed with."""
  path = tmp_path / "j" / "batch2.jsonl"
  whole = _run(_cells([]))

  calls = []
  ticks = []

  def kill_in_round_2():
    ticks.append(1)
    if len(ticks) == 5:  # (round, cell) = (2, 0) is recorded, then the process dies
      raise Interrupted
  with pytest.raises(Interrupted), _open(path, _cells(calls)) as book:
    assert book.restored == {}
    _run(_cells(calls), journal=book, on_batch=kill_in_round_2)
  lines = path.read_text().splitlines()
  assert json.loads(lines[0]).keys() == {"fingerprint"} and len(lines) == 1 + 5
  first_walls = {}  # cell -> its walls in rounds 0-1 (the rounds rotate the cells' order)
  for line in map(json.loads, lines[1:5]):
    first_walls.setdefault(line["cell"], []).append(line["add"]["wall_s"])

  calls.clear()
  progress = []
  with _open(path, _cells(calls)) as book:
    assert sorted(book.restored) == [0, 1]
    resumed = _run(_cells(calls), journal=book, on_batch=lambda: progress.append(1))
  compile_calls, decoded = calls[:2], calls[2:]
  assert compile_calls == [("c1", 0), ("c2", 0)]
  assert decoded == [("c1", 4), ("c2", 4), ("c2", 6), ("c1", 6)]  # rounds 2 and 3 only
  assert len(progress) == 8  # the bar advances over restored rounds too
  for got, want in zip(resumed, whole):
    assert _counts(got) == _counts(want)
  assert resumed[0].num_correct == 7 and resumed[1].num_correct == 0
  # Rounds 0-1 carry the first run's walls; the journal now holds all four rounds.
  restored_walls = sum(first_walls[0]), sum(first_walls[1])
  assert all(r.wall_s >= w for r, w in zip(resumed, restored_walls))
  assert len(path.read_text().splitlines()) == 1 + 8
  with _open(path, _cells([])) as book:
    assert sorted(book.restored) == [0, 1, 2, 3]
    assert _counts(_run(_cells(calls), journal=book)[0]) == _counts(whole[0])


@pytest.mark.parametrize("change", ["params", "setting", "repeats", "prompts", "drafter",
                                    "drafter_config"])
def test_a_journal_of_other_cells_params_or_prompts_is_not_replayed(tmp_path, change):
  path = tmp_path / "batch2.jsonl"
  cells = _cells([])
  with _open(path, cells) as book:
    _run(cells, journal=book)
  with _open(path, cells) as book:
    assert sorted(book.restored) == [0, 1, 2, 3]
  examples, repeats, models = EXAMPLES, 1, DRAFTER
  if change == "params":  # the same tree, one value changed: other weights
    cells = _cells([], params={"w": np.array([0.0, 1.0, 2.0, 3.5])})
  elif change == "setting":
    cells = [runner.Cell(c.decode, c.params, c.method, c.label, {"k": 3}, 2) for c in cells]
  elif change == "repeats":
    repeats = 2
  elif change == "prompts":
    examples = EXAMPLES[:6] + [Example("9+9=", "18", "18", "arithmetic")]
  elif change == "drafter":  # retrained: the cells' own params are the same
    models = {"drafter": ({"w": np.full(3, 2.0)}, "cfg d=3")}
  else:
    models = {"drafter": ({"w": np.ones(3)}, "cfg d=4")}
  with _open(path, cells, repeats=repeats, examples=examples, models=models) as book:
    assert book.restored == {}
  assert len(path.read_text().splitlines()) == 1  # started afresh under the new fingerprint


def test_the_fingerprint_reads_the_params_bytes_not_their_identity():
  a = {"w": np.arange(4.0, dtype=np.float32)}
  same = {"w": np.arange(4.0, dtype=np.float32).copy()}
  assert journal_lib.params_digest([a, a]) == journal_lib.params_digest([a, same])
  assert journal_lib.params_digest([a]) != journal_lib.params_digest(
      [{"w": np.arange(4.0, dtype=np.float64)}])  # dtype
  assert journal_lib.params_digest([a]) != journal_lib.params_digest(
      [{"w": np.arange(4.0, dtype=np.float32).reshape(2, 2)}])  # shape
  assert journal_lib.params_digest([a]) != journal_lib.params_digest(
      [{"v": np.arange(4.0, dtype=np.float32)}])  # tree


def test_a_torn_line_or_a_foreign_file_costs_only_what_it_holds(tmp_path):
  path = tmp_path / "batch2.jsonl"
  cells = _cells([])
  with _open(path, cells) as book:
    _run(cells, journal=book)
  lines = path.read_text().splitlines()
  path.write_text("\n".join(lines[:-1] + [lines[-1][:20]]) + "\n")  # round 3, cell 1 torn
  with _open(path, cells) as book:
    assert sorted(book.restored) == [0, 1, 2]
  path.write_text("not a journal\n")
  with _open(path, cells) as book:
    assert book.restored == {}


def test_a_journal_opened_for_other_cells_is_refused(tmp_path):
  path = tmp_path / "batch2.jsonl"
  fingerprint = runner.fingerprint(_cells([]), EXAMPLES, 3, 0, 1, DRAFTER)
  with journal_lib.Journal(path, fingerprint, 3) as book:
    for cell in range(3):
      book.record(0, cell, journal_lib.add_arguments([1, 1], [True, True], 2, 0.1, 1, 1,
                                                     ["arithmetic"] * 2, 0.1))
  with journal_lib.Journal(path, fingerprint, 3) as book:
    assert sorted(book.restored) == [0]
    with pytest.raises(ValueError, match="open it with this call's fingerprint"):
      _run(_cells([]), journal=book)  # two cells, a journal of three
