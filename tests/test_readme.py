"""Every code block and command in README.md runs here, so a README that drifts from the code
fails CI.

What is checked:
  * fenced ```python blocks are executed in a fresh interpreter (8 fake CPU devices);
  * fenced ```bash blocks are split into commands (comments dropped, `\\` continuations joined,
    `&&` chains split) and every command must match a rule in COMMAND_RULES, which runs it
    (with documented substitutions), checks it against `.ci/run`, or names the stand-in that
    covers it;
  * inline `code` spans that are shell commands (COMMAND_PREFIXES) obey the same rules; inline
    spans that name a repo path must exist, a `dllm_jax.x.y` name must resolve, and a `--flag`
    must be one that a documented CLI accepts.
A block in another language, or a command no rule matches, fails with a message saying to add
a rule; the rule tables below are the place to extend.

Substitutions (applied to every command and python block, in order):
  * the checkpoint paths in CHECKPOINTS (`/ckpt/...`, where the README tells users to download
    real weights) point at tiny checkpoints written in the same published layouts
    (tests/tiny_llada.py), and `runs/...` work dirs at a temporary directory;
  * generation lengths written for an 8B model on an accelerator shrink (LENGTHS);
  * a command ending in `...` takes the arguments of the command before it in the same block
    that it does not set itself (the README's "and the rest as above");
  * the study and training commands get `--config.*` overrides that shrink the models, steps and
    prompt set (`study_overrides`, TRAIN_OVERRIDES): the command line, config loading, training,
    decoding and reporting all run, in seconds instead of minutes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import tiny_llada
from conftest import run_python, xla_flags
from _jax_cache_env import compilation_cache_env
from dllm_jax.training import checkpoint as ckpt_lib

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The README's commands and python blocks run with the session's persistent compilation cache
# (run_shell, test_python_block_runs): a program that another module compiled into it, e.g.
# the demo's d2f decode in test_demo.py, loads instead of compiling again.
pytestmark = pytest.mark.usefixtures("compile_cache")

# ---------------------------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True)
class Block:
  lang: str
  text: str
  line: int  # 1-based line of the opening fence


def fenced_blocks(markdown: str) -> list[Block]:
  blocks, lang, start, body = [], None, 0, []
  for i, line in enumerate(markdown.splitlines(), 1):
    fence = re.match(r"^\s*```\s*([\w+-]*)\s*$", line)
    if lang is None and fence:
      lang, start, body = fence.group(1) or "text", i, []
    elif lang is not None and re.match(r"^\s*```\s*$", line):
      blocks.append(Block(lang, "\n".join(body), start))
      lang = None
    elif lang is not None:
      body.append(line)
  if lang is not None:
    raise AssertionError(f"README.md line {start}: unclosed ``` fence")
  return blocks


def prose(markdown: str) -> str:
  """The README without its fenced blocks."""
  return re.sub(r"(?ms)^\s*```.*?^\s*```\s*$", "", markdown)


def inline_spans(markdown: str) -> list[str]:
  """Inline `code` spans (a span may wrap onto the next line, as in Markdown)."""
  return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose(markdown))]


def inline_commands(markdown: str) -> list[str]:
  """Inline spans that are shell commands, normalised as block commands are."""
  return [c for s in inline_spans(markdown) if s.startswith(COMMAND_PREFIXES)
          for c in shell_commands(s)]


ELIDED = " <...>"  # marks a command whose arguments the README elides with a bare `...`


def shell_commands(script: str) -> list[str]:
  """Commands of a bash block: continuations joined, comments dropped, `&&` chains split; a
  trailing unquoted `...` becomes ELIDED (a quoted "..." stays an argument)."""
  joined = re.sub(r"\\\n\s*", " ", script)
  out = []
  for line in joined.splitlines():
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    elided = bool(re.search(r"\s\.\.\.$", line))
    if elided:
      line = line[:-3].rstrip()
    lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    parts, current = [], []
    for token in lexer:
      if token in ("&&", ";"):
        parts.append(current)
        current = []
      else:
        current.append(token)
    parts.append(current)
    commands = [shlex.join(p) for p in parts if p]
    if elided:
      commands[-1] += ELIDED
    out += commands
  return out


# ------------------------------------------------------------------------- substitutions

CHECKPOINTS: dict[str, Callable[[Path], object]] = {
    # README path -> writer of a tiny stand-in in the same published layout
    "/ckpt/LLaDA-8B-Instruct": tiny_llada.write_llada_instruct,
    "/ckpt/D2F_LLaDA_LoRA": tiny_llada.write_d2f_adapter,
    "/ckpt/Meta-Llama-3-8B-Instruct": tiny_llada.write_llama_instruct,
}
# README data path -> writer of a small stand-in (GSM8K's test split: 16 questions, its format)
DATA = {"/data/gsm8k/test.jsonl": lambda path: path.write_text("".join(
    json.dumps({"question": f"What is {a} plus {b}?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"})
    + "\n" for a, b in zip(range(3, 19), range(20, 4, -1))))}
LENGTHS = [(r"--gen_length(=|\s+)256\b", r"--gen_length\g<1>64"),
           (r"\bsteps=256\b", "steps=64"), (r"\bgen_length=256\b", "gen_length=64")]
TINY_MODEL = {"model.d_model": 32, "model.n_layers": 1, "model.mlp_dim": 64}
TINY_RUN = {**TINY_MODEL, "train.steps": 2, "train.batch_size": 8, "train.log_every": 1,
            "opt.warmup_steps": 1}
STUDY_OVERRIDES = ["--config.data.train_size=64", "--config.data.eval_size=16",
                   "--config.eval.num_prompts=2", "--config.eval.batch_sizes=(1,)",
                   "--config.eval.timing_repeats=1", "--config.eval.calibration_prompts=8"]


def study_overrides(command: str) -> list[str]:
  """STUDY_OVERRIDES plus TINY_RUN for every model the command's study mode trains (read
  from configs/study.py, so a mode that gains a model is shrunk with it)."""
  from studylib import study as study_lib
  argv = study_lib.expand_mode_flags(shlex.split(command))
  mode = next((a.split(":", 1)[1] for a in argv if a.startswith("--config=") and ":" in a), "")
  spec = importlib.util.spec_from_file_location("readme_study_cfg",
                                                REPO / "configs" / "study.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  models = module.get_config(mode).models.keys()
  return ([f"--config.models.{m}.{k}={v}" for m in models for k, v in TINY_RUN.items()] +
          STUDY_OVERRIDES)


TRAIN_OVERRIDES = ([f"--config.{k}={v}" for k, v in TINY_MODEL.items()] +
                   ["--config.train.steps=2", "--config.train.batch_size=8",
                    "--config.train.log_every=1", "--config.train.eval_every=0",
                    "--config.train.ckpt_every=0", "--config.opt.warmup_steps=1",
                    "--config.data.train_size=64", "--config.data.eval_size=16",
                    # 0: a 2-step model's decoded eval can emit ids past the char tokenizer's
                    # (the trainer's exact-match eval does not bound the padded vocab)
                    "--config.decode.eval_examples=0", "--config.train.eval_batches=1"])


class Workspace:
  """The temporary directory that stands in for `/ckpt` and `runs/`."""

  def __init__(self, root: Path):
    self.root = root
    self.written: dict[str, Path] = {}
    self.server = None  # the README's server, once its serve command ran

  def checkpoint(self, readme_path: str) -> Path:
    if readme_path not in self.written:
      target = self.root / "ckpt" / Path(readme_path).name
      CHECKPOINTS[readme_path](target)
      self.written[readme_path] = target
    return self.written[readme_path]

  def substitute(self, text: str) -> str:
    for readme_path in sorted(set(re.findall(r"/ckpt/[\w.-]+", text))):
      if readme_path in CHECKPOINTS:
        text = text.replace(readme_path, str(self.checkpoint(readme_path)))
      else:
        raise AssertionError(f"README.md names {readme_path}, for which tests/test_readme.py "
                             "has no tiny stand-in: add a writer to CHECKPOINTS.")
    for readme_path, write in DATA.items():
      if readme_path in text:
        local = self.root / "data" / Path(readme_path).name
        if not local.exists():
          local.parent.mkdir(parents=True, exist_ok=True)
          write(local)
        text = text.replace(readme_path, str(local))
    text = re.sub(r"(?<![\w/.])runs/", f"{self.root}/runs/", text)
    for pattern, repl in LENGTHS:
      text = re.sub(pattern, repl, text)
    return text


def fill_elision(command: str, previous: str | None) -> str:
  """`cmd --a 1 ...` -> `cmd --a 1` + the previous command's options that it does not set."""
  if not command.endswith(ELIDED):
    return command
  if previous is None:
    raise AssertionError(f"{command!r} elides its arguments with '...' but no command precedes "
                         "it in its block")
  argv = shlex.split(command.removesuffix(ELIDED))
  given = {a for a in argv if a.startswith("--")}
  prev = shlex.split(previous)
  i, extra = 0, []
  while i < len(prev):
    if prev[i].startswith("--"):
      j = i + 1
      while j < len(prev) and not prev[j].startswith("--"):
        j += 1
      if prev[i] not in given:
        extra += prev[i:j]
      i = j
    else:
      i += 1
  return shlex.join(argv + extra)


# ------------------------------------------------------------------------------ the rules


def ci_commands() -> list[str]:
  """`.ci/run`'s commands, with its venv variable written as the README's `.venv` and pip's
  `-q` dropped, so they compare with the README's."""
  out = []
  for line in (REPO / ".ci" / "run").read_text().splitlines():
    line = line.strip()
    if not line or line.startswith(("#", "set ", "cd ", "export ", "venv=")):
      continue
    line = line.replace('"$venv"', ".venv").replace("$venv", ".venv")
    out += [c.replace("pip install -q ", "pip install ") for c in shell_commands(line)]
  return out


@dataclasses.dataclass(frozen=True)
class Rule:
  """How a README command is covered. `pattern` is matched (re.fullmatch) against the command
  as written; `run` gets (command after substitution, Workspace) and checks it."""
  pattern: str
  why: str
  run: Callable[[str, Workspace], None]


def run_shell(command: str, *, devices: int = 1, timeout: float = 900.0, cwd=REPO,
              stderr: bool = False) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
             PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                      if p]),
             XLA_FLAGS=xla_flags(devices),  # the tests' compile flags (conftest)
             **compilation_cache_env())  # the session's compiled programs, if it keeps them
  env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
  proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=timeout)
  if proc.returncode:
    raise AssertionError(f"README command failed ({proc.returncode}): {command}\n--- stdout ---\n"
                         f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}")
  return proc.stdout + (proc.stderr if stderr else "")


def in_ci(command: str, ws: Workspace) -> None:
  assert command in ci_commands(), (
      f"README says `{command}` but .ci/run runs {ci_commands()}: keep the two the same")


def ci_installs_a_superset(command: str, ws: Workspace) -> None:
  """`pip install -e .`: .ci/run installs the package with its test extra, which includes it."""
  spec = shlex.split(command)[-1]
  installs = [shlex.split(c)[-1] for c in ci_commands() if c.startswith("pip install -e ")]
  assert any(i == spec or i.startswith(spec + "[") for i in installs), (
      f"README installs {spec!r}; .ci/run installs {installs}")


ABSL_INFO_LINE = re.compile(r"^I\d{4} \d\d:\d\d:\d\d", re.M)  # I1202 23:51:45.110 ...


def assert_no_info_log(out: str) -> None:
  """The scripts keep absl at WARNING (experiments/_config_args.run): at absl's default
  level orbax logs every checkpoint read and write (~170 lines in a default study run)."""
  line = ABSL_INFO_LINE.search(out)
  assert line is None, f"absl INFO log in the output: {out[line.start():line.start() + 300]}"


def study(command: str, ws: Workspace) -> None:
  out = run_shell(shlex.join(shlex.split(command) + study_overrides(command) +
                             [f"--workdir={ws.root / 'study'}"]), stderr=True)
  for f in ("study.md", "study.json", "study_pareto.png"):
    assert (ws.root / "study" / f).stat().st_size > 0, f
  assert "| method |" in out and "[study] wrote" in out, out[-2000:]
  assert_no_info_log(out)


def train(command: str, ws: Workspace) -> None:
  argv = shlex.split(command)
  if argv[argv.index("--config") + 1].endswith("d2f_tiny.py") and not any(
      a.startswith("--config.train.init_from") for a in argv):
    argv.append(f"--config.train.init_from={ws.root}/runs/mdm_tiny")
  assert_no_info_log(run_shell(shlex.join(argv + TRAIN_OVERRIDES), stderr=True))
  workdir = Path(argv[argv.index("--workdir") + 1])
  steps = int(TRAIN_OVERRIDES[TRAIN_OVERRIDES.index("--config.train.steps=2")].split("=")[1])
  assert steps in ckpt_lib.steps_in(workdir), f"{workdir} holds no checkpoint at step {steps}"


SERVE_OVERRIDES = ["--config.num_requests=8", "--config.concurrency=(2,)",
                   "--config.gen_length=16", "--config.block_length=8"]


def serve_bench(command: str, ws: Workspace) -> None:
  out = run_shell(shlex.join(shlex.split(command) + SERVE_OVERRIDES +
                             [f"--workdir={ws.root / 'serve_bench'}"]))
  for f in ("serve_bench.json", "serve_bench.md"):
    assert (ws.root / "serve_bench" / f).stat().st_size > 0, f
  assert "engine" in out and "static" in out, out[-2000:]


def generate_cli(command: str, ws: Workspace) -> None:
  out = run_shell(command, devices=8, stderr=True)  # answers on stdout, the stats on stderr
  assert "tok/s" in out and "NFE" in out, out[-2000:]


def dry_run_cli(command: str, ws: Workspace) -> None:
  """A dry run reads config.json only: its table is printed and the plan fits the budget."""
  out = run_shell(command)
  assert "parameters (stored)" in out and "K/V cache" in out and "fits" in out, out[-2000:]


def lm_eval_cli(command: str, ws: Workspace) -> None:
  """lm-eval's CLI with the dllm_jax model: the scores table and the speed line print."""
  out = run_shell(command, stderr=True)
  assert "exact_match" in out and re.search(r"\[dllm_jax\] \w+ \w+: \d+ prompts", out), (
      out[-3000:])


def lm_eval_gsm8k(command: str, ws: Workspace) -> None:
  """GSM8K is on the HF hub: the same command runs with the offline demo_sums task (4
  questions, no shots) on the tiny stand-ins."""
  command = command.replace("--tasks gsm8k", "--tasks demo_sums --limit 4")
  lm_eval_cli(command.replace("--num_fewshot 4", "--num_fewshot 0"), ws)


def study_checkpoints_dry_run(command: str, ws: Workspace) -> None:
  out = run_shell(command, stderr=True)
  assert "parameters (stored)" in out and "K/V cache" in out, out[-3000:]


def study_checkpoints(command: str, ws: Workspace) -> None:
  """Run end to end on tiny checkpoints in these layouts by tests/test_study_checkpoints.py;
  here the command itself (its flags, config keys and paths) is run as a dry run."""
  study_checkpoints_dry_run(command + " --dry-run", ws)


README_PORT = "8000"


class ReadmeServer:
  """The README's `python -m dllm_jax.serve ...` in the background on a free loopback port
  (its `--port 8000` replaced), until `close()`; `substitute` points a curl command or a
  client block at it."""

  def __init__(self, command: str, timeout: float = 900.0):
    import httpx
    from serve_server import free_port
    self.port = str(free_port())
    argv = shlex.split(command)
    argv[argv.index("--port") + 1] = self.port
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               **compilation_cache_env())
    self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise AssertionError(f"`{command}` exited ({self.proc.returncode}):\n"
                             f"{self.proc.stdout.read()[-4000:]}")
      try:
        if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
          return
      except httpx.HTTPError:
        pass
      time.sleep(0.5)
    self.close()
    raise AssertionError(f"`{command}` did not answer /health within {timeout:.0f} s")

  def substitute(self, text: str) -> str:
    return text.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{self.port}")

  def close(self) -> None:
    from serve_server import stop
    stop(self.proc, timeout=30)


def serve_cli(command: str, ws: Workspace) -> None:
  """Started in the background (the README runs it in its own shell) for the requests after
  it; the test stops it at the end."""
  ws.server = ReadmeServer(command)


def curl_server(command: str, ws: Workspace) -> None:
  """Sent to the server the serve command above started."""
  assert getattr(ws, "server", None) is not None, "a request before the serve command"
  body = json.loads(run_shell(ws.server.substitute(command)))
  assert body["choices"][0]["text"].strip(), body


def stand_in(command: str, ws: Workspace) -> None:
  """A download: the tiny checkpoint written at the path it names stands in for it."""
  local = re.search(r"--local-dir\s+(\S+)", command)
  assert local and Path(local.group(1)).exists(), (
      f"{command!r}: the download's --local-dir must be a path in CHECKPOINTS")


def accelerator_only(command: str, ws: Workspace) -> None:
  """JAX wheels for CUDA/TPU; CI runs JAX on the CPU."""
  assert re.search(r"jax\[(cuda\d*|tpu)\]", command), command


COMMAND_RULES: list[Rule] = [
    Rule(r"python3 -m venv \.venv|\. \.venv/bin/activate|pip install -e '\.\[test\]'|"
         r"python -m pytest -q", "what .ci/run runs in a fresh venv", in_ci),
    Rule(r"pip install (--no-compile )?-e \.", ".ci/run installs it, with the test extra",
         ci_installs_a_superset),
    Rule(r"python experiments/study\.py( --long| --full)?",
         "run with study_overrides (tiny models, 2 prompts)", study),
    Rule(r"python experiments/train\.py --config \S+ --workdir \S+( --config\.\S+)*",
         "run with TRAIN_OVERRIDES (2 steps of a tiny model)", train),
    Rule(r"python experiments/serve_bench\.py",
         "run with SERVE_OVERRIDES (8 requests at concurrency 2)", serve_bench),
    Rule(r"python experiments/study\.py --checkpoints --dry-run .*",
         "a dry run on the tiny stand-ins' config files", study_checkpoints_dry_run),
    Rule(r"python experiments/study\.py --checkpoints .*",
         "end to end in tests/test_study_checkpoints.py; here as a dry run", study_checkpoints),
    Rule(r"python -m dllm_jax\.eval .*--tasks gsm8k .*",
         "on the tiny stand-ins with the offline demo_sums task", lm_eval_gsm8k),
    Rule(r"python -m dllm_jax\.eval .*", "run (the demo, an offline task)", lm_eval_cli),
    Rule(r"python -m dllm_jax\.generate .*--dry_run.*",
         "a dry run on the tiny LLaDA stand-in's config.json (no devices needed)",
         dry_run_cli),
    Rule(r"python -m dllm_jax\.generate .*",
         "run on the tiny LLaDA + D2F adapter stand-ins, 8 fake CPU devices", generate_cli),
    Rule(r"python -m dllm_jax\.serve .*--port 8000.*",
         "started in the background for the requests after it", serve_cli),
    Rule(r"curl -s http://127\.0\.0\.1:8000/\S+ .*",
         "sent to the server the README's serve command started", curl_server),
    Rule(r"huggingface-cli download \S+ --local-dir \S+",
         "weights cannot be downloaded in CI: the tiny checkpoint stands in", stand_in),
    Rule(r"pip install -U 'jax\[(cuda\d*|tpu)\]'", "accelerator wheels; CI is CPU-only",
         accelerator_only),
]
RUNNABLE_LANGS = {"python", "bash", "sh", "shell", "console"}
COMMAND_PREFIXES = ("python ", "python3 ", "pip ", "huggingface-cli ", "bash ", "sh ", "curl ")


def rule_for(command: str) -> Rule:
  for rule in COMMAND_RULES:
    if re.fullmatch(rule.pattern, command):
      return rule
  raise AssertionError(f"README command `{command}` has no rule in tests/test_readme.py: add one "
                       "to COMMAND_RULES saying how CI runs or covers it.")


# ------------------------------------------------------------------------------ the tests


def readme() -> str:
  return README.read_text()


def test_parsers():
  md = "a `python x.py` b\n```bash\n# c\nfoo \\\n  --bar 1 && baz 'a b'\n```\n```python\nx = 1\n```\n"
  assert [(b.lang, b.line) for b in fenced_blocks(md)] == [("bash", 2), ("python", 7)]
  assert shell_commands(fenced_blocks(md)[0].text) == ["foo --bar 1", "baz 'a b'"]
  assert inline_spans(md) == ["python x.py"]
  (elided,) = shell_commands("g --model m --mesh 8 ...")
  assert elided == "g --model m --mesh 8" + ELIDED
  assert shell_commands('g --prompt "..."') == ["g --prompt ..."]  # an argument, not elision
  assert fill_elision(elided, "g --model x --opt a=1 --opt b=2 --prompt '...'"
                      ) == "g --model m --mesh 8 --opt a=1 --opt b=2 --prompt ..."
  assert ci_commands()[-1] == "python -m pytest -q"


def test_every_block_and_command_has_a_rule():
  """Fails on a new fenced block or command that this file does not know how to check."""
  for block in fenced_blocks(readme()):
    assert block.lang in RUNNABLE_LANGS, (
        f"README.md line {block.line}: a ```{block.lang} block; tests/test_readme.py runs "
        f"{sorted(RUNNABLE_LANGS)} blocks only: add a rule for this language")
    if block.lang != "python":
      for command in shell_commands(block.text):
        rule_for(command.removesuffix(ELIDED))
  for command in inline_commands(readme()):
    rule_for(command)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(sum(b.lang == "python"
                                            for b in fenced_blocks(README.read_text()))))
def test_python_block_runs(index, tmp_path, run_devices, demo_cache, monkeypatch):
  for name, value in compilation_cache_env().items():  # the session's compiled programs
    monkeypatch.setenv(name, value)
  block = [b for b in fenced_blocks(readme()) if b.lang == "python"][index]
  code = Workspace(tmp_path).substitute(block.text)
  if f"127.0.0.1:{README_PORT}" in code:
    return  # a client of the README's server: test_readme_commands_run runs it against it
  run_devices(code, devices=8)


def _shell_cases():
  cases = []
  for block in fenced_blocks(README.read_text()):
    if block.lang != "python":
      cases += [(f"line{block.line}", c) for c in shell_commands(block.text)]
  cases += [("inline", c) for c in inline_commands(README.read_text())]
  return cases


@pytest.mark.slow
def test_readme_commands_run(tmp_path, demo_cache):
  """Runs every command in README order (a block's commands may use what earlier ones made).

  One test, so that the checkpoints written for `/ckpt/...` and the `runs/` dirs are shared
  by the commands that use them, as they are for a reader going down the README.
  """
  ws = Workspace(tmp_path)
  for path in CHECKPOINTS:  # the download commands' stand-ins exist before anything runs
    ws.checkpoint(path)
  previous: dict[str, str] = {}
  try:
    for where, command in _shell_cases():
      rule = rule_for(command.removesuffix(ELIDED))
      filled = fill_elision(command, previous.get(where))
      previous[where] = filled
      try:
        rule.run(ws.substitute(filled), ws)
      except AssertionError as e:
        raise AssertionError(f"README ({where}) `{command}`, covered by: {rule.why}\n{e}") from None
    clients = [b for b in fenced_blocks(readme())
               if b.lang == "python" and f"127.0.0.1:{README_PORT}" in b.text]
    for block in clients:  # the python client examples, against the README's server
      assert ws.server is not None, f"README line {block.line}: a client with no server"
      out = run_python(ws.server.substitute(ws.substitute(block.text)), devices=1)
      assert out.strip(), f"README line {block.line}: the client example printed nothing"
  finally:
    if getattr(ws, "server", None) is not None:
      ws.server.close()


def test_inline_paths_and_names_exist():
  """Inline spans that name a repo file, a `dllm_jax.` attribute, a CLI flag or a config key
  (`--config.a.b=...` or `a.b=...`) are real."""
  top = {p.name for p in REPO.iterdir()}
  flags = known_flags()
  for span in inline_spans(readme()):
    span = span.strip()
    if span.startswith(COMMAND_PREFIXES):
      continue
    for name in re.findall(r"\bdllm_jax(?:\.\w+)+", span):
      resolve(name)
    first = span.split("/")[0]
    if "/" in span and first in top and " " not in span:
      for path in expand_braces(span.split(":")[0]):
        assert (REPO / path).exists() or first == "runs", f"README names {path}: not in the repo"
    setting = re.fullmatch(r"([a-z_]\w*(?:\.[a-z_]\w*)+)=\S+", span)
    if setting:
      assert any(has_key(c, setting.group(1)) for c in configs()), (
          f"README sets {setting.group(1)}, but no config in configs/ has that key")
    for flag in re.findall(r"(?:^|\s)(--[\w.-]*\w)", span):
      if flag.startswith("--config."):
        key = flag.removeprefix("--config.")
        assert any(has_key(c, key) for c in configs()), (
            f"README mentions {flag}, but no config in configs/ has the key {key}")
      else:
        assert flag in flags, f"README mentions {flag}, which no documented CLI accepts"


def resolve(name: str):
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ModuleNotFoundError:
      continue
    for attr in parts[i:]:
      assert hasattr(obj, attr), f"README names {name}: {'.'.join(parts[:i])} has no {attr}"
      obj = getattr(obj, attr)
    return obj
  raise AssertionError(f"README names {name}, which does not import")


def expand_braces(path: str) -> list[str]:
  m = re.search(r"\{([^{}]+)\}", path)
  if not m:
    return [path]
  return [q for alt in m.group(1).split(",")
          for q in expand_braces(path[:m.start()] + alt + path[m.end():])]


def known_flags() -> set[str]:
  """Flags of the documented CLIs: dllm_jax.generate, experiments/{study,train}.py,
  dllm_jax.eval (lm-eval's `run` flags plus its own dry-run ones) and dllm_jax.serve."""
  from lm_eval._cli import HarnessCLI
  from dllm_jax import generate
  from dllm_jax.eval import __main__ as eval_cli
  from studylib import study as study_lib
  flags = {o for a in generate.build_parser()._actions for o in a.option_strings}
  flags |= set(study_lib.MODE_FLAGS) | {"--config", "--workdir"}
  run = HarnessCLI()._subparsers.choices["run"]
  flags |= {o for a in run._actions for o in a.option_strings}
  flags |= set(eval_cli.DRY_RUN_FLAGS) | {"--prompt_len", "--device_memory"}
  from dllm_jax.serve import cli as serve_cli_lib
  flags |= {o for a in serve_cli_lib.build_parser()._actions for o in a.option_strings}
  return flags


def configs() -> list:
  """get_config() of every file in configs/ (default arguments)."""
  out = []
  for path in sorted((REPO / "configs").glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"readme_cfg_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out.append(module.get_config())
  return out


def has_key(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return False
    node = node[part]
  return True
