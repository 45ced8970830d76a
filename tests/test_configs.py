"""Every experiment config loads, is locked, and builds its train state abstractly.

The state (params + optimizer moments) is traced with `jax.eval_shape` and sharded over an
abstract mesh of the config's shape, so even the 8B config costs no memory.
"""

import glob
import importlib.util
import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import traverse_util
from ml_collections import config_dict

from dllm_jax.parallel import mesh as mesh_lib
from dllm_jax.training import config as config_lib
from dllm_jax.training import experiment
from dllm_jax.training import optimizer as opt_lib
from dllm_jax.training import state as state_lib
from studylib import study as study_lib
from _no_jax import env_without_jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _is_training_config(path):
  """Training experiments end with `config_lib.finalize(...)` (other configs/ files, e.g. the
  study's, configure other entry points)."""
  with open(path) as f:
    return "config_lib.finalize(" in f.read()


CONFIGS = sorted(p for p in glob.glob(os.path.join(REPO, "configs", "*.py"))
                 if _is_training_config(p))
ABSTRACT_DEVICES = 8  # a mesh axis of -1 takes this many devices


def load_module(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load(path):
  return load_module(path).get_config()


STUDY_CONFIG = os.path.join(REPO, "configs", "study.py")


def abstract_mesh(shape):
  sizes = {a: int(shape.get(a, 1)) for a in mesh_lib.MESH_AXES}
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  sizes = {a: (ABSTRACT_DEVICES // fixed if s == -1 else s) for a, s in sizes.items()}
  return jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))


def test_the_expected_configs_exist():
  names = {os.path.basename(p)[:-3] for p in CONFIGS}
  assert {"ar_tiny", "mdm_tiny", "block_diffusion_tiny", "d2f_tiny", "llada_8b_d2f",
          "ar_100m", "mdm_100m"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p)[:-3])
def test_config_builds_abstract_state(path):
  config = load(path)
  with pytest.raises(AttributeError, match="stpes"):
    config.train.stpes = 10  # locked: a typo is an error, not a new key
  model_cfg = config_lib.model_config(config)
  tx = opt_lib.make_optimizer(config.opt, int(config.train.steps))
  boxed = state_lib.abstract_state(model_cfg, tx, config.opt.trainable)
  mesh = abstract_mesh(dict(config.mesh.shape))
  shardings = state_lib.state_shardings(boxed, mesh, mesh_lib.rules_from_config(config.mesh.rules))
  assert jax.tree.structure(shardings) == jax.tree.structure(nn.unbox(boxed))

  params = traverse_util.flatten_dict(nn.unbox(boxed.params))
  base = sum(int(np.prod(v.shape)) for k, v in params.items() if not k[-1].startswith("lora"))
  assert base == model_cfg.num_params()
  moments = traverse_util.flatten_dict(boxed.opt_state[1][0].mu)
  trained, _ = opt_lib.partition(nn.unbox(boxed.params), config.opt.trainable)
  assert set(moments) == set(traverse_util.flatten_dict(trained))  # frozen: no state
  if config.objective.name == "d2f":
    assert {k[-1] for k in moments} == {"lora_a", "lora_b"}
  if config.data.tokenizer in config_lib.TOKENIZERS:  # buildable offline: check it all
    with config.unlocked():
      config.mesh.shape = {"data": 1, "fsdp": 1, "tensor": 1}
    exp = experiment.build(config, devices=jax.devices()[:1])  # data, objective, decoder
    assert exp.layout.seq_len <= model_cfg.max_seq_len


def test_llada_d2f_recipe():
  config = load(os.path.join(REPO, "configs", "llada_8b_d2f.py"))
  model_cfg = config_lib.model_config(config)
  assert 7.9e9 < model_cfg.num_params() < 8.1e9
  assert (model_cfg.lora_rank, model_cfg.lora_alpha, model_cfg.lora_dropout) == (32, 32.0, 0.1)
  assert config.objective.options.block_size == config.data.block_size == 16
  o = config.opt
  assert (o.b1, o.b2, o.weight_decay, o.lr, o.clip_norm) == (0.9, 0.95, 0.05, 1e-5, 1.0)


def test_command_line_typo_is_an_error(tmp_path):
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "train.py"),
       "--config", os.path.join(REPO, "configs", "ar_tiny.py"), "--config.train.stpes=3",
       "--workdir", str(tmp_path / "run")],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0
  assert 'Did you mean "steps"' in proc.stderr
  assert not (tmp_path / "run").exists()


STUDY_MODES = ["", "short", "long", "full", "tradeoff"]


@pytest.mark.parametrize("mode", STUDY_MODES)
def test_every_study_mode_trains_valid_models(mode, tmp_path):
  """Each mode's three training configs validate, fit their rows and build abstractly: the
  accelerator mode cannot be run here, so this is its guard against a config that fails
  only when a device is finally lent."""
  from studylib import models as models_lib
  from dllm_jax.training import data as data_lib
  module = load_module(STUDY_CONFIG)
  study = module.get_config(mode)
  for name in models_lib.training_order(study):
    config = models_lib.training_config(study, name, tmp_path)
    config_lib.validate(config)
    model_cfg = config_lib.model_config(config)
    tok = data_lib.make_tokenizer(config.data)
    data_lib.check_compatible(model_cfg, tok, data_lib.make_layout(config.data, tok))
    tx = opt_lib.make_optimizer(config.opt, int(config.train.steps))
    boxed = state_lib.abstract_state(model_cfg, tx, config.opt.trainable)
    assert jax.tree.leaves(boxed.params)
  d2f_block = study.models.d2f.objective.options["block_size"]
  assert module._gen_length(study.data) % d2f_block == 0  # the student's blocks tile G
  # The MDM starts from the AR model only with Dream's shifted logits (the AR model's
  # prediction for slot i sits at i - 1); the student inherits its MDM's convention.
  cfgs = {n: config_lib.model_config(models_lib.training_config(study, n, tmp_path))
          for n in models_lib.training_order(study)}
  mdms = [n for n in cfgs if models_lib.is_mdm(n)]
  assert {cfgs[n].shift_logits for n in mdms + ["d2f"]} == {bool(study.mdm_from_ar)}
  # The default (mixed suite), short and long modes (and the trade-off mode on the short
  # mode's models) adapt the AR model; the accelerator mode trains its MDM from scratch.
  assert study.mdm_from_ar == (mode in ("", "short", "long", "tradeoff"))
  assert study.eval.headline_task in {t.split(":")[0] for t in study.data.tasks.split(",")}
  with pytest.raises(ValueError, match="unknown study mode"):
    module.get_config("fast")


def test_default_study_mode_mixes_safe_short_and_failing_tasks():
  """The default mode shows both sides: long worked answers (the headline, half the data), a
  copying-like task, short answers and the task where parallel commits fail; G covers the
  longest answer, the eval is >= 128 prompts with a disjoint calibration split after it, and
  the task-tagged adaptive cells leave their tag map to the calibration."""
  from dllm_jax.data.tasks import TaskSuite
  module = load_module(STUDY_CONFIG)
  study = module.get_config("")
  suite = TaskSuite.parse(study.data.tasks)
  names = {s.name for s in suite.specs}
  assert names == {"long_addition", "sorting", "arithmetic_reversed", "running_sum"}
  assert study.eval.headline_task == "long_addition"
  assert module._gen_length(study.data) == 32 >= suite.max_answer_len + 1
  assert study.eval.num_prompts >= 128
  assert study.eval.num_prompts + study.eval.calibration_prompts <= study.data.eval_size
  weights = {s.name: s.weight for s in suite.specs}
  assert weights["long_addition"] == max(weights.values())  # the headline: the largest share
  tagged = [c for c in study.methods if c.get("task_tags")]
  assert tagged and all(c["method"] == "adaptive" and c["calibrate"] for c in tagged)
  assert all("task_modes" not in c["options"] for c in tagged)
  labels = [c["label"] for c in study.methods]
  # The compact grid, plus the cells of the two narrow drafters: the accelerated AR baseline
  # (speculative AR, `ar_draft`) and the lightweight diffusion drafter (`bd_draft`).
  drafter_cells = [module.ACCELERATED_AR_LABEL] + [
      f"speculative narrow-bd k={k}" for k in module.BD_DRAFTER_KS]
  assert sorted(labels) == sorted(list(module.DEFAULT_CELLS) + drafter_cells)
  assert len(set(labels)) == len(labels)
  bd = study.models.bd_draft
  assert bd.objective.name == "block_diffusion" and bd.model.shift_logits
  assert bd.objective.options["block_size"] == study.models.d2f.objective.options["block_size"]
  assert {k: bd.model[k] for k in module.DRAFT_WIDTH} == module.DRAFT_WIDTH
  assert bd.train.steps == study.models.mdm.train.steps
  # The narrow AR drafter trains with the AR model's recipe, its steps included (STEPS'
  # comment counts its cost with the AR model's).
  assert study.models.ar_draft.train.steps == study.models.ar.train.steps
  assert module.get_config("short").data.tasks == "arithmetic:1"



def test_long_study_mode_decodes_answers_of_at_least_128_tokens_at_equal_g():
  """`--long`: every answer is >= 128 tokens (the regime of the published 50x), G covers the
  longest, vanilla LLaDA is at its published setting (semi-autoregressive blocks of 32, steps
  = G, no early stop, low-confidence remasking) and D2F, Fast-dLLM and both hybrids decode the
  same G."""
  from dllm_jax.data.tasks import TASK_ALPHABET, TaskSuite, examples
  from dllm_jax.data.tokenizers import CharTokenizer
  module = load_module(STUDY_CONFIG)
  study = module.get_config("long")
  suite = TaskSuite.parse(study.data.tasks)
  tok = CharTokenizer(TASK_ALPHABET)
  lengths = [len(tok.encode(e.answer)) for e in examples(suite, 500, seed=1, split="test")]
  assert min(lengths) >= 128
  g = module._gen_length(study.data)
  assert g == 192 >= suite.max_answer_len + 1
  assert study.eval.headline_task == "addition_sheet" and study.mdm_from_ar
  cells = {c["label"]: c for c in study.methods}
  assert list(cells) == [l for l in cells if l in module.LONG_CELLS]
  assert len(cells) == len(module.LONG_CELLS)
  vanilla = cells[study.eval.llada_vanilla_label]
  assert vanilla["method"] == "llada"
  assert study_lib.resolve_options(dict(vanilla["options"]), g) == {
      "gen_length": g, "block_length": 32, "early_stop": False}
  assert {c["method"] for c in cells.values()} >= {"ar", "llada", "fast_dllm", "d2f",
                                                    "speculative", "adaptive"}
  for name in ("ar", "mdm", "d2f"):
    assert study.models[name].model.max_seq_len >= suite.max_prompt_len + g + 1


@pytest.mark.parametrize("g", [192, 384])
def test_long_study_mode_takes_g_as_one_flag(g, tmp_path):
  """`--config.data.gen_length=384` is all a wider G takes: the layout and every model's
  window follow it, the competitors keep their published blocks, and every model's rows still fit
  its window."""
  from studylib import models as models_lib
  from dllm_jax.training import data as data_lib
  module = load_module(STUDY_CONFIG)
  study = module.get_config("long")
  study.data.gen_length = g  # what the flag sets (the config is locked: the key must exist)
  for name in models_lib.training_order(study):
    config = models_lib.training_config(study, name, tmp_path)
    tok = data_lib.make_tokenizer(config.data)
    layout = data_lib.make_layout(config.data, tok)
    assert layout.seq_len - layout.prompt_len == g
    data_lib.check_compatible(config_lib.model_config(config), tok, layout)
    assert config.model.max_seq_len == g + module.LONG_WINDOW_ABOVE_G
  blocks = {c["label"]: study_lib.resolve_options(dict(c["options"]), g).get("block_length")
            for c in study.methods}
  # the competitors at their published blocks (32), whatever G
  assert blocks["llada steps=G"] == 32 and blocks["fast-dllm tau=0.9 dual"] == 32
  assert blocks["d2f k=16 tau=0.9"] == 16  # fixed blocks stay fixed


def test_gen_length_must_hold_the_answers_and_tile_the_blocks():
  from dllm_jax.training import data as data_lib
  module = load_module(STUDY_CONFIG)
  data = config_dict.ConfigDict(module.get_config("long").data.to_dict())
  tok = data_lib.make_tokenizer(data)
  data.gen_length = 160  # the longest answer + EOS is 164 tokens
  with pytest.raises(ValueError, match=r"gen_length.*cannot hold the longest answer.*164"):
    data_lib.make_layout(data, tok)
  data.gen_length = 200  # not a multiple of the canvas block, 32
  with pytest.raises(ValueError, match=r"not a multiple of block_size=32; use 224"):
    data_lib.make_layout(data, tok)


def test_study_mode_flags_and_default_workdirs(tmp_path):
  """`--long` / `--full` stand for the mode's --config (overrides still parse); each mode has
  its own default workdir."""
  from studylib import study as study_lib
  expand = study_lib.expand_mode_flags
  assert expand(["s", "--workdir=w"]) == ["s", "--workdir=w"]
  assert expand(["s", "--full", "--config.eval.seed=1"]) == [
      "s", "--config=configs/study.py:full", "--config.eval.seed=1"]
  for argv in (["s", "--long", "--full"], ["s", "--full", "--config=configs/study.py"],
               ["s", "--long", "--config", "configs/study.py:long"]):
    with pytest.raises(ValueError, match="pass one study mode"):
      expand(argv)
  module = load_module(STUDY_CONFIG)
  assert [study_lib.default_workdir(module.get_config(m)) for m in STUDY_MODES] == [
      "runs/study", "runs/study_short", "runs/study_long", "runs/study_full",
      "runs/study"]  # the trade-off mode loads the default mode's models
  assert expand(["s", "--short"]) == ["s", "--config=configs/study.py:short"]
  # The script itself: flags parse (the run then stops at a workdir that cannot be made).
  (tmp_path / "file").write_text("")
  script = os.path.join(REPO, "experiments", "study.py")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, script, "--full", "--config.eval.seed=1",
                         "--config.eval.num_prompts=2", f"--workdir={tmp_path}/file/run"],
                        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode != 0 and "Flags parsing error" not in proc.stderr
  assert f"{tmp_path}/file" in proc.stderr
  proc = subprocess.run([sys.executable, script, "--long", "--full"], cwd=REPO,
                        capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 1 and "pass one study mode" in proc.stderr
  proc = subprocess.run([sys.executable, script, "--seeds=0"], cwd=REPO,
                        capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode != 0 and "--seeds must be >= 1" in proc.stderr


def test_every_config_loads_without_jax(tmp_path):
  """Configs are plain data: each configs/*.py, in every mode it has (`MODES`), builds its
  ConfigDict without importing JAX, so a command-line typo is reported before JAX loads
  (experiments/_config_args.py)."""
  code = f"""
import glob, importlib.util, os, sys
for path in sorted(glob.glob(os.path.join({REPO!r}, "configs", "*.py"))):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for mode in getattr(module, "MODES", [None]):
    config = module.get_config() if mode is None else module.get_config(mode)
    assert config.to_dict()
    print(os.path.basename(path), repr(mode))
assert "jax" not in sys.modules and "flax" not in sys.modules
"""
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env_without_jax(tmp_path),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  expected = [f"{os.path.basename(path)} {mode!r}"
              for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
              for mode in getattr(load_module(path), "MODES", [None])]
  assert proc.stdout.splitlines() == expected
  assert len(expected) > len(CONFIGS) + 5  # the study's and the scaling sweep's modes


@pytest.mark.parametrize("script", ["study", "train", "serve_bench", "scaling", "bench_decode",
                                    "bench_data_parallel", "calibrate_adaptive", "bench_step"])
def test_experiment_scripts_find_their_configs_from_any_directory(script, tmp_path):
  """Run from another directory, `configs/...` is the repository's (an override of a key it
  lacks is then reported against it, so the config was found); a config file found nowhere,
  or an override naming no key, is one line, not a traceback, and comes before JAX loads (the
  scripts run here with a `jax` that cannot be imported)."""
  path = os.path.join(REPO, "experiments", f"{script}.py")
  env = env_without_jax(tmp_path)
  run = lambda *args: subprocess.run([sys.executable, path, *args], cwd=tmp_path, env=env,
                                     capture_output=True, text=True, timeout=300)
  proc = run("--config=configs/nope.py", f"--workdir={tmp_path}/w")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      f"{script}.py: config file 'configs/nope.py' not found (a path relative to the working "
      "directory, or configs/... of this repository).")
  given = ["--config=configs/ar_tiny.py"] if script == "train" else []  # train: no default
  proc = run(*given, "--config.no_such_key=1", f"--workdir={tmp_path}/w")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      f"{script}.py: a --config override names no key of the config: no_such_key")


@pytest.mark.parametrize("mode", STUDY_MODES)
def test_every_study_cell_traces_at_its_mode_shapes(mode, tmp_path):
  """Each decoding cell of each mode is a valid decode at that mode's G and prompt length:
  options, block counts and shapes are checked by tracing the real decoder (no compile, no
  memory), so an accelerator run cannot fail on a cell only reachable there. Each cell runs
  on its own model(s) as the study prepares them (LoRA merged, active vocab), bound by the
  study's own `bind_cell` (a speculative or adaptive cell gets the D2F student as its
  drafter; a task-tagged adaptive cell gets a task name per row, as the runner passes it)."""
  from dllm_jax.models.transformer import abstract_params
  from studylib import models as models_lib, study as study_lib
  from dllm_jax.training import checkpoint as ckpt_lib
  from dllm_jax.training import data as data_lib
  module = load_module(STUDY_CONFIG)
  study = module.get_config(mode)
  cfgs = {name: config_lib.model_config(models_lib.training_config(study, name, tmp_path))
          for name in models_lib.training_order(study)}
  tok = data_lib.make_tokenizer(study.data)
  layout = data_lib.make_layout(study.data, tok)
  gen_length = layout.seq_len - layout.prompt_len
  tokens = np.full((1, layout.prompt_len), 5, np.int32)
  params = {name: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                               nn.unbox(abstract_params(cfg))) for name, cfg in cfgs.items()}
  labels = [c["label"] for c in study.methods]
  assert len(labels) == len(set(labels))
  assert {c["method"] for c in study.methods} >= {"ar", "llada", "fast_dllm", "d2f",
                                                  "block_diffusion", "speculative"} | (
      set() if mode == "tradeoff" else {"adaptive"})
  task = study.data.tasks.split(":")[0]
  names = {part.split(":")[0] for part in study.data.tasks.split(",")}
  for cell in study.methods:
    if cell.get("calibrate"):  # as the study's calibration step fills it (any of its modes)
      cell = {**cell, "options": {**cell["options"],
                                  "task_modes": {n: "verify" for n in names}}}
    def decode(p, cell=dict(cell)):
      trained = {n: models_lib.with_active_vocab(models_lib.for_decoding(
          ckpt_lib.TrainedModel(p[n], cfgs[n], None)), tok.vocab_size) for n in cfgs}
      fn, cell_params, _ = study_lib.bind_cell(cell, trained, gen_length)
      extra = {"tasks": [task]} if cell.get("task_tags") else {}
      return fn(cell_params, tokens, np.ones_like(tokens, bool), jax.random.key(0), **extra)
    out = jax.eval_shape(decode, params)
    assert out.tokens.shape == (1, gen_length), cell["label"]
