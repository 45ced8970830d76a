"""The built-in demo: built by the package's trainer once per session into a temporary cache,
then every registered method (the hybrids with the demo's drafter) answers arithmetic with
it; builds are all-or-nothing."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dllm_jax import decoding, demo, generate, loading
from dllm_jax.decoding import registry
from dllm_jax.sampler import Sampler
from dllm_jax.training import trainer
from _jax_cache_env import compilation_cache_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Programs compiled here go to the session's persistent compilation cache, which the
# fresh-process CLI test passes on: its d2f decode loads instead of compiling again.
pytestmark = pytest.mark.usefixtures("compile_cache")


def _held_out(n=48, seed=7):
  rng = np.random.default_rng(seed)
  pairs = rng.integers(0, 100, (n, 2))  # the training distribution: operands in [0, 100)
  return [f"{a}+{b}=" for a, b in pairs], [str(a + b) for a, b in pairs]


# Greedy decoding with these equals greedy AR of the network that verifies (speculative: the
# AR target; selfspec: its own network); adaptive may commit the drafter's blocks unverified.
LOSSLESS = ("speculative", "selfspec")


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(registry.names()))
def test_every_method_adds(demo_cache, method):
  """Every registered method decodes with the demo (the hybrids with the demo's drafter): the
  README's `37+48=` gives 85 and >= 80% of 48 held-out sums are right.

  `37+48=` rides in the held-out batch (49 rows, the same 64-row batch bucket as 48): one
  compiled decode per method instead of a second one for a batch of 1. A row's answer does not
  depend on the rest of its batch with batch_invariant=True (test_sampler's
  test_batch_rows_equal_single_prompts and the serving tests check that exactly), and on
  these models not with the default either (docs/design.md, section 13); the one-string
  call is test_cli_demo_prints_the_answer's.
  """
  sampler = Sampler.load("demo", method)
  prompts, answers = _held_out()
  readme, *got = sampler.sample(["37+48="] + prompts)
  assert readme == "85", (method, readme)
  accuracy = np.mean([g == a for g, a in zip(got, answers)])
  assert accuracy >= 0.8, (method, accuracy, list(zip(got, answers))[:8])
  if method in LOSSLESS:  # the AR answers of the same network, token for token
    ar = sampler.replace(method="ar", options={"gen_length": sampler.options["gen_length"]})
    assert ar.sample(["37+48="] + prompts) == [readme] + got, method


@pytest.mark.slow
def test_hybrids_get_the_demo_drafter(demo_cache):
  """A method that drafts with a second model gets the demo model of its decoder's
  drafter_attention; speculative's `drafter` option picks the one that drafter decodes with."""
  path = demo.ensure()
  models = {name: loading.load_model(path / name, "ar") for name in demo.ORDER}

  def same(tree, name):
    return all(jax.tree.leaves(jax.tree.map(np.array_equal, tree, models[name].params)))

  for method in registry.drafter_methods():
    options = loading.load_model("demo", method).options(method)
    assert same(options["drafter_params"], "block_diffusion"), method  # D2F drafts by default
    assert options["drafter_cfg"] == models["block_diffusion"].cfg, method
    sampler = Sampler.load("demo", method)
    assert same(sampler.params, "ar") and same(sampler.options["drafter_params"],
                                               "block_diffusion"), method
  for drafter, name in (("ar", "ar"), ("selfspec", "selfspec"), ("d2f", "block_diffusion")):
    sampler = Sampler.load("demo", "speculative", drafter=drafter)
    assert same(sampler.options["drafter_params"], name), drafter
  assert "drafter_params" not in loading.load_model("demo", "ar").options("ar")


@pytest.mark.slow
def test_cached_build_is_reused(demo_cache, monkeypatch):
  path = demo.demo_dir()
  assert path.parent.parent == demo_cache and demo.is_built(path)
  assert json.loads((path / "recipe.json").read_text()) == demo.recipe()
  monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("retrained"))
  assert demo.ensure() == path
  assert demo.model_dir("d2f") == path / "block_diffusion"
  assert demo.model_dir("ar") == path / "ar" and demo.model_dir("llada") == path / "mdm"
  assert demo.model_dir("selfspec") == path / "selfspec"
  assert demo.model_dir("speculative") == path / "ar"
  assert demo.drafter_dir("adaptive") == path / "block_diffusion"
  assert demo.drafter_dir("d2f") is None


@pytest.mark.slow
@pytest.mark.parametrize("method", ["d2f", "speculative"])  # the hybrid without --drafter_model
def test_cli_demo_prints_the_answer(demo_cache, capsys, method):
  assert generate.main(["--model", "demo", "--method", method, "--prompt", "37+48="]) == 0
  assert capsys.readouterr().out == "85\n"


@pytest.mark.slow
def test_cli_demo_in_a_fresh_process(demo_cache):
  # The persistent compilation cache (pytestmark): the decode compiled in-process by
  # test_cli_demo_prints_the_answer loads from disk instead of compiling again.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **compilation_cache_env())
  proc = subprocess.run([sys.executable, "-m", "dllm_jax.generate", "--model", "demo",
                         "--method", "d2f", "--prompt", "37+48="], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout == "85\n"
  assert "first use" not in proc.stderr  # the session's cache was used


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
  monkeypatch.setenv(demo.CACHE_ENV, str(tmp_path))
  calls = []

  def interrupted(config, workdir):
    os.makedirs(workdir)
    (workdir / "config.json").write_text("{}")
    calls.append(workdir)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return {}

  monkeypatch.setattr(trainer, "train", interrupted)
  with pytest.raises(KeyboardInterrupt):
    demo.ensure(log=lambda _: None)
  assert len(calls) == 2
  parent = demo.demo_dir().parent
  assert list(parent.iterdir()) == []  # neither the target nor a partial directory


def test_stale_partial_build_is_swept(tmp_path, monkeypatch):
  monkeypatch.setenv(demo.CACHE_ENV, str(tmp_path))
  target = demo.demo_dir()
  target.parent.mkdir(parents=True)
  dead = target.parent / f".{target.name}.partial-999999999-x"  # no such process
  live = target.parent / f".{target.name}.partial-{os.getpid()}-y"
  dead.mkdir()
  live.mkdir()

  def fake_train(config, workdir):
    os.makedirs(workdir / "checkpoints")
    return {}

  monkeypatch.setattr(trainer, "train", fake_train)
  assert demo.ensure(log=lambda _: None) == target
  assert demo.is_built(target) and not dead.exists() and live.exists()


def test_every_method_has_a_demo_model():
  """The demo's models are picked by attention pattern, so every registered method (and its
  drafter) has one; a method of another pattern is named."""
  for method in registry.names():
    assert demo.model_for(method) in demo.ORDER, method
    assert demo.drafter_for(method) in (None, *demo.ORDER), method
  assert demo.drafter_for("speculative") == "block_diffusion" and demo.drafter_for("ar") is None
  with pytest.raises(ValueError, match="Unknown decoding method 'beam'"):
    demo.model_for("beam")
  with pytest.raises(ValueError, match="no model trained with attention 'sliding'"):
    demo.model_for_attention("sliding")
