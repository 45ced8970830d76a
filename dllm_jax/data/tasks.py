"""Synthetic reasoning tasks with exactly checkable answers and adjustable difficulty.

Each task turns a numpy Generator and a difficulty level into an `Example`:

  prompt   what the model is given, always ending in '='        "12*34="
  answer   the full response: worked steps, then the final one  "12*30+12*4=360+48=408"
  target   a correct final answer                               "408"

`task.score(prediction, example)` takes the decoded response (the caller stops it at EOS),
extracts the final answer as the text after the last '=' (all of it when there is no '='),
strips surrounding whitespace and checks it. For every task but `between` that is an exact
string match with `target`; `between` accepts any integer in range, so always score with
`score`, never by comparing strings with `target`.

Tasks (difficulty levels 1..5 each):
  arithmetic   +, - and * of multi-digit numbers, with left-to-right and place-value steps
  arithmetic_reversed  the same problems, the final result written units digit first
  long_addition  addition worked column by column with carries: long answers (up to 81 chars)
  addition_sheet  lettered additions, each restated and worked so: very long answers (159-163
               characters at level 3)
  sorting      sort digits (levels 1-2) or letters (3-5)
  running_sum  prefix sums mod 10; output digit i = output digit i-1 + input digit i
  between      any integer in a small range that straddles a power-of-ten boundary

`running_sum` and `between` are the ones where committing tokens in parallel hurts (see their
docstrings). All text is ASCII inside `TASK_ALPHABET`, so lengths in characters equal bytes and
bound the token count of any byte-level tokenizer; `max_prompt_len`/`max_answer_len` give those
bounds per difficulty for static shapes.

Train/test separation: `split_of(prompt)` hashes the prompt (blake2b) into "test" with
probability `test_fraction`, else "train", and `TaskSuite.sample` redraws until the prompt lands
in the requested split. So the two splits never share a prompt, whatever seeds or sizes are used.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import string
from collections.abc import Mapping

import numpy as np

TASK_ALPHABET = "0123456789+-*=#" + " \n" + string.ascii_lowercase
SPLITS = ("train", "test")
LEVELS = (1, 2, 3, 4, 5)


@dataclasses.dataclass(frozen=True)
class Example:
  """One task instance; `task` names the generator (used to route `TaskSuite.score`)."""
  prompt: str
  answer: str
  target: str
  task: str = ""


def extract_final(prediction: str) -> str:
  """The final answer of a response: the text after its last '=', stripped."""
  return prediction.rsplit("=", 1)[-1].strip()


class Task(abc.ABC):
  """A generator of examples plus the rule that checks a response."""

  name: str = ""

  def check_difficulty(self, difficulty: int) -> int:
    if isinstance(difficulty, bool) or not isinstance(difficulty, (int, np.integer)) \
        or int(difficulty) not in LEVELS:
      raise ValueError(f"task {self.name!r} has difficulty levels {LEVELS}, got {difficulty!r}")
    return int(difficulty)

  def generate(self, rng: np.random.Generator, difficulty: int) -> Example:
    prompt, answer, target = self._generate(rng, self.check_difficulty(difficulty))
    return Example(prompt, answer, target, self.name)

  def score(self, prediction: str, example: Example) -> bool:
    """True iff the final answer extracted from `prediction` is correct."""
    return extract_final(prediction) == example.target

  @abc.abstractmethod
  def _generate(self, rng: np.random.Generator, difficulty: int) -> tuple[str, str, str]:
    """(prompt, answer, target) for a checked difficulty."""

  @abc.abstractmethod
  def max_prompt_len(self, difficulty: int) -> int:
    """Upper bound on len(prompt) at this difficulty."""

  @abc.abstractmethod
  def max_answer_len(self, difficulty: int) -> int:
    """Upper bound on len(answer) at this difficulty."""


def _ndigits(value: int) -> int:
  return len(str(value))


class Arithmetic(Task):
  """Addition, subtraction and multiplication with worked steps (a small GSM8K stand-in).

  Levels: 1 `37+48=85`; 2 three-digit + and -; 3 two-digit by two-digit product;
  4 three operands of three digits; 5 three-digit by three-digit product. Several operands are
  reduced left to right (`12+345-67=357-67=290`); a product is split over the nonzero place
  values of the second factor (`12*34=12*30+12*4=360+48=408`), whose carries make later answer
  digits depend on earlier ones. Operands are uniform in [0, 10**digits) ([1, ...) for *).
  """

  name = "arithmetic"
  # difficulty -> (ops, operand digits)
  LEVEL_SPECS = {1: ("+", (2, 2)), 2: ("+-", (3, 3)), 3: ("*", (2, 2)),
                 4: ("+-", (3, 3, 3)), 5: ("*", (3, 3))}

  def _generate(self, rng, difficulty):
    ops, digits = self.LEVEL_SPECS[difficulty]
    if ops == "*":
      a, b = (int(rng.integers(1, 10**d)) for d in digits)
      prompt = f"{a}*{b}="
      places = [int(ch) * 10**k for k, ch in enumerate(reversed(str(b))) if ch != "0"][::-1]
      steps = []
      if len(places) > 1:
        steps.append("+".join(f"{a}*{p}" for p in places))
        steps.append("+".join(str(a * p) for p in places))
      target = str(a * b)
    else:
      values = [int(rng.integers(0, 10**d)) for d in digits]
      signs = [ops[int(rng.integers(len(ops)))] for _ in values[1:]]
      prompt = str(values[0]) + "".join(s + str(v) for s, v in zip(signs, values[1:])) + "="
      steps, acc = [], values[0]
      for i, (s, v) in enumerate(zip(signs, values[1:])):
        acc = acc + v if s == "+" else acc - v
        rest = "".join(s2 + str(v2) for s2, v2 in zip(signs[i + 1:], values[i + 2:]))
        if rest:
          steps.append(str(acc) + rest)
      target = str(acc)
    return prompt, "=".join(steps + [target]), target

  def max_prompt_len(self, difficulty):
    _, digits = self.LEVEL_SPECS[self.check_difficulty(difficulty)]
    return sum(digits) + len(digits)  # operands, operators and '='

  def max_answer_len(self, difficulty):
    ops, digits = self.LEVEL_SPECS[self.check_difficulty(difficulty)]
    if ops == "*":
      da, db = digits
      final = da + db
      if db == 1:
        return final
      terms = db * (da + 1 + db) + db - 1  # "a*p" joined by '+'
      products = db * (da + db) + db - 1
      return terms + 1 + products + 1 + final
    n, d = len(digits), digits[0]
    # after reducing k operands the value has at most ndigits(k * (10**d - 1)) digits and a sign
    steps = [_ndigits(k * (10**d - 1)) + 1 + (n - k) * (d + 1) for k in range(2, n + 1)]
    return sum(steps) + len(steps) - 1


class ArithmeticReversed(Arithmetic):
  """`arithmetic` with its final result written units digit first: `37+48=58` for 85.

  The same prompts, steps and target (the true result); only the last number of the answer
  is reversed (a sign stays in front: -45 is written `-54`), and `score` reads it back. Why it is here: a causal model writing 85 must know the carry of 7+8 before its
  first digit; written units first, each digit depends on the digits before it only, as in
  `long_addition`'s columns, so a small AR model learns it in the mixed suite's budget.
  """

  name = "arithmetic_reversed"

  def _generate(self, rng, difficulty):
    prompt, answer, target = super()._generate(rng, difficulty)
    head, _, _ = answer.rpartition("=")
    final = reverse_digits(target)
    return prompt, f"{head}={final}" if head else final, target

  def score(self, prediction: str, example: Example) -> bool:
    return reverse_digits(extract_final(prediction)) == example.target


def reverse_digits(number: str) -> str:
  """`"85"` -> `"58"`, `"-45"` -> `"-54"`: the digits reversed, a leading sign kept (its own
  inverse)."""
  sign = "-" if number.startswith("-") else ""
  return sign + number[len(sign):][::-1]


class Sorting(Task):
  """Sort characters: `sort 31420=01234`. Levels 1-2 use 5 and 7 digits, 3-5 use 6, 10 and
  16 lowercase letters (repeats allowed)."""

  name = "sorting"
  LEVEL_SPECS = {1: (string.digits, 5), 2: (string.digits, 7), 3: (string.ascii_lowercase, 6),
                 4: (string.ascii_lowercase, 10), 5: (string.ascii_lowercase, 16)}

  def _generate(self, rng, difficulty):
    symbols, n = self.LEVEL_SPECS[difficulty]
    chars = [symbols[i] for i in rng.integers(0, len(symbols), size=n)]
    target = "".join(sorted(chars))
    return f"sort {''.join(chars)}=", target, target

  def max_prompt_len(self, difficulty):
    return len("sort =") + self.LEVEL_SPECS[self.check_difficulty(difficulty)][1]

  def max_answer_len(self, difficulty):
    return self.LEVEL_SPECS[self.check_difficulty(difficulty)][1]


class RunningSum(Task):
  """Prefix sums mod 10: `cum 31415=34894` (3, 3+1, 3+1+4, ... mod 10).

  Why parallel decoding hurts: output digit i is a cheap function of output digit i-1 and
  input digit i, but an expensive one (a sum of i digits mod 10) of the prompt alone. A model
  that commits digit i before digit i-1 is known must do the expensive sum, and one wrong digit
  shifts every later one, so the answer tokens are strongly dependent. Levels use 5, 6, 8, 12
  and 16 input digits.
  """

  name = "running_sum"
  LEVEL_SPECS = {1: 5, 2: 6, 3: 8, 4: 12, 5: 16}

  def _generate(self, rng, difficulty):
    digits = rng.integers(0, 10, size=self.LEVEL_SPECS[difficulty])
    target = "".join(str(int(x)) for x in np.cumsum(digits) % 10)
    return f"cum {''.join(str(int(x)) for x in digits)}=", target, target

  def max_prompt_len(self, difficulty):
    return len("cum =") + self.LEVEL_SPECS[self.check_difficulty(difficulty)]

  def max_answer_len(self, difficulty):
    return self.LEVEL_SPECS[self.check_difficulty(difficulty)]


class Between(Task):
  """Name any integer in [lo, hi]: `pick 1997 2002=1999`. Any integer in range scores True.

  Why parallel decoding hurts: the range straddles a multiple of 10**m (here 2000), so the
  valid answers split into modes that differ in their top digits (199x vs 200x). Each digit's
  marginal is a mixture of modes; sampling digits independently mixes them (`1909`, `2099`)
  and lands outside the range, even for a perfect model. Training targets are drawn uniformly
  from the range, so the data really is multi-modal. Level k uses (k + 3)-digit numbers and a
  range of 2 to 10 integers.
  """

  name = "between"
  MAX_SIDE = 5  # at most this many integers on each side of the boundary

  def _generate(self, rng, difficulty):
    d = difficulty + 3
    m = int(rng.integers(1, d))  # the boundary is a multiple of 10**m, 1 <= m < d
    step = 10**m
    boundary = step * int(rng.integers(10**(d - 1) // step + 1, 10**d // step))
    lo = boundary - int(rng.integers(1, self.MAX_SIDE + 1))
    hi = boundary + int(rng.integers(1, self.MAX_SIDE + 1)) - 1
    target = str(int(rng.integers(lo, hi + 1)))
    return f"pick {lo} {hi}=", target, target

  def score(self, prediction, example):
    final = extract_final(prediction)
    if not final.isdigit() or not final.isascii() or (len(final) > 1 and final[0] == "0"):
      return False
    lo, hi = (int(x) for x in example.prompt[len("pick "):-1].split())
    return lo <= int(final) <= hi

  def max_prompt_len(self, difficulty):
    return len("pick  =") + 2 * (self.check_difficulty(difficulty) + 3)

  def max_answer_len(self, difficulty):
    return self.check_difficulty(difficulty) + 3


def worked_addition(a: int, b: int) -> str:
  """`a + b` worked column by column, units first: `2+5+0=07 7+8+0=15 4+3+1=08=857` for
  472 + 385 (each column `da+db+carry=` its two-digit sum, whose tens digit is the next
  carry; then `=` and the sum). The operands have the same number of digits."""
  steps, carry = [], 0
  for da, db in zip(reversed(str(a)), reversed(str(b))):
    total = int(da) + int(db) + carry
    steps.append(f"{da}+{db}+{carry}={total:02d}")
    carry = total // 10
  return " ".join(steps) + f"={a + b}"


class LongAddition(Task):
  """Addition written out column by column, as a pupil would: a long, worked answer.

  `472+385=2+5+0=07 7+8+0=15 4+3+1=08=857`: one step per column, units first, each
  `a+b+c=ds` with the column's digits, the carry in and the two-digit column sum (its tens
  digit is the next carry), then `=` and the result. Both operands have exactly the level's
  digit count (2, 3, 4, 6, 8), so an answer is 9 characters per column plus the result.

  Why it is here: it is the suite's long-answer arithmetic (GSM8K-like worked steps, up to 81
  characters), where parallel decoders can pay. About half of each step is fixed by the
  prompt (the format and the two copied digits, decodable in any order); the carry and sum
  digits depend on the previous column, and the result copies the sum digits in reverse.
  """

  name = "long_addition"
  LEVEL_SPECS = {1: 2, 2: 3, 3: 4, 4: 6, 5: 8}

  def _generate(self, rng, difficulty):
    d = self.LEVEL_SPECS[difficulty]
    a, b = (int(rng.integers(10**(d - 1), 10**d)) for _ in range(2))
    return f"{a}+{b}=", worked_addition(a, b), str(a + b)

  def max_prompt_len(self, difficulty):
    return 2 * self.LEVEL_SPECS[self.check_difficulty(difficulty)] + 2

  def max_answer_len(self, difficulty):
    d = self.LEVEL_SPECS[self.check_difficulty(difficulty)]
    return 9 * d + d + 1  # d steps of 8 and d - 1 spaces, '=', a result of <= d + 1 digits


class AdditionSheet(Task):
  """A lettered worksheet of additions, each restated and worked column by column.

  `a472+385 b123+456=` -> `a472+385=2+5+0=07 7+8+0=15 4+3+1=08=857\nb123+456=3+6+0=09 ...=579`:
  one line per problem in the prompt's order, each opening with its problem's letter and the
  problem restated, then worked as `long_addition` works it (`a+b+c=ds` per column, units
  first, then `=` and the sum). Levels set (problems, digits per operand): (2, 2), (2, 3),
  (4, 3), (4, 4), (6, 4). Level 3 answers are 159-163 characters: the study's `--long` mode,
  whose answers must reach 128 tokens (the regime of the published 50x over vanilla LLaDA).

  Why it is here: the long worked computation of a GSM8K-style answer at a length a tiny
  model learns on a CPU. A line finds its problem by its letter (the prompt holds each letter
  once) and copies it, so every column then reads digits a short, fixed distance back in its
  own line; the lines are independent of one another (parallel decoders may work them in any
  order), while inside a line the carries chain column to column. Scored per line: the
  response must have one line per problem, each ending in that problem's sum.
  """

  name = "addition_sheet"
  LEVEL_SPECS = {1: (2, 2), 2: (2, 3), 3: (4, 3), 4: (4, 4), 5: (6, 4)}

  def _generate(self, rng, difficulty):
    problems, d = self.LEVEL_SPECS[difficulty]
    pairs = [tuple(int(rng.integers(10**(d - 1), 10**d)) for _ in range(2))
             for _ in range(problems)]
    asked = [f"{letter}{a}+{b}" for letter, (a, b) in zip(string.ascii_lowercase, pairs)]
    lines = [f"{problem}={worked_addition(a, b)}" for problem, (a, b) in zip(asked, pairs)]
    return " ".join(asked) + "=", "\n".join(lines), " ".join(str(a + b) for a, b in pairs)

  def score(self, prediction, example):
    """True iff the response has one line per problem, each line's final answer its sum."""
    finals = [extract_final(line) for line in prediction.strip().split("\n")]
    return finals == example.target.split(" ")

  def max_prompt_len(self, difficulty):
    problems, d = self.LEVEL_SPECS[self.check_difficulty(difficulty)]
    return problems * (2 * d + 3)  # `xa+b` and a space or the final '='

  def max_answer_len(self, difficulty):
    problems, d = self.LEVEL_SPECS[self.check_difficulty(difficulty)]
    line = (2 * d + 3) + 9 * d + d + 1  # `xa+b=`, the columns and spaces, '=', <= d + 1 digits
    return problems * line + problems - 1  # and the newlines between lines


TASKS: Mapping[str, Task] = {t.name: t for t in (Arithmetic(), ArithmeticReversed(),
                                                 LongAddition(), AdditionSheet(),
                                                 Sorting(), RunningSum(), Between())}


def get_task(name: str) -> Task:
  """The registered task called `name`."""
  try:
    return TASKS[name]
  except KeyError:
    raise ValueError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}") from None


def split_of(prompt: str, test_fraction: float) -> str:
  """'test' for a fixed `test_fraction` of all prompts (by blake2b hash), else 'train'."""
  h = int.from_bytes(hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest(), "little")
  return "test" if h < test_fraction * 2.0**64 else "train"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """One mixture component: a task, its difficulty and its sampling weight."""
  name: str
  difficulty: int
  weight: float = 1.0

  def __post_init__(self):
    get_task(self.name).check_difficulty(self.difficulty)
    if not self.weight > 0:
      raise ValueError(f"weight of {self.name}:{self.difficulty} must be > 0, got {self.weight}")


@dataclasses.dataclass(frozen=True)
class TaskSuite:
  """A weighted mixture of (task, difficulty) pairs with disjoint train and test splits.

  Build it with `TaskSuite.parse("arithmetic:3:2,sorting:1")` (name:difficulty[:weight],
  comma separated) or from `TaskSpec`s. `sample` draws one example of a split; `score` routes
  a response to the right task by `example.task`.
  """

  specs: tuple[TaskSpec, ...]
  test_fraction: float = 0.1
  max_tries: int = 1000

  def __post_init__(self):
    object.__setattr__(self, "specs", tuple(self.specs))
    if not self.specs:
      raise ValueError("TaskSuite needs at least one TaskSpec")
    if not 0.0 < self.test_fraction < 1.0:
      raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")

  @classmethod
  def parse(cls, spec: str, **kwargs) -> "TaskSuite":
    """`"arithmetic:3:2.0,sorting:1"` -> a suite (weight defaults to 1)."""
    specs = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
      fields = part.split(":")
      if len(fields) not in (2, 3):
        raise ValueError(f"bad task spec {part!r} in {spec!r}: use name:difficulty[:weight], "
                         "e.g. 'arithmetic:3' or 'sorting:1:0.5'")
      try:
        difficulty = int(fields[1])
        weight = float(fields[2]) if len(fields) == 3 else 1.0
      except ValueError:
        raise ValueError(f"bad task spec {part!r}: difficulty must be an int and weight a "
                         "float, e.g. 'sorting:1:0.5'") from None
      specs.append(TaskSpec(fields[0], difficulty, weight))
    return cls(tuple(specs), **kwargs)

  def spec_string(self) -> str:
    """Inverse of `parse` (used as the builder config)."""
    return ",".join(f"{s.name}:{s.difficulty}:{s.weight:g}" for s in self.specs)

  @property
  def max_prompt_len(self) -> int:
    return max(get_task(s.name).max_prompt_len(s.difficulty) for s in self.specs)

  @property
  def max_answer_len(self) -> int:
    return max(get_task(s.name).max_answer_len(s.difficulty) for s in self.specs)

  def sample(self, rng: np.random.Generator, split: str = "train") -> Example:
    """One example whose prompt belongs to `split` (see `split_of`)."""
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    spec = self.specs[0]
    if len(self.specs) > 1:
      cumulative = np.cumsum([s.weight for s in self.specs])
      spec = self.specs[int(np.searchsorted(cumulative, rng.random() * cumulative[-1], "right"))]
    task = get_task(spec.name)
    for _ in range(self.max_tries):
      example = task.generate(rng, spec.difficulty)
      if split_of(example.prompt, self.test_fraction) == split:
        return example
    raise RuntimeError(f"{spec.name}:{spec.difficulty} produced no {split!r} prompt in "
                       f"{self.max_tries} draws: its prompt space is too small for "
                       f"test_fraction={self.test_fraction}; raise the difficulty")

  def score(self, prediction: str, example: Example) -> bool:
    return get_task(example.task).score(prediction, example)


def examples(suite: TaskSuite, n: int, seed: int, split: str = "train") -> list[Example]:
  """`n` examples drawn in sequence from one Generator (for quick looks and tests)."""
  rng = np.random.default_rng(seed)
  return [suite.sample(rng, split) for _ in range(n)]
