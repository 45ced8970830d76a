"""The study's checkpoint mode: published checkpoints, a GSM8K-format set, every decoder.

    doc = run(get_config("checkpoints"), "runs/study_checkpoints")  # configs/study.py

Loads the AR, diffusion, D2F (diffusion + LoRA adapter, merged) and drafter checkpoints the
config names (`dllm_jax.loading`: HF, converted or training-run directories), builds each
question's n-shot prompt (`dllm_jax.data.gsm8k`: lm-eval's gsm8k format and shots), and
decodes the same questions with every cell of `config.methods` the models allow, at every
batch size of `eval.batch_sizes`, timed as the synthetic modes time them (runner.py). A cell
the checkpoints do not allow (no such checkpoint, a drafter of the wrong kind or with another
tokenizer, G not a multiple of its block) is listed under `skipped` with the reason.

Prompts are encoded with the tokenizer of the cell's target model, so the cells of one
tokenizer (the AR model's and its hybrids'; the diffusion model's and D2F's) are timed
together, round-robin, and the two groups one after the other.

Accounting (accounting.py): tokens/s counts response tokens only, the ids before the first
stop token (never the prompt, never padding rows); NFE and tokens per forward beside it. A
response's text is cut at the task's stop strings as `Sampler` cuts it, then scored by both of
lm-eval's filters (strict `#### N` and flexible last number); `eval_set.score` picks the one
behind each cell's accuracy and the verdict, and both are in `study.json["gsm8k"]`. Every
response is kept in `responses.jsonl` (cell, batch, question, cut text, tokens, both scores).

Outputs in `workdir`, as the synthetic modes: `study.md`, `study.json` (cells, verdict,
skipped cells, models, GSM8K scores), `study_pareto.png`, and `responses.jsonl`.
`dry_run(config)` (`--dry-run`) plans the run's memory from config.json alone.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from dllm_jax import loading
from dllm_jax.data import gsm8k
from dllm_jax.data.tasks import Example
from dllm_jax.decoding import base
from dllm_jax.sampler import decode_text, encode_text
from studylib import accounting, hostclock, report, roofline, runner
from studylib import study as study_lib
from studylib import verdict as verdict_lib

TASK = "gsm8k"
RESPONSES = "responses.jsonl"
# Which checkpoint's tokenizer encodes a cell's prompts: its target model's.
TOKENIZER_OF = {"ar": "ar", "diffusion": "diffusion", "d2f": "diffusion"}
# Methods that decode by unmasking: the model needs a mask token.
DIFFUSION_METHODS = ("llada", "dream", "fast_dllm", "d2f", "block_diffusion")


class CheckpointStudyError(study_lib.StudyConfigError):
  """A checkpoint-mode config that cannot run, named before anything is decoded."""


@dataclasses.dataclass(frozen=True)
class Model:
  """One checkpoint of the study: what decoding needs and where it came from."""
  params: object
  cfg: object
  tokenizer: object
  path: str
  kind: str


def _mesh_shape(text: str | None) -> dict | None:
  if not text:
    return None
  try:
    shape = json.loads(text)
  except json.JSONDecodeError as e:
    raise CheckpointStudyError(f"mesh={text!r} is not JSON ({e.msg}); write it like "
                               "'{\"fsdp\": 8}'.") from None
  if not isinstance(shape, dict):
    raise CheckpointStudyError(f"mesh={text!r} must be a JSON object of axis sizes, e.g. "
                               "'{\"fsdp\": 8}'.")
  return shape


def check_config(c) -> None:
  """Raises CheckpointStudyError for a config that cannot run (before anything loads)."""
  paths = {k: c.checkpoints[k] for k in ("ar", "diffusion", "d2f_adapter", "drafter")}
  if paths["d2f_adapter"] and not paths["diffusion"]:
    raise CheckpointStudyError("checkpoints.d2f_adapter is the LoRA of the diffusion model: "
                               "set --config.checkpoints.diffusion too.")
  if not (paths["ar"] or paths["diffusion"]):
    raise CheckpointStudyError(
        "the checkpoint mode needs --config.checkpoints.ar and/or "
        "--config.checkpoints.diffusion (model directories); none is set.")
  if any(str(p) == "demo" for p in paths.values() if p):
    raise CheckpointStudyError("'demo' is not a GSM8K model; pass checkpoint directories "
                               "(the synthetic modes study the demo's kind of model).")
  if not c.eval_set.source:
    raise CheckpointStudyError("set --config.eval_set.source: a GSM8K-format .jsonl / "
                               ".parquet file, or a hub / tfds: name the machine reaches.")
  if c.eval_set.score not in gsm8k.FILTERS:
    raise CheckpointStudyError(f"eval_set.score={c.eval_set.score!r}: use one of "
                               f"{gsm8k.FILTERS}.")
  _mesh_shape(c.mesh)


def load_models(c, mesh=None, *, log=print) -> dict[str, Model]:
  """{name: Model} of the configured checkpoints: "ar", "diffusion", "d2f" (the diffusion
  model with the D2F adapter merged in) and "drafter"; HF weights in `checkpoints.dtype`."""
  wanted = {"ar": (c.checkpoints.ar, None), "diffusion": (c.checkpoints.diffusion, None),
            "d2f": (c.checkpoints.diffusion if c.checkpoints.d2f_adapter else None,
                    c.checkpoints.d2f_adapter),
            "drafter": (c.checkpoints.drafter, None)}
  models = {}
  for name, (path, adapter) in wanted.items():
    if not path:
      continue
    kind = loading.detect_kind(Path(path))
    if adapter and kind != "hf":
      raise CheckpointStudyError(f"the D2F adapter applies to a HF checkpoint, but "
                                 f"checkpoints.diffusion={path} is a {kind} directory.")
    started = time.perf_counter()
    loaded = loading.load_model(path, "ar" if name == "ar" else "d2f",
                                dtype=c.checkpoints.dtype if kind == "hf" else None,
                                adapter=adapter, merge_lora=adapter is not None, mesh=mesh)
    models[name] = Model(loaded.params, loaded.cfg, loaded.tokenizer, str(path), kind)
    log(f"[study] {name}: loaded {path}{f' + {adapter}' if adapter else ''} ({kind}, "
        f"{time.perf_counter() - started:.1f} s)")
  return models


def _vocab(tokenizer) -> dict | None:
  backend = getattr(tokenizer, "backend", None)
  return None if backend is None else backend.get_vocab(with_added_tokens=True)


def same_tokenizer(a, b) -> bool:
  """Whether two checkpoints' tokenizers give the same ids (HF vocabularies, or the same
  data tokenizer)."""
  va, vb = _vocab(a), _vocab(b)
  if va is None or vb is None:
    return type(a) is type(b) and a.vocab_size == b.vocab_size and (
        a.decode(list(range(a.vocab_size))) == b.decode(list(range(b.vocab_size))))
  return va == vb


def plan_cells(c, cfgs: dict, tokenizers: dict) -> tuple[list[dict], list[dict]]:
  """(cells to run, skipped) from `config.methods`, given each present model's config and
  tokenizer. A cell runs with its options resolved for G (`study.resolve_options`) and the
  vanilla cells on a Dream checkpoint as method "dream"; a skipped cell is {label, method,
  reason}."""
  g = int(c.gen_length)
  run, skipped = [], []
  for spec in c.methods:
    cell = json.loads(json.dumps(spec.to_dict() if hasattr(spec, "to_dict") else spec))
    reason = _why_not(cell, cfgs, tokenizers, g)
    if reason:
      skipped.append({"label": cell["label"], "method": cell["method"], "reason": reason})
      continue
    if cell["method"] == "llada" and cfgs[cell["model"]].shift_logits:
      cell["method"] = "dream"  # a Dream checkpoint: Dream's decoder, same options
    run.append(cell)
  return run, skipped


def _missing(name: str) -> str:
  if name == "d2f":
    return "no D2F model (set checkpoints.d2f_adapter beside checkpoints.diffusion)"
  return f"no {name} checkpoint (checkpoints.{name})"


def _why_not(cell: dict, cfgs: dict, tokenizers: dict, g: int) -> str | None:
  """Why the checkpoints do not allow `cell`, or None when they do."""
  model, drafter = cell["model"], cell.get("drafter")
  for name in (model, drafter):
    if name and name not in cfgs:
      return _missing(name)
  method = cell["method"]
  if method in DIFFUSION_METHODS and cfgs[model].mask_token_id is None:
    return f"the {model} checkpoint has no mask token, so it cannot decode by unmasking"
  if drafter:
    wants_ar = cell["options"].get("drafter", "d2f") == "ar"
    is_ar = cfgs[drafter].mask_token_id is None
    if wants_ar != is_ar:
      return (f"the {drafter} checkpoint is {'an AR' if is_ar else 'a diffusion'} model; this "
              f"cell drafts with {'an AR' if wants_ar else 'a diffusion'} drafter")
    if not same_tokenizer(tokenizers[drafter], tokenizers[model]):
      return (f"the {drafter} model's tokenizer is not the {model} model's (a drafter proposes "
              "the target's token ids)")
    if cfgs[drafter].vocab_size != cfgs[model].vocab_size:
      return (f"the {drafter} model's vocabulary has {cfgs[drafter].vocab_size} rows, the "
              f"{model} model's {cfgs[model].vocab_size} (a drafter proposes the target's ids)")
  block = cell["options"].get("block_length")
  if block and g % int(block):
    return f"G={g} is not a multiple of its block {block} (set --config.gen_length)"
  return None


class PromptLayout:
  """What runner.run_cells needs of a layout, for one checkpoint's tokenizer: prompts encoded
  as `Sampler.encode` encodes them (the tokenizer's specials included), left padded."""

  def __init__(self, tokenizer, cfg):
    self.text = _TextTokenizer(tokenizer)
    self.tokenizer = self.text
    self._tok, self._pad = tokenizer, base.output_pad_id(cfg)

  def encode(self, prompts) -> list[list[int]]:
    return [encode_text(self._tok, p) for p in prompts]

  def encode_prompts(self, prompts, length: int) -> dict:
    tokens, valid = base.pad_prompts(self.encode(prompts), self._pad, length=length)
    return {"tokens": tokens, "valid": valid}


class _TextTokenizer:
  """A response's ids -> text as `Sampler` detokenizes it (special tokens skipped)."""

  def __init__(self, tokenizer):
    self._tok, self.vocab_size = tokenizer, tokenizer.vocab_size

  def decode(self, ids) -> str:
    return decode_text(self._tok, ids)


class Scorer:
  """What runner.run_cells needs of a suite: one response -> correct under `filter_name`
  (the text cut at the task's stop strings first, as `Sampler` cuts it)."""

  def __init__(self, filter_name: str):
    self.filter = filter_name

  def score(self, text: str, example: Example) -> bool:
    return gsm8k.score(text, example.answer)[self.filter]


def examples(c) -> tuple[list[Example], list[gsm8k.Problem]]:
  """The evaluated questions as study Examples (prompt = the n-shot prompt, task "gsm8k"),
  and the problems they come from."""
  ev = c.eval_set
  problems = gsm8k.read(ev.source, split=ev.split, limit=ev.limit)
  if ev.fewshot_source:
    prompts = gsm8k.fewshot_prompts(problems, gsm8k.read(ev.fewshot_source, split="train"),
                                    n_shot=int(ev.n_shot))
  else:  # the evaluated split is the pool (all of it, not only the first `limit`)
    pool = problems if ev.limit is None else gsm8k.read(ev.source, split=ev.split)
    prompts = gsm8k.fewshot_prompts(problems, pool, n_shot=int(ev.n_shot), exclude_self=True)
  return ([Example(prompt=t, answer=p.answer, target=p.target, task=TASK)
           for t, p in zip(prompts, problems)], problems)


def _bind(cell: dict, models: dict, g: int, batch_size: int, mesh) -> runner.Cell:
  options = study_lib.resolve_options(dict(cell["options"]), g)
  setting = {"model": cell["model"], **options}
  target = models[cell["model"]]
  if cell.get("drafter"):
    second = models[cell["drafter"]]
    setting["drafter_model"] = cell["drafter"]
    options = {**options, "drafter_params": second.params, "drafter_cfg": second.cfg}
  decode = study_lib._decoder(cell["method"], target.cfg, options, mesh=mesh)  # pylint: disable=protected-access
  return runner.Cell(decode, target.params, cell["method"], cell["label"], setting, batch_size)


def _prompt_len(layout: PromptLayout, exs, cfg, g: int, group: str) -> int:
  longest = max(len(r) for r in layout.encode([ex.prompt for ex in exs]))
  if longest + g > cfg.max_seq_len:
    raise CheckpointStudyError(
        f"the longest {len(exs)}-question prompt is {longest} tokens for the {group} model, and "
        f"with G={g} that passes its window of {cfg.max_seq_len}; lower eval_set.n_shot or "
        "gen_length.")
  return longest


def decode_cells(c, models: dict, cells: list[dict], exs: list[Example], *, mesh=None,
                 log=print):
  """(results in config order per batch size, responses, prompt lengths): every cell at every
  batch size, the cells of one tokenizer timed together (runner.run_cells)."""
  g = int(c.gen_length)
  scorer = Scorer(c.eval_set.score)
  groups = collections.defaultdict(list)
  for cell in cells:
    groups[TOKENIZER_OF[cell["model"]]].append(cell)
  layouts = {name: PromptLayout(models[name].tokenizer, models[name].cfg) for name in groups}
  lengths = {name: _prompt_len(layouts[name], exs, models[name].cfg, g, name)
             for name in groups}
  order = {cell["label"]: i for i, cell in enumerate(cells)}
  results, responses = [], []
  for b in [int(x) for x in c.eval.batch_sizes]:
    at_b = []
    for name, group in groups.items():
      bound = [_bind(cell, models, g, b, mesh) for cell in group]

      def record(j, start, texts, counts, bound=bound, b=b):
        for r, (text, n) in enumerate(zip(texts, counts)):
          scores = gsm8k.score(text, exs[start + r].answer)
          responses.append({"label": bound[j].label, "batch_size": b, "index": start + r,
                            "response": gsm8k.cut(text), "response_tokens": int(n), **scores})

      log(f"[study] batch {b}: {len(bound)} {name}-tokenizer cells over {len(exs)} questions "
          f"(prompts up to {lengths[name]} tokens, G={g})")
      at_b += runner.run_cells(bound, layout=layouts[name], suite=scorer, examples=exs,
                               prompt_len=lengths[name], seed=int(c.eval.seed),
                               repeats=int(c.eval.timing_repeats), on_decoded=record)
    results += sorted(at_b, key=lambda r: order[r.label])
  return results, responses, lengths


def gsm8k_scores(results, responses) -> list[dict]:
  """Per cell: questions, strict and flexible matches (from the kept responses)."""
  out = []
  for r in results:
    rows = [x for x in responses if x["label"] == r.label and x["batch_size"] == r.batch_size]
    out.append({"label": r.label, "batch_size": r.batch_size, "questions": len(rows),
                "strict": sum(x["strict"] for x in rows),
                "flexible": sum(x["flexible"] for x in rows)})
  return out


def scores_text(scores: list[dict], filter_name: str) -> str:
  lines = [f"GSM8K exact match per cell (lm-eval's filters; the table's accuracy is "
           f"{filter_name}):", "", "| setting | batch | strict | flexible |", "|---|---|---|---|"]
  for s in scores:
    n = max(s["questions"], 1)
    lines.append(f"| {s['label']} | {s['batch_size']} | {s['strict']}/{s['questions']} "
                 f"({100 * s['strict'] / n:.1f}%) | {s['flexible']}/{s['questions']} "
                 f"({100 * s['flexible'] / n:.1f}%) |")
  return "\n".join(lines)


def skipped_text(skipped: list[dict]) -> str:
  if not skipped:
    return "Every decoder of the grid ran."
  return "Cells these checkpoints do not allow (not run):\n" + "\n".join(
      f"  {s['label']}: {s['reason']}" for s in skipped)


def _model_record(m: Model) -> dict:
  leaves = jax.tree_util.tree_leaves(m.params)
  return {"path": m.path, "kind": m.kind, "name": m.cfg.name,
          "params": int(sum(np.prod(x.shape) for x in leaves)),
          "param_bytes": int(sum(x.size * x.dtype.itemsize for x in leaves)),
          "dtype": str(leaves[0].dtype), "vocab_size": int(m.cfg.vocab_size)}


def run(c, workdir, *, log=print) -> dict:
  """Loads the checkpoints, decodes every allowed cell, writes study.md / study.json /
  study_pareto.png / responses.jsonl to `workdir`; returns the JSON document."""
  check_config(c)
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  clock = hostclock.HostClock.start()
  exs, _ = examples(c)
  shape = _mesh_shape(c.mesh)
  mesh = None
  if shape is not None:
    from dllm_jax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
    mesh = mesh_lib.make_mesh(shape)
  started = time.perf_counter()
  models = load_models(c, mesh, log=log)
  load_s = time.perf_counter() - started
  cells, skipped = plan_cells(c, {k: m.cfg for k, m in models.items()},
                              {k: m.tokenizer for k, m in models.items()})
  log(skipped_text(skipped))
  results, responses, prompt_lens = decode_cells(c, models, cells, exs, mesh=mesh, log=log)

  machine = accounting.machine_info()
  v = study_lib.judge(c, results, machine["platform"])
  bound = study_lib.ar_roofline(results, models, bandwidth=roofline.memory_bandwidth(
      float(c.eval.memory_bandwidth_gbps)))
  scores = gsm8k_scores(results, responses)
  ev = c.eval_set
  doc = accounting.results_json(
      results, machine=machine, config=json.loads(c.to_json()),
      extra={"verdict": v, "roofline": bound, "gen_length": int(c.gen_length),
             "prompt_len": prompt_lens, "num_prompts": len(exs), "train_or_load_s": load_s,
             "training": {}, "skipped": skipped,
             "models": {k: _model_record(m) for k, m in models.items()},
             "gsm8k": {"source": ev.source, "fewshot_source": ev.fewshot_source,
                       "n_shot": int(ev.n_shot), "until": list(gsm8k.UNTIL),
                       "score": ev.score, "cells": scores},
             **study_lib._clock_figures(clock)})  # pylint: disable=protected-access
  accounting.validate_json(doc)
  verdict_lib.check_recomputes(doc)
  text = "\n\n".join([report.markdown_table(results, baseline="ar"),
                      scores_text(scores, ev.score), skipped_text(skipped),
                      verdict_lib.verdict_text(v), study_lib.roofline_text(bound),
                      report.time_text(doc)]) + "\n"
  (workdir / "study.md").write_text(text)
  (workdir / "study.json").write_text(json.dumps(doc, indent=1))
  (workdir / RESPONSES).write_text("".join(json.dumps(r) + "\n" for r in responses))
  if results:
    report.pareto_plot(results, str(workdir / "study_pareto.png"),
                       title=f"GSM8K {ev.n_shot}-shot, {len(exs)} questions, G={c.gen_length}",
                       baseline="ar", llada_label=c.eval.llada_vanilla_label)
  log(text)
  log(f"[study] wrote {workdir / 'study.md'}, study.json, study_pareto.png, {RESPONSES} "
      f"({hostclock.summary_text(doc['host'])}; devices: {jax.devices()[0].device_kind})")
  return doc


def dry_run(c, *, log=print) -> list:
  """`--dry-run`: the per-device bytes of every cell the checkpoints allow, at the largest
  batch and the longest prompt, from config.json and tokenizer.json alone (no weights read),
  by `dllm_jax.dry_run.plan` against `device_memory` (default: the device's own); raises its
  DoesNotFit (one line naming the change) for the first cell that does not fit. Each cell is
  planned on its own: the run holds every configured model at once, so add the other
  models' parameter bytes (in each table) to judge the whole run."""
  from dllm_jax import dry_run as dry_run_lib  # pylint: disable=import-outside-toplevel
  check_config(c)
  from dllm_jax.checkpoints import load_tokenizer  # pylint: disable=import-outside-toplevel
  paths = {"ar": c.checkpoints.ar, "diffusion": c.checkpoints.diffusion,
           "d2f": c.checkpoints.diffusion if c.checkpoints.d2f_adapter else None,
           "drafter": c.checkpoints.drafter}
  paths = {k: p for k, p in paths.items() if p}
  dtype = c.checkpoints.dtype
  cfgs = {k: dry_run_lib.checkpoint_config(p, dtype=dtype, merge_lora=True)
          for k, p in paths.items()}
  tokenizers = {k: load_tokenizer(p) for k, p in paths.items()}
  cells, skipped = plan_cells(c, cfgs, tokenizers)
  log(skipped_text(skipped))
  exs, _ = examples(c)
  g, batch = int(c.gen_length), max(int(b) for b in c.eval.batch_sizes)
  prompt_lens = {name: max(len(encode_text(tokenizers[name], ex.prompt)) for ex in exs)
                 for name in {TOKENIZER_OF[cell["model"]] for cell in cells}}
  budget = c.device_memory or dry_run_lib.device_memory()
  plans = []
  for cell in cells:
    options = study_lib.resolve_options(dict(cell["options"]), g)
    drafter = cfgs[cell["drafter"]] if cell.get("drafter") else None
    report_ = dry_run_lib.plan(cfgs[cell["model"]], method=cell["method"],
                               mesh=_mesh_shape(c.mesh), batch=batch,
                               prompt_len=prompt_lens[TOKENIZER_OF[cell["model"]]],
                               drafter_cfg=drafter, device_memory=budget,
                               **options)
    log(f"{cell['label']}:\n{report_.table()}")
    plans.append(report_.check())
  return plans
