"""The speed-versus-quality study: AR, vanilla LLaDA, Fast-dLLM, D2F and block diffusion on the
same held-out prompts, with accuracy, tokens/s, latency and NFE measured in one run.

    result = run(get_config(), "runs/study")   # trains or loads, decodes, writes the report

Outputs in `workdir`: `study.md` (table), `study.json` (every figure + machine + config, each
cell's per-prompt results, and `intervals`: paired bootstrap 95% intervals over prompts of
every cell's accuracy difference and tokens/s ratio against AR, intervals.py),
`study_pareto.png` (accuracy against tokens/s, with each cell's interval bars); the run's wall time sits beside its process
CPU time and the host's steal (`study.json["host"]`, hostclock.py), since on a shared VM the
wall time also measures the neighbours. The verdict on every published claim (D2F
against AR and vanilla LLaDA, Fast-dLLM, the lossless hybrid, adaptive switching) is computed
from the measured cells by verdict.py, printed and stored; every judged cell is listed with its
speedup split into fewer forwards and cost per forward. AR at batch 1 is also placed against
the weight-streaming bound (roofline.py). The report ends with where the wall time went
(data and training against decoding), each model's training record (`study.json["training"]`)
and the CPU it ran on (`machine`: model, family/model, widest vector instruction set).

An interrupted study resumes: finished models are loaded, a model cut short resumes from its
newest checkpoint, and the decoding replays its finished rounds from `<workdir>/decode_journal/`
(journal.py), kept until the report is written; `study.json["decode_restored_rounds"]` says
how many rounds an earlier run timed, and the report's last lines say so too.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import jax
from tqdm.auto import tqdm

from dllm_jax.data.sources import record_to_example
from dllm_jax.decoding import api as decode_api
from dllm_jax.training import data as data_lib
from studylib import accounting, models as models_lib, report, roofline, runner
from studylib import calibration as calibration_lib
from studylib import hostclock
from studylib import intervals as intervals_lib
from studylib import router as router_lib
from studylib import journal as journal_lib
# Re-exported: the command line's mode flags (JAX-free, so the script parses them first).
from studylib.modes import MODE_FLAGS, default_workdir, expand_mode_flags  # noqa: F401
from studylib import tradeoff as tradeoff_lib
from studylib import verdict as verdict_lib


def _decoder(method: str, cfg, options: dict, mesh=None):
  """(params, tokens, valid, rng, tasks=None) -> DecodeOutput, with the options checked up
  front; `tasks` (one task name per row) is passed on as the decoder's per-row `tasks`;
  `mesh`: decode on it (the checkpoint mode's `mesh`)."""
  decode_api.check_options(method, options)

  def decode(params, tokens, valid, rng, tasks=None):
    extra = {} if tasks is None else {"tasks": list(tasks)}
    return decode_api.generate(params, cfg, (tokens, valid), method=method, rng=rng,
                               mesh=mesh, **options, **extra)
  return decode


# Methods whose decoder also takes a second model, and the option names it is passed under.
SECOND_MODEL = {"speculative": ("drafter_params", "drafter_cfg"),
                "adaptive": ("drafter_params", "drafter_cfg")}
# Methods that take one task tag per row (`tasks`): a cell with `task_tags: True` gets each
# prompt's task name as its tag.
TASK_TAGGED = ("adaptive",)
# Under the workdir: the decode's finished rounds, one journal per batch size (journal.py),
# kept until the report is written so that an interrupted study resumes its decoding.
JOURNAL_DIR = "decode_journal"


def bind_cell(cell: dict, trained: dict, gen_length: int):
  """(decode, params, setting) of one configured cell: its options resolved for this G, and
  for a two-model method (speculative, adaptive: `cell["drafter"]` names the drafter model)
  the second model's params and config bound into the decoder. `setting` is what the JSON
  records. A cell with `task_tags: True` (adaptive) records it in `setting`; the runner then
  passes each batch's task names to `decode` as `tasks=`."""
  method = cell["method"]
  if cell.get("task_tags") and method not in TASK_TAGGED:
    raise ValueError(f"cell {cell['label']!r}: task_tags applies to {list(TASK_TAGGED)} "
                     f"only, not {method!r}.")
  if cell.get("calibrate") and "task_modes" not in cell.get("options", {}):
    raise ValueError(f"cell {cell['label']!r}: its task_modes are fitted by the study's "
                     "calibration step (calibration.calibrate_cells) before it is bound.")
  model = trained[cell["model"]]
  options = resolve_options(dict(cell.get("options", {})), gen_length)
  setting = {"model": cell["model"], **options}
  if method in SECOND_MODEL:
    if not cell.get("drafter") or cell["drafter"] not in trained:
      raise ValueError(f"cell {cell['label']!r}: method {method!r} needs 'drafter' naming one "
                       f"of the study's models {sorted(trained)}, got {cell.get('drafter')!r}.")
    second = trained[cell["drafter"]]
    params_key, cfg_key = SECOND_MODEL[method]
    setting["drafter_model"] = cell["drafter"]
    options = {**options, params_key: second.params, cfg_key: second.model_cfg}
  elif "drafter" in cell:
    raise ValueError(f"cell {cell['label']!r}: 'drafter' applies to {sorted(SECOND_MODEL)} "
                     f"only, not {method!r}.")
  if cell.get("task_tags"):
    setting["task_tags"] = True
  if cell.get("router"):
    if method not in TASK_TAGGED or cell.get("task_tags"):
      raise ValueError(f"cell {cell['label']!r}: a router tags the rows of an "
                       f"{list(TASK_TAGGED)} cell in place of task tags, not beside them.")
    setting["router"] = cell["router"]
  if cell.get("calibrate"):
    setting["calibrated"] = True
  for key in ("curve", "knob"):  # the trade-off mode's curve and swept option
    if key in cell:
      setting[key] = cell[key]
  return _decoder(method, model.model_cfg, options), model.params, setting


def resolve_options(options: dict, gen_length: int) -> dict:
  """Fills gen_length and turns the sizes a cell gives as a share of G into counts for this
  G: `block_fraction` into block_length (1: one block over the canvas, vanilla LLaDA's; 0.5:
  Fast-dLLM's two), `steps_fraction` (LLaDA) into steps. A cell written so holds for any G
  (`--config.data.gen_length`)."""
  options = {"gen_length": gen_length, **options}
  block_fraction = options.pop("block_fraction", None)
  if block_fraction is not None:
    if "block_length" in options:
      raise ValueError("give a cell block_length or block_fraction, not both.")
    block = options["gen_length"] * block_fraction
    if not 0 < block_fraction <= 1 or block != int(block) or options["gen_length"] % block:
      raise ValueError(f"block_fraction={block_fraction} must be in (0, 1] and give a block "
                       f"length that divides G={options['gen_length']}.")
    options["block_length"] = int(block)
  fraction = options.pop("steps_fraction", None)
  if fraction is not None:
    if not 0 < fraction <= 1:
      raise ValueError(f"steps_fraction must be in (0, 1], got {fraction}.")
    options["steps"] = max(1, int(round(options["gen_length"] * fraction)))
  return options


def held_out(study_config, workdir):
  """(tokenizer, suite, layout, examples) shared by every model of the study: the first
  eval.num_prompts records of the eval split (the TFDS files under <workdir>/data when
  data.source='tfds')."""
  data_cfg = models_lib.study_data(study_config, workdir)
  tok = data_lib.make_tokenizer(data_cfg)
  suite = data_lib.make_suite(data_cfg)
  layout = data_lib.make_layout(data_cfg, tok)
  _, eval_source = data_lib.make_sources(data_cfg)
  n = min(int(study_config.eval.num_prompts), len(eval_source))
  examples = [record_to_example(eval_source[i]) for i in range(n)]
  return tok, suite, layout, examples


def ar_roofline(results, trained, *, bandwidth: dict, ar_label: str = "ar") -> dict | None:
  """AR at batch 1 against the weight-streaming bound (param bytes / memory bandwidth)."""
  ar = next((r for r in results if r.label == ar_label and r.batch_size == 1), None)
  model = trained.get(ar.setting.get("model")) if ar is not None and ar.nfe else None
  if model is None:
    return None
  out = roofline.ar_bound(roofline.param_bytes(model.params), bandwidth["gbps"],
                          step_s=ar.wall_s / ar.nfe)
  return {**out, "bandwidth_source": bandwidth["source"],
          "measured_tokens_per_s": ar.tokens_per_s}


def roofline_text(r: dict | None) -> str:
  if r is None:
    return "No AR cell at batch 1: no weight-streaming bound computed."
  return (f"AR at batch 1 against the weight-streaming bound: {r['param_bytes'] / 1e6:.2f} MB "
          f"of weights at {r['bandwidth_gbps']:.0f} GB/s ({r['bandwidth_source']}) take "
          f"{1e6 * r['weight_read_s']:.1f} us to read, a bound of "
          f"{r['bound_tokens_per_s']:.0f} forwards/s; AR measured "
          f"{1e6 * r['measured_step_s']:.1f} us per forward ({100 * r['fraction_of_bound']:.1f}% "
          f"of the bound) and {r['measured_tokens_per_s']:.0f} response tokens/s.")


class StudyConfigError(ValueError):
  """A study config that cannot run, named before any model is trained."""


def check_config(study_config) -> None:
  """Raises StudyConfigError for what would otherwise fail only after training: a calibration
  split (eval-split records after the evaluation prompts) that the eval split cannot hold."""
  if calibration_lib.needs_calibration(study_config.methods):
    n = int(study_config.eval.num_prompts)
    k = int(study_config.eval.calibration_prompts)
    size = int(study_config.data.eval_size)
    if k < 1 or n + k > size:
      raise StudyConfigError(
          f"eval.num_prompts={n} evaluation prompts plus eval.calibration_prompts={k} "
          f"calibration prompts need that many eval-split records, and data.eval_size={size}; "
          "raise data.eval_size or lower the two (calibration_prompts >= 1).")


def runner_cell(cell: dict, trained: dict, gen_length: int, batch_size: int) -> runner.Cell:
  decode, params, setting = bind_cell(cell, trained, gen_length)
  tag_of = router_lib.Router(dict(cell["route"])).tag if cell.get("route") else None
  return runner.Cell(decode, params, cell["method"], cell["label"], setting, batch_size,
                     task_tags=bool(cell.get("task_tags")), tag_of=tag_of)


class Decoded(NamedTuple):
  """What decode_all measured, and what it measured it with."""
  trained: dict            # name -> the trained model (params and config)
  results: list            # accounting.MethodResult per (cell, batch size)
  examples: list           # the held-out prompts, in decoding order
  layout: object           # data_lib.SFTLayout
  train_s: float           # seconds to train or load the models
  calibration: dict        # the calibrated cells' records (calibration.py); {} if none
  restored_rounds: dict    # batch size -> rounds replayed from an interrupted run's journal


def decode_all(study_config, workdir, *, log=print) -> Decoded:
  """Trains or loads the models, fits the calibrated cells on the calibration split
  (calibration.py) and decodes every cell at every batch size, resuming an interrupted
  decode from its journal (journal_path)."""
  check_config(study_config)
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  started = time.perf_counter()
  trained = models_lib.ensure_models(study_config, workdir, log=log)
  train_s = time.perf_counter() - started
  tok, suite, layout, examples = held_out(study_config, workdir)
  trained = {k: models_lib.with_active_vocab(m, tok.vocab_size) for k, m in trained.items()}
  gen_length = layout.seq_len - layout.prompt_len
  cells = [dict(c) for c in study_config.methods]
  batch_sizes = [int(b) for b in study_config.eval.batch_sizes]
  results = []
  bar = tqdm(total=len(cells) * sum(-(-len(examples) // b) for b in batch_sizes),
             desc="decoding", unit="batch")
  repeats = int(study_config.eval.get("timing_repeats", 1))
  calibration = {}
  if calibration_lib.needs_calibration(cells):
    held = calibration_lib.calibration_examples(
        models_lib.study_data(study_config, workdir), len(examples),
        int(study_config.eval.calibration_prompts))
    cells, calibration = calibration_lib.calibrate_cells(
        cells, lambda c: runner_cell(c, trained, gen_length, batch_sizes[0]), examples=held,
        eval_examples=examples, layout=layout, suite=suite, batch_size=batch_sizes[0],
        tolerance=float(study_config.eval.calibration_tolerance),
        seed=int(study_config.eval.seed), repeats=repeats)
    log(calibration_lib.calibration_text(calibration))
  seed = int(study_config.eval.seed)
  restored = {}
  for b in batch_sizes:
    bound = [runner_cell(cell, trained, gen_length, b) for cell in cells]
    bar.set_postfix_str(f"batch {b}: {len(bound)} cells, interleaved")
    fingerprint = runner.fingerprint(
        bound, examples, layout.prompt_len, seed, repeats,
        models={name: (m.params, m.model_cfg) for name, m in trained.items()})
    with journal_lib.Journal(journal_path(workdir, b), fingerprint, len(bound)) as journal:
      restored[b] = len(journal.restored)
      if journal.restored:
        log(f"[study] batch {b}: {len(journal.restored)} of {-(-len(examples) // b)} rounds "
            f"restored from {journal.path} (timed by the interrupted run); decoding the rest")
      results += runner.run_cells(bound, layout=layout, suite=suite, examples=examples,
                                  prompt_len=layout.prompt_len, seed=seed, repeats=repeats,
                                  on_batch=lambda: bar.update(1), journal=journal)
  bar.close()
  return Decoded(trained, results, examples, layout, train_s, calibration, restored)


def journal_path(workdir, batch_size: int) -> Path:
  """Where decode_all records the batch-`batch_size` rounds until the report is written."""
  return Path(workdir) / JOURNAL_DIR / f"batch{batch_size}.jsonl"


def _restored_json(decoded: Decoded) -> dict:
  """{"<batch size>": rounds replayed from a journal}: 0 everywhere for a decode in one go."""
  return {str(b): n for b, n in decoded.restored_rounds.items()}


def _drop_journals(workdir) -> None:
  """The report is written: a rerun times every cell afresh instead of replaying them."""
  shutil.rmtree(Path(workdir) / JOURNAL_DIR, ignore_errors=True)


def _clock_figures(clock: hostclock.HostClock) -> dict:
  """{"total_s": wall seconds, "host": wall, process CPU and host steal} since `clock`."""
  host = clock.summary()
  return {"total_s": host["wall_s"], "host": host}


def judge(study_config, results, platform: str) -> dict:
  """The verdict on every claim, from the measured cells (verdict.py)."""
  return verdict_lib.judge(results, task=study_config.eval.headline_task,
                           llada_label=study_config.eval.llada_vanilla_label,
                           platform=platform,
                           accelerated_ar_label=study_config.eval.get("accelerated_ar_label"))


def run(study_config, workdir, *, log=print) -> dict:
  """Trains or loads the models, decodes every cell, writes table/JSON/plot; returns the JSON.
  The trade-off mode writes its own report (`run_tradeoff`)."""
  if study_config.get("mode", "") == "tradeoff":
    return run_tradeoff(study_config, workdir, log=log)
  if study_config.get("mode", "") == "checkpoints":  # published checkpoints on GSM8K
    from studylib import checkpoint_study  # pylint: disable=import-outside-toplevel
    return checkpoint_study.run(study_config, workdir, log=log)
  workdir = Path(workdir)
  clock = hostclock.HostClock.start()
  decoded = decode_all(study_config, workdir, log=log)
  trained, results, examples, layout, calibration = (
      decoded.trained, decoded.results, decoded.examples, decoded.layout, decoded.calibration)
  gen_length = layout.seq_len - layout.prompt_len

  machine = accounting.machine_info()
  training = {name: models_lib.train_record(workdir, name) for name in trained}
  v = judge(study_config, results, machine["platform"])
  bandwidth = roofline.memory_bandwidth(
      float(study_config.eval.get("memory_bandwidth_gbps", 0.0)))
  bound = ar_roofline(results, trained, bandwidth=bandwidth)
  doc = accounting.results_json(
      results, machine=machine, config=json.loads(study_config.to_json()),
      extra={"verdict": v, "intervals": intervals_lib.table(results, "ar"), "roofline": bound,
             "gen_length": gen_length, "prompt_len": layout.prompt_len,
             "num_prompts": len(examples), "train_or_load_s": decoded.train_s,
             "training": training, "calibration": calibration,
             "decode_restored_rounds": _restored_json(decoded), **_clock_figures(clock)})
  accounting.validate_json(doc)
  verdict_lib.check_recomputes(doc)
  table = report.markdown_table(results, baseline="ar")
  by_task = report.per_task_table(results, baseline="ar")
  if by_task:
    table += "\n\n" + by_task
  text = f"{table}\n\n{verdict_lib.verdict_text(v)}\n\n{roofline_text(bound)}\n"
  if calibration:
    text += "\n" + calibration_lib.calibration_text(calibration) + "\n"
  text += "\n" + report.time_text(doc) + "\n"
  (workdir / "study.md").write_text(text)
  (workdir / "study.json").write_text(json.dumps(doc, indent=1))
  report.pareto_plot(results, str(workdir / "study_pareto.png"),
                     title=f"{len(examples)} held-out prompts, G={gen_length}",
                     baseline="ar", llada_label=study_config.eval.llada_vanilla_label)
  _drop_journals(workdir)
  log(text)
  log(f"[study] wrote {workdir / 'study.md'}, study.json, study_pareto.png "
      f"({hostclock.summary_text(doc['host'])}; devices: {jax.devices()[0].device_kind})")
  return doc


def run_tradeoff(study_config, workdir, *, log=print) -> dict:
  """The trade-off mode: decodes its grid, then writes tradeoff.md, tradeoff.json (every
  cell, the training records, the curves' summary and the verdict, both recomputable from
  the cells) and tradeoff.png (the curves); returns the JSON."""
  workdir = Path(workdir)
  clock = hostclock.HostClock.start()
  decoded = decode_all(study_config, workdir, log=log)
  results, examples, layout = decoded.results, decoded.examples, decoded.layout
  machine = accounting.machine_info()
  config = json.loads(study_config.to_json())
  training = {name: models_lib.train_record(workdir, name) for name in study_config.models}
  summary = tradeoff_lib.summarize(results, config=config, training=training)
  v = judge(study_config, results, machine["platform"])
  doc = accounting.results_json(
      results, machine=machine, config=config,
      extra={"training": training, "tradeoff": summary, "verdict": v,
             "intervals": intervals_lib.table(results, "ar"),
             "gen_length": layout.seq_len - layout.prompt_len,
             "prompt_len": layout.prompt_len, "num_prompts": len(examples),
             "train_or_load_s": decoded.train_s,
             "decode_restored_rounds": _restored_json(decoded), **_clock_figures(clock)})
  accounting.validate_json(doc)
  verdict_lib.check_recomputes(doc)
  tradeoff_lib.check_recomputes(doc)
  text = (f"{tradeoff_lib.summary_text(summary)}\n\n{verdict_lib.verdict_text(v)}\n\n"
          f"{report.time_text(doc)}\n")
  (workdir / "tradeoff.md").write_text(text)
  (workdir / "tradeoff.json").write_text(json.dumps(doc, indent=1))
  tradeoff_lib.plot(summary, str(workdir / "tradeoff.png"),
                    title=f"{len(examples)} held-out prompts, G={doc['gen_length']}, batch "
                          f"{summary['batch_size']}")
  _drop_journals(workdir)
  log(text)
  log(f"[study] wrote {workdir / 'tradeoff.md'}, tradeoff.json, tradeoff.png "
      f"({hostclock.summary_text(doc['host'])}; devices: {jax.devices()[0].device_kind})")
  return doc
