"""The study's checkpoint mode end to end on tiny checkpoints in the published layouts (LLaDA
+ D2F LoRA, LLaMA, a smaller LLaMA as drafter) and a 16-question GSM8K-format file: every
decoder the models allow has a cell at both batch sizes, the verdict is recomputed from the
stored cells, and tokens/s counts response tokens only."""

import json
import types

import numpy as np
import pytest

import tiny_llada
from dllm_jax.data import gsm8k
from studylib import accounting, checkpoint_study
from studylib import verdict as verdict_lib

G = 64
BATCHES = (1, 4)
N_SHOT = 1  # one shot: prompts of ~90 ids, longer than G (the tiny BPE spends ~3 ids a character)


QUESTIONS = [(f"What is {a} plus {b}?", f"{a}+{b}={a + b}\n#### {a + b}")
             for a, b in zip(range(3, 19), range(20, 4, -1))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpts")
  paths = {"diffusion": tiny_llada.write_llada_instruct(root / "llada"),
           "d2f_adapter": tiny_llada.write_d2f_adapter(root / "d2f_lora"),
           "ar": tiny_llada.write_llama_instruct(root / "llama", layers=2, seed=3),
           "drafter": tiny_llada.write_llama_instruct(root / "llama_draft", layers=1,
                                                      seed=4)}
  eval_set = root / "gsm8k_test.jsonl"
  eval_set.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                              for q, a in QUESTIONS))
  return {k: str(v) for k, v in paths.items()}, str(eval_set)


def study_config(paths, eval_set):
  import importlib.util
  import os
  spec = importlib.util.spec_from_file_location(
      "study_cfg", os.path.join(os.path.dirname(__file__), "..", "configs", "study.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("checkpoints")
  c.unlock()
  for key, path in paths.items():
    c.checkpoints[key] = path
  c.checkpoints.dtype = "float32"
  c.eval_set.source = eval_set
  c.eval_set.limit = 16
  c.eval_set.n_shot = N_SHOT
  c.gen_length = G
  c.eval.batch_sizes = BATCHES
  c.lock()
  return c


@pytest.mark.slow
def test_checkpoint_mode_end_to_end(checkpoints, tmp_path):
  paths, eval_set = checkpoints
  c = study_config(paths, eval_set)
  doc = checkpoint_study.run(c, tmp_path, log=lambda *_: None)
  stored = json.loads((tmp_path / "study.json").read_text())
  assert (tmp_path / "study.md").is_file() and (tmp_path / "study_pareto.png").is_file()

  # Every decoder the models allow ran at both batch sizes; only the cell whose drafter
  # would have to be a diffusion model (this drafter is AR) was skipped, with the reason.
  allowed = [m["label"] for m in c.methods if m["label"] != "speculative diffusion-drafter k=16"]
  assert [s["label"] for s in stored["skipped"]] == ["speculative diffusion-drafter k=16"]
  assert "an AR model" in stored["skipped"][0]["reason"]
  for b in BATCHES:
    assert [r["label"] for r in stored["results"] if r["batch_size"] == b] == allowed
  methods = {r["method"] for r in stored["results"]}
  assert methods == {"ar", "speculative", "llada", "fast_dllm", "d2f", "block_diffusion",
                     "adaptive"}

  # The verdict is the one its stored cells give: re-derived here from the cells alone.
  results = [accounting.MethodResult.from_json(r) for r in stored["results"]]
  again = verdict_lib.judge(results, task="gsm8k", llada_label="vanilla steps=G",
                            platform=stored["machine"]["platform"],
                            accelerated_ar_label="speculative ar k=4")
  assert json.loads(json.dumps(again)) == stored["verdict"]
  assert verdict_lib.recompute(stored) == stored["verdict"]
  assert {cl["id"] for cl in stored["verdict"]["claims"]} == {
      cl.id for cl in verdict_lib.CLAIMS}
  for claim in stored["verdict"]["claims"]:
    judged = [x["label"] for x in claim["cells"]]
    want = [r.label for r in results if r.batch_size == 1 and r.method == claim["method"]
            and r.label != "speculative ar k=4"]
    assert judged == want, claim["id"]

  # Responses, scores and the tally agree; tokens/s counts response tokens only.
  responses = [json.loads(x) for x in (tmp_path / "responses.jsonl").read_text().splitlines()]
  problems = gsm8k.read(eval_set)
  for r in stored["results"]:
    rows = [x for x in responses if x["label"] == r["label"]
            and x["batch_size"] == r["batch_size"]]
    assert sorted(x["index"] for x in rows) == list(range(16))
    for x in rows:
      assert gsm8k.score(x["response"], problems[x["index"]].answer) == {
          "strict": x["strict"], "flexible": x["flexible"]}
      assert 0 <= x["response_tokens"] <= G
    assert r["num_correct"] == sum(x["strict"] for x in rows)
    assert r["response_tokens"] == sum(x["response_tokens"] for x in rows)
    assert r["tokens_per_s"] == pytest.approx(r["response_tokens"] / r["wall_s"])
    assert r["num_prompts"] == 16
  # The prompts are hundreds of tokens each; a count with them would pass 16 * G.
  assert min(stored["prompt_len"].values()) > G
  assert all(r["response_tokens"] <= 16 * G for r in stored["results"])
  scores = {(s["label"], s["batch_size"]): s for s in stored["gsm8k"]["cells"]}
  assert len(scores) == len(stored["results"])
  assert stored["gsm8k"]["n_shot"] == N_SHOT and doc["verdict"] == stored["verdict"]

  # The greedy hybrids reproduce AR's answers exactly; batch 4 answers what batch 1 does
  # for AR (per-row keys, greedy).
  text = {(x["label"], x["batch_size"], x["index"]): x["response"] for x in responses}
  for i in range(16):
    for label in ("speculative ar k=4", "speculative d2f k=16"):
      assert text[(label, 1, i)] == text[("ar", 1, i)]


def test_cells_the_models_do_not_allow_are_named(checkpoints):
  """Without a D2F adapter or an AR model, their cells are skipped with the config key to set;
  a drafter with another tokenizer is refused for the hybrids."""
  paths, eval_set = checkpoints
  c = study_config({"ar": None, "diffusion": paths["diffusion"], "d2f_adapter": None,
                    "drafter": None}, eval_set)
  from dllm_jax import loading
  llada = loading.load_model(paths["diffusion"], "llada")
  cells, skipped = checkpoint_study.plan_cells(c, {"diffusion": llada.cfg},
                                               {"diffusion": llada.tokenizer})
  assert [x["label"] for x in cells] == [
      "vanilla steps=G", "semi-ar k=32 steps=G", "fast-dllm k=32 tau=0.9 prefix",
      "fast-dllm k=32 tau=0.9 dual"]
  reasons = {s["label"]: s["reason"] for s in skipped}
  assert "checkpoints.d2f_adapter" in reasons["d2f k=32 tau=0.9"]
  assert "checkpoints.ar" in reasons["ar"]
  # A drafter whose tokenizer differs from the target's: the hybrids are skipped.
  ar = loading.load_model(paths["ar"], "ar")
  foreign = types.SimpleNamespace(backend=tiny_llada.train_bpe(["<|x|>"] + tiny_llada.SPECIALS))
  cells, skipped = checkpoint_study.plan_cells(
      c, {"ar": ar.cfg, "diffusion": llada.cfg, "d2f": llada.cfg},
      {"ar": ar.tokenizer, "diffusion": llada.tokenizer, "d2f": foreign})
  reasons = {s["label"]: s["reason"] for s in skipped}
  assert "tokenizer is not the ar model's" in reasons["speculative d2f k=16"]
  assert "tokenizer is not the ar model's" in reasons["adaptive k=16"]
  assert not checkpoint_study.same_tokenizer(foreign, ar.tokenizer)
  assert checkpoint_study.same_tokenizer(llada.tokenizer, ar.tokenizer)


def test_bad_configs_fail_before_loading(checkpoints):
  paths, eval_set = checkpoints
  c = study_config({"ar": None, "diffusion": None, "d2f_adapter": None, "drafter": None},
                   eval_set)
  with pytest.raises(checkpoint_study.CheckpointStudyError, match="checkpoints.ar and/or"):
    checkpoint_study.check_config(c)
  c = study_config({"ar": None, "diffusion": None, "d2f_adapter": paths["d2f_adapter"],
                    "drafter": None}, eval_set)
  with pytest.raises(checkpoint_study.CheckpointStudyError, match="checkpoints.diffusion too"):
    checkpoint_study.check_config(c)
  c = study_config(paths, eval_set)
  c.unlock()
  c.mesh = "fsdp=8"
  with pytest.raises(checkpoint_study.CheckpointStudyError, match="not JSON"):
    checkpoint_study.check_config(c)
  c.mesh = None
  c.eval_set.score = "loose"
  with pytest.raises(checkpoint_study.CheckpointStudyError, match="strict"):
    checkpoint_study.check_config(c)


def test_prompt_too_long_for_the_window_names_the_fix(checkpoints):
  paths, eval_set = checkpoints
  c = study_config(paths, eval_set)
  exs, _ = checkpoint_study.examples(c)
  from dllm_jax import loading
  ar = loading.load_model(paths["ar"], "ar")
  layout = checkpoint_study.PromptLayout(ar.tokenizer, ar.cfg)
  with pytest.raises(checkpoint_study.CheckpointStudyError, match="lower eval_set.n_shot"):
    checkpoint_study._prompt_len(layout, exs, ar.cfg.replace(max_seq_len=128), G, "ar")
  assert np.all(layout.encode_prompts(["Question: x\nAnswer:"], 32)["valid"][0, -3:])


def test_dry_run_plans_every_allowed_cell_from_config_files(checkpoints):
  """`--dry-run` (dllm_jax.dry_run): one plan per cell the checkpoints allow, read from
  config.json and tokenizer.json; a budget too small is refused in one line."""
  from dllm_jax import dry_run as dry_run_lib
  paths, eval_set = checkpoints
  c = study_config(paths, eval_set)
  plans = checkpoint_study.dry_run(c, log=lambda *_: None)
  labels = [m["label"] for m in c.methods if m["label"] != "speculative diffusion-drafter k=16"]
  assert [p.method for p in plans] == [
      next(m["method"] for m in c.methods if m["label"] == label) for label in labels]
  assert all(p.batch == max(BATCHES) and p.gen_length == G for p in plans)
  c.unlock()
  c.device_memory = "1MiB"
  with pytest.raises(dry_run_lib.DoesNotFit):
    checkpoint_study.dry_run(c, log=lambda *_: None)
