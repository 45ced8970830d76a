"""Tests for dllm_jax.data.tasks: generation, exact scoring, lengths, splits, suites."""

import collections
import itertools

import numpy as np
import pytest

from dllm_jax.data.tasks import (LEVELS, TASK_ALPHABET, TASKS, Example, TaskSpec, TaskSuite,
                                 examples, extract_final, get_task, split_of)
from dllm_jax.data.tokenizers import CharTokenizer

N = 300  # examples per (task, level) in the property tests


def _sample(name, level, n=N, seed=0):
  rng = np.random.default_rng(seed)
  return [get_task(name).generate(rng, level) for _ in range(n)]


@pytest.mark.parametrize("name,level", list(itertools.product(sorted(TASKS), LEVELS)))
def test_examples_are_self_consistent(name, level):
  task, tok = get_task(name), CharTokenizer(TASK_ALPHABET)
  for ex in _sample(name, level):
    assert ex.task == name and ex.prompt.endswith("=")
    assert task.score(ex.answer, ex), ex
    assert task.score(ex.prompt + ex.answer, ex), ex  # the prompt's '=' is not the last one
    if name not in ("addition_sheet", "arithmetic_reversed"):  # those: their own tests
      assert extract_final(ex.answer) == ex.target
    assert len(ex.prompt) <= task.max_prompt_len(level)
    assert len(ex.answer) <= task.max_answer_len(level)
    tok.encode(ex.prompt + ex.answer)  # every character is in TASK_ALPHABET


@pytest.mark.parametrize("level", LEVELS)
def test_arithmetic_steps_are_correct(level):
  for ex in _sample("arithmetic", level):
    value = eval(ex.prompt[:-1])  # only digits and + - *
    assert int(ex.target) == value
    for step in ex.answer.split("="):
      assert eval(step) == value, ex


@pytest.mark.parametrize("level", LEVELS)
def test_arithmetic_reversed_writes_the_result_units_first(level):
  """The same problems as `arithmetic` (same draws), steps unchanged, the final result's
  digits reversed behind its sign; scoring reads it back, so the plain order scores wrong
  (unless it is a palindrome)."""
  plain, reversed_ = _sample("arithmetic", level), _sample("arithmetic_reversed", level)
  task = get_task("arithmetic_reversed")
  for a, r in zip(plain, reversed_):
    assert (r.prompt, r.target) == (a.prompt, a.target) and r.task == "arithmetic_reversed"
    head, _, final = a.answer.rpartition("=")
    sign = "-" if final.startswith("-") else ""
    assert r.answer == (f"{head}=" if head else "") + sign + final[len(sign):][::-1]
    assert task.score(r.answer, r)
    assert task.score(a.answer, r) == (final == sign + final[len(sign):][::-1])
  ex = get_task("arithmetic_reversed").generate(np.random.default_rng(3), 1)
  assert extract_final(ex.answer) == ex.target[::-1]


def test_arithmetic_formats():
  exs = {lvl: _sample("arithmetic", lvl, n=50) for lvl in LEVELS}
  assert all("=" not in e.answer for e in exs[1] + exs[2])  # short answers when easy
  assert all(set(e.prompt) <= set("0123456789+=") for e in exs[1])
  assert all(e.prompt.count("*") == 1 for e in exs[3] + exs[5])
  assert all(e.prompt.count("+") + e.prompt.count("-") == 2 for e in exs[4])
  # a two-digit second factor with a nonzero tens and units digit gives the place-value steps
  ex = next(e for e in exs[3] if e.prompt.split("*")[1][:-1].isdigit()
            and len(e.prompt.split("*")[1]) == 3 and "0" not in e.prompt.split("*")[1])
  a, b = ex.prompt[:-1].split("*")
  t, u = int(b[0]) * 10, int(b[1])
  assert ex.answer == f"{a}*{t}+{a}*{u}={int(a) * t}+{int(a) * u}={int(a) * int(b)}"


def test_sorting_and_running_sum_are_correct():
  for level in LEVELS:
    for ex in _sample("sorting", level, n=50):
      assert ex.target == "".join(sorted(ex.prompt[len("sort "):-1]))
    for ex in _sample("running_sum", level, n=50):
      digits = [int(c) for c in ex.prompt[len("cum "):-1]]
      out = [int(c) for c in ex.target]
      assert len(out) == len(digits) and out[0] == digits[0]
      assert all(out[i] == (out[i - 1] + digits[i]) % 10 for i in range(1, len(out)))


@pytest.mark.parametrize("level", LEVELS)
def test_long_addition_columns_are_correct(level):
  digits = get_task("long_addition").LEVEL_SPECS[level]
  for ex in _sample("long_addition", level, n=100):
    a, b = ex.prompt[:-1].split("+")
    assert len(a) == len(b) == digits and a[0] != "0" != b[0]
    work, result = ex.answer.rsplit("=", 1)
    columns = work.split(" ")
    assert len(columns) == digits and result == ex.target == str(int(a) + int(b))
    carry, sums = 0, []
    for i, col in enumerate(columns):  # units first: "a+b+c=ds"
      lhs, total = col.split("=")
      assert lhs == f"{a[-1 - i]}+{b[-1 - i]}+{carry}" and len(total) == 2, ex
      assert int(total) == int(a[-1 - i]) + int(b[-1 - i]) + carry, ex
      carry, sums = int(total[0]), [total[1]] + sums
    assert ex.target == (str(carry) if carry else "") + "".join(sums)


def test_long_addition_hand_case():
  class Operands:  # a Generator stand-in that draws the operands 472 and 385
    values = iter([472, 385])
    def integers(self, lo, hi):
      assert (lo, hi) == (100, 1000)
      return next(self.values)

  task = get_task("long_addition")
  ex = task.generate(Operands(), 2)
  assert ex.prompt == "472+385=" and ex.answer == "2+5+0=07 7+8+0=15 4+3+1=08=857" and ex.target == "857"
  assert task.max_answer_len(2) == len("2+5+0=07 7+8+0=15 4+3+1=08=1857")


@pytest.mark.parametrize("level", LEVELS)
def test_addition_sheet_lines_are_lettered_worked_additions(level):
  """Each line restates its problem (in the prompt's order, under its letter) and works it
  exactly as `long_addition` does; the target lists the sums."""
  problems, digits = get_task("addition_sheet").LEVEL_SPECS[level]
  long_addition = get_task("long_addition")
  for ex in _sample("addition_sheet", level, n=100):
    asked = ex.prompt[:-1].split(" ")
    lines = ex.answer.split("\n")
    assert len(asked) == len(lines) == problems
    sums = []
    for letter, problem, line in zip("abcdefghijklmnopqrstuvwxyz", asked, lines):
      assert problem[0] == letter and line.startswith(problem + "=")
      a, b = problem[1:].split("+")
      assert len(a) == len(b) == digits and a[0] != "0" != b[0]
      work = line[len(problem) + 1:]
      single = Example(f"{a}+{b}=", work, str(int(a) + int(b)), "long_addition")
      assert long_addition.score(work, single)
      sums.append(extract_final(work))
      level_of_digits = {d: lv for lv, d in long_addition.LEVEL_SPECS.items()}.get(digits)
      if level_of_digits is not None:  # the same worked columns, character for character
        assert len(work) <= long_addition.max_answer_len(level_of_digits)
    assert ex.target == " ".join(sums)


def test_addition_sheet_hand_case_and_scoring():
  class Operands:  # a Generator stand-in drawing 472, 385 then 123, 456
    values = iter([472, 385, 123, 456])
    def integers(self, lo, hi):
      assert (lo, hi) == (100, 1000)
      return next(self.values)

  task = get_task("addition_sheet")
  ex = task.generate(Operands(), 2)
  assert ex.prompt == "a472+385 b123+456="
  assert ex.answer == ("a472+385=2+5+0=07 7+8+0=15 4+3+1=08=857\n"
                       "b123+456=3+6+0=09 2+5+0=07 1+4+0=05=579")
  assert ex.target == "857 579"
  assert task.score("x=857\ny=579\n", ex)  # graded on each line's final answer
  for bad in ["a=857", "a=857\nb=578", "a=857 b=579", "a=857\nb=579\nc=1", "857 579", ""]:
    assert not task.score(bad, ex), bad
  # level 3, the study's --long mode: every answer is at least 128 characters (= tokens)
  lengths = [len(e.answer) for e in _sample("addition_sheet", 3)]
  assert min(lengths) >= 128 and max(lengths) == task.max_answer_len(3) == 163


def test_exact_scoring_hand_cases():
  task = get_task("arithmetic")
  ex = Example("12*34=", "12*30+12*4=360+48=408", "408", "arithmetic")
  for good in ["408", " 408 \n", "12*30+12*4=360+48=408", "12*34=408", "wrong=steps=408"]:
    assert task.score(good, ex), good
  for bad in ["407", "4080", "0408", "408.0", "", "=", "408=409", "408 is it", "+408"]:
    assert not task.score(bad, ex), bad
  srt = Example("sort cab=", "abc", "abc", "sorting")
  assert get_task("sorting").score("abc", srt)
  assert not get_task("sorting").score("acb", srt)
  assert not get_task("sorting").score("abc ab", srt)


def test_between_scoring_accepts_any_value_in_range():
  task = get_task("between")
  ex = Example("pick 1997 2002=", "1999", "1999", "between")
  for good in ["1997", "1999", "2000", "2002", " 2001\n", "x=2000"]:
    assert task.score(good, ex), good
  for bad in ["1996", "2003", "02000", "-2000", "+2000", "2e3", "", "1999 2000", "２０００"]:
    assert not task.score(bad, ex), bad
  for ex in _sample("between", 3, n=100):
    lo, hi = (int(x) for x in ex.prompt[5:-1].split())
    assert 2 <= hi - lo + 1 <= 10 and len(str(lo)) == len(str(hi)) == 6


def test_between_defeats_independent_digit_sampling():
  """Why parallel decoding fails on `between`: digit marginals of valid answers multiply into
  mostly invalid numbers, even with the true marginals."""
  lo, hi = 1997, 2002
  valid = [str(v) for v in range(lo, hi + 1)]
  marginals = [collections.Counter(v[i] for v in valid) for i in range(4)]
  p_valid = sum(np.prod([marginals[i][v[i]] / len(valid) for i in range(4)]) for v in valid)
  assert p_valid < 0.3


def test_generation_is_deterministic():
  for name in TASKS:
    assert _sample(name, 2, n=20, seed=5) == _sample(name, 2, n=20, seed=5)
    assert _sample(name, 2, n=20, seed=5) != _sample(name, 2, n=20, seed=6)


def test_bad_task_and_difficulty():
  with pytest.raises(ValueError, match="valid tasks: .*'arithmetic'.*'sorting'"):
    get_task("addition")
  rng = np.random.default_rng(0)
  for bad in (0, 6, "2", 2.0, True):
    with pytest.raises(ValueError, match="difficulty levels"):
      get_task("sorting").generate(rng, bad)
  with pytest.raises(ValueError, match="difficulty levels"):
    get_task("arithmetic").max_answer_len(9)


def test_split_of_is_a_fixed_fraction():
  prompts = [f"{a}+{b}=" for a in range(100) for b in range(100)]
  frac = np.mean([split_of(p, 0.1) == "test" for p in prompts])
  assert 0.08 < frac < 0.12
  assert all(split_of(p, 0.1) == split_of(p, 0.1) for p in prompts[:100])


def test_suite_splits_never_overlap():
  suite = TaskSuite.parse("arithmetic:1,sorting:1,running_sum:1,between:1")
  train = examples(suite, 2000, seed=0, split="train")
  test = examples(suite, 500, seed=0, split="test")
  assert not {e.prompt for e in train} & {e.prompt for e in test}
  assert all(split_of(e.prompt, 0.1) == "train" for e in train)
  assert all(split_of(e.prompt, 0.1) == "test" for e in test)


def test_suite_parse_weights_and_lengths():
  suite = TaskSuite.parse(" arithmetic:3:3, sorting:1 ")
  assert suite.specs == (TaskSpec("arithmetic", 3, 3.0), TaskSpec("sorting", 1, 1.0))
  assert TaskSuite.parse(suite.spec_string()) == suite
  counts = collections.Counter(e.task for e in examples(suite, 2000, seed=1))
  assert 0.70 < counts["arithmetic"] / 2000 < 0.80
  assert suite.max_prompt_len == max(get_task("arithmetic").max_prompt_len(3),
                                     get_task("sorting").max_prompt_len(1))
  assert suite.max_answer_len == get_task("arithmetic").max_answer_len(3)
  ex = examples(suite, 1, seed=2)[0]
  assert suite.score(ex.answer, ex) and not suite.score(ex.answer + "1", ex)


@pytest.mark.parametrize("spec,match", [
    ("arithmetic", "name:difficulty"), ("arithmetic:x", "must be an int"),
    ("sorting:1:heavy", "must be an int"), ("sorting:9", "difficulty levels"),
    ("sort:1", "valid tasks"), ("sorting:1:0", "weight"), ("", "at least one"),
])
def test_suite_parse_errors(spec, match):
  with pytest.raises(ValueError, match=match):
    TaskSuite.parse(spec)


def test_suite_errors():
  with pytest.raises(ValueError, match="test_fraction"):
    TaskSuite.parse("sorting:1", test_fraction=1.0)
  suite = TaskSuite.parse("sorting:1", test_fraction=1e-9, max_tries=20)
  with pytest.raises(RuntimeError, match="prompt space is too small"):
    suite.sample(np.random.default_rng(0), "test")
  with pytest.raises(ValueError, match="split must be one of"):
    suite.sample(np.random.default_rng(0), "valid")
