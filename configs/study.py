"""The speed-versus-quality study (the README's main job).

  python experiments/study.py           # default: mixed suite, long worked answers (runs/study)
  python experiments/study.py --short   # short answers only                (runs/study_short)
  python experiments/study.py --long    # answers of 159-163 tokens, ~1 h      (runs/study_long)
  python experiments/study.py --full    # larger, for an accelerator          (runs/study_full)
  python experiments/study.py --tradeoff  # trade-off curves, from the default mode's models

  python experiments/study.py --checkpoints --config.checkpoints.ar=... (runs/study_checkpoints)
                                        # published checkpoints on GSM8K: see the end of file

`--short` / `--long` / `--full` / `--tradeoff` / `--checkpoints` stand for
`--config configs/study.py:short` (`:long`, `:full`, `:tradeoff`, `:checkpoints`). The
checkpoint mode trains nothing: it loads the checkpoints its config names and decodes a
GSM8K-format set (experiments/studylib/checkpoint_study.py, docs/checkpoint_study.md).

Three models of the same size on the same synthetic data: an AR model, a masked-diffusion
model (MDM; `mdm_from_ar=True` starts it from the trained AR model's weights), and a D2F
student distilled from the MDM (LoRA, block-causal). The data goes through the package's TFDS
path: array_record files written once under `<workdir>/data` and read with
`tfds.data_source` (`data.source='synthetic'` generates the same records in memory). Every
decoder then runs on the same held-out prompts (at batch 1, and in every mode but the default
at a larger batch too). Model training configs come from configs/{ar,mdm,d2f}_tiny.py; this
file only sets what the study must hold fixed (data, canvas, steps) and the decoding grid.
Every setting listed here is reported; none is dropped.

Modes:
  ""     the mixed suite (MIXED), sized to run in 15 minutes on a fast 2-core host from a
         fresh clone: three-digit addition worked column by column (`long_addition:2`,
         31-character answers, the largest share of the data: the headline task), sorting
         five digits (copying-like), two-digit addition with its sum written units digit
         first (`arithmetic_reversed:1`, `37+48=58`: short answers a causal model can
         learn in the budget) and running sums (`running_sum:1`: each digit depends on the
         previous one, so parallel commits fail); the AR baseline trains 2100 steps so that
         it knows every task (>= 95% each is the bar; see STEPS). G = 32, 160 held-out prompts,
         batch 1. The MDM starts from the trained AR model with Dream's shifted logits
         (AR-to-diffusion adaptation: measured on long addition, 1500 steps reach the
         masked-token accuracy the from-scratch MDM needs ~3400 for, BENCHMARKS.md section
         1); the D2F student (block 16) starts from it. Two narrow drafters (d 48, 2
         layers) train after them: `ar_draft` (AR: the accelerated AR baseline,
         speculative AR) and `bd_draft`, a block-diffusion drafter adapted from it (1500
         steps; DFlash's lightweight drafter for an AR target); and the self-speculative
         model `selfspec` (TiDAR: the AR model trained on with selfspec_loss, 600 steps),
         decoded beside its own AR decode.
         A compact grid (DEFAULT_CELLS); the adaptive cells' prompt router (no task tags)
         and the task-tagged oracle's map are fitted on a calibration split (below).
  short  two-digit addition, `37+48=85` (answers of ~2.5 tokens, G = 16): the regime where
         AR needs ~3.5 forwards and parallel decoding has little to save (the former
         default mode). The MDM starts from the trained AR model with Dream's shifted
         logits: its masked-token eval accuracy is 97.9% after 500 steps and 98.7% after
         1000, where the from-scratch MDM reached 95.1% after 3000 (BENCHMARKS.md section
         1b). The accelerated AR baseline's narrow drafter `ar_draft` trains here too.
  long   long generations: a lettered sheet of four three-digit additions, each restated
         and worked column by column on its own line (`addition_sheet:3`: answers of
         159-163 tokens, G = 192, >= 128 as the published 50x regime needs), 128 held-out
         prompts at batch 1. It measures D2F (the student distilled at the reference's
         training block, 16, decoded at 16 and at the reference's decode block, 32),
         Fast-dLLM and both hybrids against vanilla LLaDA (steps = G, low-confidence
         remasking) and AR at the same G (LONG_CELLS). Every step is ~5x the default's, so
         the models train at batch 32 (four problems a row), the MDM from the AR model;
         about an hour on 2 idle CPU cores (training ~47 minutes). G is a config field:
         `--config.data.gen_length=384` sets a G well above the answers (LLaDA's regime,
         where vanilla LLaDA still decodes the EOS padding one slot a step); every model's
         window and the G-relative cells follow it (train it in its own --workdir: every
         model trains on the wider canvas, each step ~3x the cost at G = 192).
  full   for an accelerator: a wider, deeper model (d 512, 8 layers, 34M parameters), 10x
         the steps, on long addition worked column by column at 3, 4 and 6 digits (answers
         of up to 61 characters, G = 64); the D2F student is distilled at block 16.
  tradeoff  the survey's three trade-offs as curves, on the default mode's data (worked
         additions long enough for the step count to matter: G = 32) and its trained AR, MDM,
         D2F and narrow AR drafter (same workdir, runs/study: they are loaded, not
         retrained), plus three models of its own (TRADEOFF below):
           * steps x unmasking schedule: LLaDA (one block over G) and block diffusion (the
             D2F student at its training block k) at k, k/2, k/4, k/8, k/16 steps per block
             (those >= 1) under the even (LLaDA) and cosine (MaskGIT) schedules, and under the
             entropy bound (confidence-adaptive) at a sweep of bounds; Fast-dLLM and D2F at a
             threshold sweep (their threshold is their confidence-adaptive commit rule);
           * training noise schedule: MDMs trained with linear, cosine and polynomial alpha(t)
             on the same data, steps and seed, each decoded at every step count;
           * AR's own acceleration: speculative AR with a narrow AR drafter (`ar_draft`,
             trained with the AR model's recipe), greedy-exact to AR; every "x AR" of the
             verdict is also given against it.
         One batch size (1, the verdict's), every cell timed like the other modes'.

Every D2F setting runs with no bound on the blocks in flight (the reference) and, where the
response has more than two blocks, with at most two (`A=2`); with two blocks or fewer the
bound changes nothing, so that cell would only repeat the unbounded one.

The hybrids decode with the AR model as target (`model`) and the D2F student as drafter
(`drafter`: a second model of the study, bound as the decoder's drafter_params / drafter_cfg):
  * speculative (`method="speculative"`, the lossless hybrid): one draft of k = each D2F
    block length per round, verified by AR, greedy;
  * adaptive (`method="adaptive"`): per row and round, commit the draft in parallel, verify
    it, or decode AR, by the rule and thresholds of configs/adaptive.py; on a mixed suite
    also routed by the prompt's text (`router`: each row's tag is its prompt's format,
    experiments/studylib/router.py) and, as the oracle's upper bound, with the generator's
    task names (`task_tags`), which no user has. Neither map is written here: the study
    fits both before decoding (`calibrate`, experiments/studylib/calibration.py) on
    `eval.calibration_prompts` eval-split records after the evaluation prompts, giving each
    prompt format (each task) the fastest mode whose accuracy there is within
    `eval.calibration_tolerance` of AR's.

Competitors run at their published settings: vanilla LLaDA at steps = G over
semi-autoregressive blocks of 32 (G when G < 32), Fast-dLLM at blocks of 32 (threshold 0.9),
D2F at its release's thresholds (tau_conf 0.9, tau_add 0.1, tau_act 0.95); a cell off them
says so in its label ("tuned" for the other D2F thresholds).
"""

import importlib.util
import os

from ml_collections import config_dict

_HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("", "short", "long", "full", "tradeoff")
# The default mode's mixed suite: long worked answers (weight 3 of 7.75: the headline task),
# sorting (copying-like: safe in parallel), two-digit sums written units digit first
# (`37+48=58` for 85: each digit then depends only on digits before it, so the AR baseline
# learns them; written tens first it scored 26%), and running sums (parallel commits fail).
# The short tasks carry more weight than the 1 of 6 under which AR learned 17-31% of running
# sums and 26% of two-digit sums in 900 steps: the baseline must know every task (>= 95%), so
# that the decoders' differences are differences of decoding.
MIXED = ("long_addition:2:3,sorting:1:1.25,arithmetic_reversed:1:2,running_sum:1:1.5")
# mode -> (tasks, canvas block: G is the longest answer + EOS rounded up to it, D2F train block)
DATA = {"": (MIXED, 8, 16), "short": ("arithmetic:1", 16, 4),
        "long": ("addition_sheet:3", 32, 16),
        "full": ("long_addition:2,long_addition:3,long_addition:4", 16, 16)}
# The default's budget (15 minutes on 2 cores, install included, ~11 of them training): the AR
# model learns long addition in ~700 steps and the short tasks later: at 1500 steps it scored
# 78.6% on arithmetic_reversed at training seed 2 (97.6% and 95.2% at seeds 0 and 1), its loss
# still falling; at 1800, 100% on arithmetic_reversed, long_addition and running_sum at seeds
# 0, 1 and 2 but 93.3% (28 of 30) on sorting at seed 0; at 2100, 100% on every task at seeds
# 0, 1 and 2 (the 160 held-out prompts). The 600 steps over 1500 cost ~50 s on a fast host,
# and ~30 s more for the narrow AR drafter, whose recipe (steps included) is the AR model's.
# Other changes did worse at seed 2 and 1500 steps: a peak lr of 5e-3 (7.1% on reversed sums),
# an lr floor of half the peak (end_lr_frac 0.5: 31%) and arithmetic_reversed at weight 3 in
# MIXED (5.3%: the plateau near loss 0.1 that every run passes lasted to the end); at 1800
# steps, sorting at weight 1.5 lost reversed sums at seeds 1 and 2 (69.0%, 47.6%). The MDM
# adapted from it learns in half the steps the from-scratch MDM needs (BENCHMARKS.md section
# 1); the student's drafts need only be good enough for AR to accept long runs of them (the
# lossless hybrid). The student's agreement with its teacher levels off by step 500: in four
# default runs it rose 0.02-0.10 points from step 500 to 700, and those 200 steps cost ~55 s
# of the budget.
STEPS = {"": {"ar": 2100, "mdm": 1500, "d2f": 500, "selfspec": 600},
         "short": {"ar": 1500, "mdm": 1000, "d2f": 1000},
         "long": {"ar": 1000, "mdm": 1500, "d2f": 700},
         "full": {"ar": 20000, "mdm": 40000, "d2f": 10000}}
# Modes whose MDM starts from the trained AR model (with Dream's shifted logits, so that the
# AR model's next-token predictions sit where the MDM reads slot i: at i - 1).
FROM_AR = ("", "short", "long")
# Train records per mode where the default (200k) is more than the models see: the default
# mode's MDM sees 1500 x 64 = 96k examples, and writing 200k records costs ~40 s.
TRAIN_SIZE = {"": 96_000}
HEADLINE = {"": "long_addition", "short": "arithmetic", "long": "addition_sheet",
            "full": "long_addition"}
# The long mode: 192-slot answers make every step ~5x the default's, so the three models train
# at batch 32 (each row holds four problems: 128 worked additions a step, four times the
# default's), the MDM from the AR model, and the grid is the cells its claims need. Its canvas
# block is 32 so that G is a multiple of the reference's decode block (32) as well as of the
# student's training block (16).
TRAIN_BATCH = {"long": 32}
MAX_SEQ_LEN = {"full": 128}
# The long mode's G is a config field (`data.gen_length`, 192 by default: the answers rounded
# up to its canvas block); every model's window follows it, 40 slots above G (the prompt is 37
# with BOS), so `--config.data.gen_length=384` is one flag: LLaDA's regime of a G well above
# the answer, where the published 50x was measured (BENCHMARKS.md section 2).
LONG_WINDOW_ABOVE_G = 40
# The competitors' published settings: LLaDA's semi-autoregressive block and Fast-dLLM's decode
# block (32, or G when G < 32), and D2F's release thresholds (dllm-algorithms.md section 7).
PUBLISHED_BLOCK = 32
D2F_RELEASE = {"tau_conf": 0.9, "tau_add": 0.1, "tau_act": 0.95}
# D2F's commit threshold per mode where it is swept wider than (0.9, 0.7, 0.5): on answers of
# ~160 tokens a per-token error compounds, so the long mode also decodes at 0.95 and 0.99.
D2F_TAUS = {"long": (0.99, 0.95, 0.9, 0.7, 0.5)}
LONG_CELLS = ("ar", "llada steps=G", "fast-dllm tau=0.9 dual", "d2f on mdm (no distill) k=8",
              "block diffusion k=16", "d2f k=16 tau=0.99 tuned", "d2f k=16 tau=0.95 tuned",
              "d2f k=16 tau=0.9", "d2f k=16 A=2 tau=0.9", "d2f k=16 tau=0.7 tuned",
              "d2f k=32 tau=0.99 tuned", "d2f k=32 tau=0.95 tuned", "d2f k=32 tau=0.9",
              "d2f k=32 A=2 tau=0.9", "d2f k=32 tau=0.7 tuned", "d2f k=32 tau=0.5 tuned",
              "speculative d2f k=16", "speculative d2f k=32", "adaptive k=16")
# The default mode's grid (a 15-minute budget: each cell compiles once): one cell per decoder
# and setting that a claim or a contrast needs; the other modes run every cell _methods lists.
DEFAULT_CELLS = ("ar", "llada steps=G", "llada steps=G/2", "fast-dllm tau=0.9 dual",
                 "d2f on mdm (no distill) k=8", "block diffusion k=16", "d2f k=8 tau=0.9",
                 "d2f k=16 tau=0.9", "d2f k=16 tau=0.7 tuned", "d2f k=16 tau=0.5 tuned",
                 "speculative d2f k=8", "speculative d2f k=16", "adaptive k=16",
                 "adaptive k=16 prompt router", "adaptive k=16 task tags (oracle upper bound)",
                 "ar (selfspec model)", "selfspec k=4")


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return config_dict.ConfigDict(module.get_config().to_dict())  # an unlocked copy


def _adaptive(tasks: str, k: int, tags: bool = False, router: bool = False):
  """An adaptive cell: the AR model as target, the D2F student as drafter, the rule's
  thresholds from configs/adaptive.py. With `router`, each row's tag is its prompt's format
  (the prompt text alone: experiments/studylib/router.py) and the format -> mode map is fitted
  by the study on the calibration split (`calibrate`: experiments/studylib/calibration.py),
  never on the evaluation prompts. With `tags`, each row's tag is the generator's task name,
  which no user has: the oracle's upper bound, fitted alike."""
  rule = _load("adaptive").decode
  options = {"draft_length": k, "draft_steps": rule.draft_steps,
             "parallel_confidence": rule.parallel_confidence,
             "ar_confidence": rule.ar_confidence, "min_acceptance": rule.min_acceptance,
             "trust_streak": rule.trust_streak}
  cell = {"method": "adaptive", "label": f"adaptive k={k}", "model": "ar", "drafter": "d2f",
          "options": options}
  if tags:
    cell.update(label=f"adaptive k={k} task tags (oracle upper bound)", task_tags=True,
                calibrate=True)
  if router:
    cell.update(label=f"adaptive k={k} prompt router", router="prompt_format", calibrate=True)
  return cell


def published_block(gen_length: int) -> int:
  """LLaDA's semi-autoregressive block and Fast-dLLM's decode block as released: 32 slots, or
  the whole canvas when G < 32."""
  return min(PUBLISHED_BLOCK, gen_length)


def _methods(mode: str, gen_length: int, train_block: int, tasks: str):
  """The decoding grid. Competitors run at their published settings (vanilla LLaDA: steps =
  G over blocks of 32; Fast-dLLM: blocks of 32; D2F: its release's thresholds, D2F_RELEASE);
  a cell off them says so in its label ("tuned", or the setting it changes)."""
  g = gen_length
  blocks = {"": (8, 16), "short": (4, 8), "long": (16, 32), "full": (8, 16)}[mode]
  published = published_block(g)
  d2f = []
  for block in blocks:
    for active in (None, 2) if g // block > 2 else (None,):
      for tau in D2F_TAUS.get(mode, (0.9, 0.7, 0.5)):
        bound = "" if active is None else f" A={active}"
        tuned = "" if tau == D2F_RELEASE["tau_conf"] else " tuned"
        d2f.append({"method": "d2f", "label": f"d2f k={block}{bound} tau={tau}{tuned}",
                    "model": "d2f",
                    "options": {**D2F_RELEASE, "block_length": block, "tau_conf": tau,
                                "max_active_blocks": active}})
  # The hybrids. Speculative (lossless): the D2F student drafts k tokens in one forward, the
  # AR model verifies them in one (greedy: the output is AR's, token for token). Adaptive:
  # per row and round, commit the draft in parallel, verify it, or decode AR.
  hybrids = [{"method": "speculative", "label": f"speculative d2f k={k}", "model": "ar",
              "drafter": "d2f", "options": {"drafter": "d2f", "draft_length": k}}
             for k in blocks]
  hybrids += [_adaptive(tasks, k, tags=False) for k in blocks]
  if len({part.split(":")[0] for part in tasks.split(",")}) > 1:  # mixed: routed switching
    hybrids += [_adaptive(tasks, k, router=True) for k in blocks]
    hybrids += [_adaptive(tasks, k, tags=True) for k in blocks]
  cells = [
      {"method": "ar", "label": "ar", "model": "ar", "options": {}},
      # Vanilla LLaDA as published: semi-autoregressive blocks of 32 (G when G < 32), one
      # token a step (steps = G), low-confidence remasking, no early exit.
      {"method": "llada", "label": "llada steps=G", "model": "mdm",
       "options": {"block_length": published, "early_stop": False}},
      {"method": "llada", "label": "llada steps=G early-stop", "model": "mdm",
       "options": {"block_length": published}},
      {"method": "llada", "label": "llada steps=G/2", "model": "mdm",
       "options": {"block_length": published, "steps_fraction": 0.5}},
      # Fast-dLLM as released: blocks of 32 (G when G < 32), threshold 0.9.
      {"method": "fast_dllm", "label": "fast-dllm tau=0.9", "model": "mdm",
       "options": {"block_length": published, "threshold": 0.9, "cache": "none"}},
      {"method": "fast_dllm", "label": "fast-dllm tau=0.9 prefix", "model": "mdm",
       "options": {"block_length": published, "threshold": 0.9, "cache": "prefix"}},
      {"method": "fast_dllm", "label": "fast-dllm tau=0.9 dual", "model": "mdm",
       "options": {"block_length": published, "threshold": 0.9, "cache": "dual"}},
      # D2F decoding on the undistilled MDM: what the distillation buys.
      {"method": "d2f", "label": "d2f on mdm (no distill) k=8", "model": "mdm",
       "options": {"block_length": 8, "tau_conf": 0.9}},
      {"method": "block_diffusion", "label": f"block diffusion k={train_block}", "model": "d2f",
       "options": {"block_length": train_block, "steps_per_block": train_block}},
  ] + d2f + hybrids
  if mode in WITH_SELFSPEC:  # the self-speculative model, and its own AR decode (its reference)
    cells += [{"method": "ar", "label": "ar (selfspec model)", "model": "selfspec",
               "options": {}},
              {"method": "selfspec", "label": f"selfspec k={SELFSPEC_K}", "model": "selfspec",
               "options": {"draft_length": SELFSPEC_K}}]
  compact = {"": DEFAULT_CELLS, "long": LONG_CELLS}.get(mode)
  if compact:
    cells = [c for c in cells if c["label"] in compact]
    missing = set(compact) - {c["label"] for c in cells}
    assert not missing, f"the {mode!r} grid names cells _methods does not make: {missing}"
  return cells


# The trade-off mode's own models and grid (see the module docstring).
# The accelerated AR baseline (default mode, and so the trade-off mode): speculative AR
# decoding with `ar_draft`, a narrow AR drafter trained with the AR model's recipe (data,
# steps, optimizer) at d 48, 2 layers, 2 heads (a sixth of its parameters); greedy, so its
# output is the AR model's, token for token. Every "x AR" of the verdict is also given
# against it.
DRAFT_WIDTH = {"d_model": 48, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "mlp_dim": 192}
ACCELERATED_AR_K = 4  # the accelerated AR cell's draft length
ACCELERATED_AR_LABEL = f"speculative ar k={ACCELERATED_AR_K}"
WITH_DRAFTER = ("", "short")  # modes that train ar_draft and time the accelerated AR
# The lightweight diffusion drafter (DFlash's design: a block-diffusion drafter for an AR
# target): `bd_draft`, the narrow network of `ar_draft` trained with the block-diffusion
# objective at the student's block, starting from the trained `ar_draft` (AR-to-diffusion
# adaptation, as the MDM from the AR model), with the MDM's recipe and steps. Over half of a
# speculative round of the full-width D2F student is its drafter's forward on a CPU; the
# narrow drafter's forward costs a fraction of it (BENCHMARKS.md section 1).
# Trained from scratch for the same steps it drafts far worse (21 against 10 forwards a
# long-addition prompt at k = 8), and with 800 steps from `ar_draft` too (14).
WITH_BD_DRAFTER = ("",)
# The self-speculative model (TiDAR): the AR model's network and data, trained on from the AR
# model (`init_source`) with selfspec_loss: the causal loss plus a block of SELFSPEC_K + 1
# masks that drafts from a clean causal prefix. Its decoder drafts SELFSPEC_K tokens in every
# forward and verifies the previous draft in the same forward; greedy, its output is its own
# AR decode token for token, so its cell sits beside that AR decode.
WITH_SELFSPEC = ("",)
SELFSPEC_K = 4
BD_DRAFTER_KS = (8,)  # its speculative cells' draft lengths

# The default mode's models the trade-off grid does not decode (not loaded there).
TRADEOFF_UNUSED = ("bd_draft", "selfspec")
TRADEOFF = {
    "draft_lengths": (2, ACCELERATED_AR_K),
    # MDMs trained with each alpha(t), same data, steps, seed and start (the default MDM's:
    # the AR model, when mdm_from_ar): 500 steps each (not the default MDM's 1500, so that
    # the three fit the mode's budget).
    "train_schedules": ("linear", "cosine", "polynomial"),
    "train_schedule_steps": 500,
    "steps_divisors": (1, 2, 4, 8, 16),              # steps per block k / d
    "entropy_bounds": (0.01, 0.1, 0.3, 1.0, 3.0),    # nats
    "thresholds": (0.95, 0.9, 0.8, 0.7, 0.5, 0.3),   # Fast-dLLM threshold, D2F tau_conf
}


def get_config(mode: str = ""):
  if mode == CHECKPOINTS:
    return _checkpoints_config()
  if mode not in MODES:
    raise ValueError(f"unknown study mode {mode!r}; use configs/study.py, "
                     "configs/study.py:short, configs/study.py:long, configs/study.py:full, "
                     "configs/study.py:tradeoff or configs/study.py:checkpoints")
  if mode == "tradeoff":
    return _tradeoff_config()
  full = mode == "full"
  tasks, block, train_block = DATA[mode]
  c = config_dict.ConfigDict()
  c.mode = mode  # names the default workdir: runs/study, runs/study_<mode> for the others
  c.models = config_dict.ConfigDict()
  c.models.ar = _load("ar_tiny")
  c.models.mdm = _load("mdm_tiny")
  c.models.d2f = _load("d2f_tiny")
  if mode in WITH_SELFSPEC:
    c.models.selfspec = _selfspec(c.models.ar)

  # One data section for all three models: same tasks, tokenizer, canvas and held-out split.
  c.data = config_dict.ConfigDict(c.models.mdm.data.to_dict())
  c.data.tasks = tasks
  c.data.block_size = block
  if mode in TRAIN_SIZE:
    c.data.train_size = TRAIN_SIZE[mode]
  # The package's data path: TFDS array_record files built once under <workdir>/data (a
  # data_dir set here is used instead) and read with tfds.data_source.
  c.data.source = "tfds"
  c.data.data_dir = config_dict.placeholder(str)
  # Initialise the MDM from the trained AR model (AR-to-diffusion adaptation); the D2F student
  # always starts from the MDM.
  c.mdm_from_ar = mode in FROM_AR
  if mode == "long":
    c.data.gen_length = _gen_length(c.data)
  if mode in FROM_AR:  # Dream's convention for both diffusion models (the student's is its MDM's)
    c.models.mdm.model.shift_logits = c.models.d2f.model.shift_logits = True

  for name, n in STEPS[mode].items():
    m = c.models[name]
    m.train.steps = n
    m.train.eval_every = 0
    m.train.ckpt_every = 0 if n < 5000 else 2000
    m.decode.eval_examples = 0
    m.opt.decay_steps = None
    if mode in TRAIN_BATCH:
      m.train.batch_size = TRAIN_BATCH[mode]
    if mode in MAX_SEQ_LEN:
      m.model.max_seq_len = MAX_SEQ_LEN[mode]
    if mode == "long":
      m.model.max_seq_len = c.data.get_ref("gen_length") + LONG_WINDOW_ABOVE_G
    if full:
      m.model.d_model, m.model.n_layers, m.model.mlp_dim = 512, 8, 2048
      m.model.n_heads = m.model.n_kv_heads = 8
  c.eval = config_dict.ConfigDict()
  c.eval.accelerated_ar_label = config_dict.placeholder(str)  # None: no accelerated AR
  if mode in WITH_DRAFTER:
    c.models.ar_draft = _narrow(c.models.ar)
    c.eval.accelerated_ar_label = ACCELERATED_AR_LABEL
  if mode in WITH_BD_DRAFTER:
    bd = c.models.bd_draft = _narrow(c.models.mdm)
    bd.objective.name = "block_diffusion"
    bd.objective.options = {"block_size": train_block, "sft": True}
    bd.decode.method = "block_diffusion"
    bd.decode.options = {"block_length": train_block}
  c.models.d2f.objective.options = {"block_size": train_block}
  c.models.d2f.decode.options = {"block_length": train_block}

  c.eval.num_prompts = {"": 160, "short": 160, "full": 512}.get(mode, 128)
  # The default mode decodes at batch 1 only (the verdict's batch; its budget), the others at
  # batch 1 and a larger batch.
  c.eval.batch_sizes = {"": (1,), "long": (1,), "full": (1, 64)}.get(mode, (1, 16))
  c.eval.seed = 0
  c.eval.headline_task = HEADLINE[mode]
  c.eval.llada_vanilla_label = "llada steps=G"
  # GB/s for AR's weight-streaming bound; 0 = nominal peak of a known accelerator, or a
  # measured copy on a CPU (studylib.roofline).
  c.eval.memory_bandwidth_gbps = 0.0
  # Timing on a shared machine: cells are timed round-robin batch by batch, and each batch is
  # decoded this many times in a row, its fastest wall time counting (studylib/runner.py).
  c.eval.timing_repeats = 3 if mode in ("", "long") else 5
  # The calibration split of the task-tagged adaptive cells: eval-split records after the
  # evaluation prompts; a task's mode must match AR's accuracy there within this tolerance.
  c.eval.calibration_prompts = 192
  c.eval.calibration_tolerance = 0.0
  c.methods = _methods(mode, _gen_length(c.data), train_block, tasks)
  if mode in WITH_DRAFTER:
    c.methods.insert(1, _accelerated_ar(ACCELERATED_AR_K))
  if mode in WITH_BD_DRAFTER:  # beside the other speculative cells
    last = max(i for i, m in enumerate(c.methods) if m["method"] == "speculative")
    c.methods[last + 1:last + 1] = [_bd_speculative(k) for k in BD_DRAFTER_KS]
  c.lock()
  return c


def _tradeoff_config():
  """The default mode's config (same data, same AR / MDM / D2F models and narrow AR drafter,
  so that the default mode's cached models are loaded) with the trade-off models and grid.
  The default mode's answers (31-character worked additions at G = 32) are long enough for
  the step count to matter; the short mode's 2.5-token answers were not (every cell scored
  alike)."""
  c = config_dict.ConfigDict(get_config("").to_dict())  # an unlocked copy
  for name in TRADEOFF_UNUSED:
    del c.models[name]
  t = TRADEOFF
  c.mode = "tradeoff"
  for schedule in t["train_schedules"]:
    m = c.models[f"mdm_{schedule}"] = config_dict.ConfigDict(c.models.mdm.to_dict())
    m.objective.options = {**m.objective.options.to_dict(), "schedule": schedule}
    m.train.steps = t["train_schedule_steps"]
  c.tradeoff = config_dict.ConfigDict(t)
  c.eval.batch_sizes = (1,)
  c.eval.timing_repeats = 3
  g = _gen_length(c.data)
  c.methods = _tradeoff_methods(g, c.models.d2f.objective.options.block_size, t)
  c.eval.llada_vanilla_label = f"llada even s={g}"
  c.lock()
  return c


def _selfspec(ar_config):
  """The AR model's training config with the self-speculative objective (WITH_SELFSPEC)."""
  m = config_dict.ConfigDict(ar_config.to_dict())
  m.objective.name = "selfspec"
  m.objective.options = {"block_size": SELFSPEC_K + 1, "draft_weight": 1.0}
  return m


def _narrow(model_config):
  """A copy of a study model's training config at the drafters' width (DRAFT_WIDTH)."""
  narrow = config_dict.ConfigDict(model_config.to_dict())
  for key, value in DRAFT_WIDTH.items():
    narrow.model[key] = value
  return narrow


def _accelerated_ar(k: int, **extra):
  """Speculative AR: the AR model verifies drafts of k tokens from the narrow AR drafter."""
  return {"method": "speculative", "label": f"speculative ar k={k}", "model": "ar",
          "drafter": "ar_draft", "options": {"drafter": "ar", "draft_length": k}, **extra}


def _bd_speculative(k: int):
  """Speculative decoding with the narrow block-diffusion drafter `bd_draft`: it drafts k
  tokens in one forward over its exact cache, the AR model verifies them in one (greedy:
  AR's output, token for token)."""
  return {"method": "speculative", "label": f"speculative narrow-bd k={k}", "model": "ar",
          "drafter": "bd_draft", "options": {"drafter": "d2f", "draft_length": k}}


def _step_counts(k: int, divisors) -> list[int]:
  """Steps per block k / d for each d that divides k (a step commits at least one slot)."""
  return [k // d for d in divisors if k % d == 0]


def _knob_cells(method, model, curve, base_options, knob, values, label):
  """One cell per knob value on one curve (decoder x schedule)."""
  return [{"method": method, "label": label.format(v=v), "model": model, "curve": curve,
           "knob": knob, "options": {**base_options, knob: v}} for v in values]


def _tradeoff_methods(g: int, train_block: int, t: dict):
  """The trade-off grid: every cell carries its `curve` (decoder x schedule) and `knob` (the
  option swept along the curve)."""
  cells = [{"method": "ar", "label": "ar", "model": "ar", "curve": "ar", "knob": None,
            "options": {}}]
  cells += [_accelerated_ar(k, curve="speculative ar", knob="draft_length")
            for k in t["draft_lengths"]]
  bounds = t["entropy_bounds"]
  for name, method, model, k, extra, steps_key in (
      ("llada", "llada", "mdm", g, {"block_length": g, "early_stop": False}, "steps"),
      ("block diffusion", "block_diffusion", "d2f", train_block,
       {"block_length": train_block}, "steps_per_block")):
    steps = _step_counts(k, t["steps_divisors"])
    for schedule in ("even", "cosine"):
      cells += _knob_cells(method, model, f"{name} {schedule}",
                           {**extra, "unmasking": schedule}, steps_key, steps,
                           f"{name} {schedule} s={{v}}")
    cells += _knob_cells(method, model, f"{name} entropy_bound",
                         {**extra, "unmasking": "entropy_bound"}, "entropy_bound", bounds,
                         f"{name} entropy_bound={{v}}")
  cells += _knob_cells("fast_dllm", "mdm", "fast-dllm threshold",
                       {"block_length": published_block(g), "cache": "prefix"}, "threshold",
                       t["thresholds"], "fast-dllm tau={v}")
  cells += _knob_cells("d2f", "d2f", "d2f threshold",
                       {"block_length": train_block, "tau_add": 0.1, "tau_act": 0.95},
                       "tau_conf", t["thresholds"], "d2f tau={v}")
  for schedule in t["train_schedules"]:  # the training noise schedules, decoded alike
    cells += _knob_cells("llada", f"mdm_{schedule}", f"mdm trained {schedule}",
                         {"block_length": g, "early_stop": False, "unmasking": "even"},
                         "steps", _step_counts(g, t["steps_divisors"]),
                         f"mdm {schedule} s={{v}}")
  return cells


def _gen_length(data) -> int:
  """G: `data.gen_length` when set, else the longest answer plus its EOS rounded up to the
  canvas block (as the layout does)."""
  if data.get("gen_length"):
    return int(data.gen_length)
  from dllm_jax.data.tasks import TaskSuite  # pylint: disable=import-outside-toplevel
  answer = TaskSuite.parse(data.tasks).max_answer_len + 1
  return -(-answer // data.block_size) * data.block_size


# --- The checkpoint mode: published checkpoints on a GSM8K-format set (no training) ---
#
#   python experiments/study.py --config configs/study.py:checkpoints \
#       --config.checkpoints.ar=/models/Meta-Llama-3-8B-Instruct \
#       --config.checkpoints.diffusion=/models/LLaDA-8B-Instruct \
#       --config.checkpoints.d2f_adapter=/models/D2F_LLaDA_Instruct_8B_Lora \
#       --config.eval_set.source=/data/gsm8k_test.jsonl --config.mesh='{"fsdp": 8}'
#
# Each model is loaded with dllm_jax.loading (a HF dir, a converted dir or a training run):
#   ar           the AR baseline (LLaMA-3-8B-Instruct in the D2F paper's table);
#   diffusion    the masked-diffusion model (LLaDA-8B-Instruct; a Dream checkpoint decodes
#                its vanilla cells with Dream's decoder);
#   d2f_adapter  the D2F LoRA of `diffusion` (PEFT dir), merged in at load: the D2F model;
#   drafter      a drafter for the AR model sharing its tokenizer: a small AR model (the
#                accelerated AR baseline, speculative AR) or a diffusion model (a diffusion
#                drafter verified by AR).
# Any of them may be left out: the cells that need it are listed as skipped, with the reason,
# and the verdict marks their claims "not measured". The hybrids with the D2F model as
# drafter need it to share the AR model's tokenizer (LLaDA's is not LLaMA-3's: they are
# skipped for that pair, with the reason).
CHECKPOINTS = "checkpoints"
CHECKPOINT_MODEL_KEYS = ("ar", "diffusion", "d2f_adapter", "drafter")
# The published settings of each decoder (dllm-algorithms.md sections 3, 5, 7, 11):
PAPER_BLOCK = 32            # Fast-dLLM's and LLaDA's semi-AR block, the D2F headline block
D2F_GSM8K_BLOCK = 64        # the D2F release's GSM8K block
D2F_RELEASE = {"tau_conf": 0.9, "tau_add": 0.7, "tau_act": 0.95}  # skip / block-add /
                                                                  # decoded-token thresholds
FAST_DLLM_THRESHOLD = 0.9
SPECULATIVE_AR_K = 4        # the accelerated AR's draft length
DIFFUSION_DRAFT_K = 16      # a diffusion drafter's block (DFlash's; the D2F training block)


def _checkpoints_config():
  c = config_dict.ConfigDict()
  c.mode = CHECKPOINTS
  c.checkpoints = config_dict.ConfigDict(
      {k: config_dict.placeholder(str) for k in CHECKPOINT_MODEL_KEYS})
  c.checkpoints.dtype = "bfloat16"   # HF weights are converted to this; others load as saved
  c.eval_set = config_dict.ConfigDict()
  c.eval_set.source = config_dict.placeholder(str)   # .jsonl / .parquet, "openai/gsm8k", "tfds:gsm8k"
  c.eval_set.split = "test"
  # The few-shot pool (lm-eval draws shots from GSM8K's train split); None: the evaluated split
  # itself, a question never its own shot.
  c.eval_set.fewshot_source = config_dict.placeholder(str)
  c.eval_set.n_shot = 4              # the D2F paper's GSM8K table (lm-eval's default is 5)
  c.eval_set.limit = config_dict.placeholder(int)    # None: every question
  # The filter behind every cell's accuracy and the verdict; both are reported per cell.
  c.eval_set.score = "strict"        # "strict" (#### N) or "flexible" (the last number)
  c.gen_length = 256                 # G: response slots (Fast-dLLM's LLaDA GSM8K length)
  c.mesh = config_dict.placeholder(str)  # JSON axis sizes, e.g. '{"fsdp": 8}'; None: one device
  # The --dry-run budget per device ("16GiB", "80GB"); None: the device's own memory.
  c.device_memory = config_dict.placeholder(str)
  c.eval = config_dict.ConfigDict()
  c.eval.batch_sizes = (1, 16)
  c.eval.seed = 0
  c.eval.timing_repeats = 1          # a real model's decode is seconds: one timed pass
  c.eval.headline_task = "gsm8k"
  c.eval.llada_vanilla_label = "vanilla steps=G"
  c.eval.accelerated_ar_label = f"speculative ar k={SPECULATIVE_AR_K}"
  c.eval.memory_bandwidth_gbps = 0.0
  c.methods = _checkpoint_methods()
  c.lock()
  return c


def _checkpoint_methods():
  """Every decoder the four checkpoints allow, each at its paper's published settings. The
  vanilla and semi-AR cells run LLaDA's decoder (Dream's on a Dream checkpoint); `model` and
  `drafter` name checkpoints of `checkpoints` ("d2f": the diffusion model + D2F adapter)."""
  rule = _load("adaptive").decode
  d2f = lambda k: {"method": "d2f", "label": f"d2f k={k} tau={D2F_RELEASE['tau_conf']}",  # noqa: E731
                   "model": "d2f", "options": {"block_length": k, **D2F_RELEASE}}
  fast = lambda cache: {  # noqa: E731
      "method": "fast_dllm", "label": f"fast-dllm k={PAPER_BLOCK} tau={FAST_DLLM_THRESHOLD} "
      f"{cache}", "model": "diffusion", "options": {
          "block_length": PAPER_BLOCK, "threshold": FAST_DLLM_THRESHOLD, "cache": cache}}
  return [
      {"method": "ar", "label": "ar", "model": "ar", "options": {}},
      {"method": "speculative", "label": f"speculative ar k={SPECULATIVE_AR_K}", "model": "ar",
       "drafter": "drafter", "options": {"drafter": "ar", "draft_length": SPECULATIVE_AR_K}},
      # Vanilla LLaDA: one block over G, steps = G, the reference decoding past EOS.
      {"method": "llada", "label": "vanilla steps=G", "model": "diffusion",
       "options": {"block_fraction": 1, "steps_fraction": 1, "early_stop": False}},
      {"method": "llada", "label": f"semi-ar k={PAPER_BLOCK} steps=G", "model": "diffusion",
       "options": {"block_length": PAPER_BLOCK, "steps_fraction": 1, "early_stop": False}},
      fast("prefix"), fast("dual"),
      d2f(PAPER_BLOCK), d2f(D2F_GSM8K_BLOCK),
      {"method": "block_diffusion", "label": f"block diffusion k={PAPER_BLOCK}", "model": "d2f",
       "options": {"block_length": PAPER_BLOCK, "steps_per_block": PAPER_BLOCK}},
      {"method": "speculative", "label": f"speculative d2f k={DIFFUSION_DRAFT_K}", "model": "ar",
       "drafter": "d2f", "options": {"drafter": "d2f", "draft_length": DIFFUSION_DRAFT_K}},
      {"method": "speculative", "label": f"speculative diffusion-drafter k={DIFFUSION_DRAFT_K}",
       "model": "ar", "drafter": "drafter",
       "options": {"drafter": "d2f", "draft_length": DIFFUSION_DRAFT_K}},
      {"method": "adaptive", "label": f"adaptive k={DIFFUSION_DRAFT_K}", "model": "ar",
       "drafter": "d2f", "options": {
           "draft_length": DIFFUSION_DRAFT_K, "draft_steps": rule.draft_steps,
           "parallel_confidence": rule.parallel_confidence,
           "ar_confidence": rule.ar_confidence, "min_acceptance": rule.min_acceptance,
           "trust_streak": rule.trust_streak}},
  ]
