"""Adaptive switching without task tags: the prompt router reads the prompt text, and is fitted
on the calibration split only (no evaluation prompt reaches the fit)."""

import pytest

from dllm_jax.data.tasks import Example, TaskSuite
from studylib import calibration, router, runner
from test_study import RowIndexLayout, answered


def test_prompt_format_keeps_the_keyword_and_classes_the_rest():
  assert router.prompt_format("37+48=") == "99+99="
  assert router.prompt_format("472+385=") == "999+999="
  assert router.prompt_format("cum 77270=") == "cum 99999="
  assert router.prompt_format("sort 31420=") == "sort 99999="
  assert router.prompt_format("sort qwe=") == "sort aaa="
  assert router.prompt_format("a472+385 b123+456=") == "a999+999 a999+999="


def trials_for(prompts, correct_by_mode, speed_by_mode):
  """Forced-mode trials: per prompt, correct or not, one token, wall 1 / speed."""
  return {m: {"correct": [correct_by_mode[m](p) for p in prompts], "tokens": [1] * len(prompts),
              "wall_s": [1.0 / speed_by_mode[m]] * len(prompts)} for m in correct_by_mode}


def test_fit_picks_per_format_the_fastest_mode_within_tolerance_and_never_guesses():
  prompts = ["cum 12345=", "cum 54321=", "cum 11111=", "cum 22222="] + \
            ["sort 31420=", "sort 11111=", "sort 98765=", "sort 12121="] + ["5+5="]
  ar = [1] * len(prompts)
  correct = {"parallel": lambda p: int(not p.startswith("cum")), "verify": lambda p: 1,
             "ar": lambda p: 1, "auto": lambda p: 1}
  speed = {"parallel": 4.0, "verify": 2.0, "ar": 1.0, "auto": 3.0}
  fitted, record = router.fit(prompts, ar, trials_for(prompts, correct, speed), tolerance=0.0)
  assert fitted.modes == {"cum 99999=": "auto", "sort 99999=": "parallel",
                          "9+9=": router.FALLBACK}  # one prompt: fewer than MIN_PROMPTS
  assert record["cum 99999="]["modes"]["parallel"]["accuracy"] == 0.0
  assert fitted.tag("cum 98765=") == "cum 99999="
  assert fitted.tag("12+34=") == router.UNSEEN  # a format calibration never showed
  assert fitted.task_modes()[router.UNSEEN] == router.FALLBACK == "ar"
  with pytest.raises(ValueError, match="router modes"):
    router.fit(prompts, ar, {"beam": trials_for(prompts, correct, speed)["ar"]}, tolerance=0)


CALIBRATION = [Example(f"cum {i:05d}=", "x", "x", "running_sum") for i in range(6)] + \
              [Example(f"sort {i:05d}=", "y", "y", "sorting") for i in range(6)]
EVALUATION = [Example(f"cum {i:05d}=", "x", "x", "running_sum") for i in range(100, 104)] + \
             [Example(f"{i}+{i}=", "z", "z", "arithmetic") for i in range(10, 14)]


class Layout(RowIndexLayout):
  prompt_len = 3


def fake_bind(seen):
  """bind(cell) for calibrate_cells: a decoder that records every prompt it is given (the
  RowIndexLayout's rows name their index in the examples it decodes)."""
  def bind(cell):
    def decode(params, tokens, valid, rng, tasks=None):
      seen.append(CALIBRATION[int(tokens[0, 0])].prompt)
      return answered(tokens, 1)
    return runner.Cell(decode, None, cell["method"], cell["label"], {}, 1,
                       task_tags=bool(cell.get("task_tags")))
  return bind


def routed_cell():
  return {"method": "adaptive", "label": "adaptive k=4 prompt router", "model": "ar",
          "drafter": "d2f", "options": {"draft_length": 4}, "router": "prompt_format",
          "calibrate": True}


def calibrate(cells, seen, eval_examples=EVALUATION):
  return calibration.calibrate_cells(
      cells, fake_bind(seen), examples=CALIBRATION, eval_examples=eval_examples,
      layout=Layout(), suite=TaskSuite.parse("running_sum:1,sorting:1"), batch_size=1,
      tolerance=0.0, seed=0, repeats=1)


def test_the_router_is_fitted_on_calibration_prompts_only():
  """Every prompt any calibration decode saw is a calibration prompt; the fitted formats are
  the calibration split's; an evaluation format it never saw decodes AR; a calibration
  prompt that is also an evaluation prompt is refused."""
  seen = []
  ar_cell = {"method": "ar", "label": "ar", "model": "ar", "options": {}}
  cells, records = calibrate([ar_cell, routed_cell()], seen,
                             eval_examples=EVALUATION)
  assert seen and set(seen) <= {ex.prompt for ex in CALIBRATION}
  assert not set(seen) & {ex.prompt for ex in EVALUATION}
  filled = cells[1]
  assert set(filled["route"]) <= {router.prompt_format(ex.prompt) for ex in CALIBRATION}
  assert filled["options"]["task_modes"][router.UNSEEN] == "ar"
  tag = router.Router(filled["route"]).tag
  assert tag("10+10=") == router.UNSEEN  # the arithmetic prompts: never in the fit
  assert tag("cum 00100=") == "cum 99999="
  rec = records["adaptive k=4 prompt router"]
  assert rec["router"] == "prompt_format" and rec["prompts"] == len(CALIBRATION)
  assert sum(f["prompts"] for f in rec["formats"].values()) == len(CALIBRATION)
  assert "any other format -> ar" in calibration.calibration_text(records)
  with pytest.raises(ValueError, match="also evaluation prompts"):
    calibrate([ar_cell, routed_cell()], [], eval_examples=EVALUATION + CALIBRATION[:1])


def test_routed_and_oracle_cells_share_their_forced_decodes():
  seen = []
  ar_cell = {"method": "ar", "label": "ar", "model": "ar", "options": {}}
  oracle = {**routed_cell(), "label": "adaptive k=4 task tags (oracle upper bound)",
            "task_tags": True}
  del oracle["router"]
  calibrate([ar_cell, routed_cell(), oracle], seen, eval_examples=EVALUATION[:4])
  # AR once, four router modes, then only what the oracle adds: none (its three modes are
  # among the router's): 5 cells x (1 compile + 12 prompts).
  assert len(seen) == 5 * (1 + len(CALIBRATION))


def test_a_router_runs_each_row_tagged_by_its_prompt():
  got = []

  def decode(params, tokens, valid, rng, tasks=None):
    got.append(tasks)
    return answered(tokens, 1)

  cell = runner.Cell(decode, None, "adaptive", "a", {}, 1, tag_of=router.prompt_format)
  runner.run_cells([cell], layout=RowIndexLayout(), suite=TaskSuite.parse("arithmetic:1"),
                   examples=EVALUATION[4:6], prompt_len=3)
  assert got == [["99+99="]] * 3  # compile call, then the two prompts
