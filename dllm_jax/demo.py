"""The built-in demo: tiny arithmetic models the package trains itself on first use, then caches.

    root = demo.ensure()              # trains on first use (minutes on a CPU), then cached
    demo.model_dir("d2f", root)       # the training workdir that decodes with a method
    demo.drafter_dir("speculative", root)  # and the one a hybrid drafts with

Nothing is downloaded and nothing binary is committed: the package's own trainer
(`training.trainer.train`) fits four 0.1M-parameter networks on the synthetic two-digit
addition task (`data.tasks` "arithmetic:1": a+b with a, b in [0, 100), "37+48=" -> "85"),
character tokenizer, 8-slot answer canvas, fixed seeds (a rebuild gives the same weights):

  ar/               causal next-token loss, from scratch     --method ar; the target of
                                                              speculative and adaptive
  block_diffusion/  block diffusion, 4-slot blocks,          --method d2f, block_diffusion;
                    block-causal                              the drafter of speculative and
                                                              adaptive
  mdm/              masked diffusion, bidirectional          --method llada, dream, fast_dllm
  selfspec/         causal next-token loss + a masked        --method selfspec
                    4-slot draft block (selfspec_loss)

Every registered method decodes with the demo: each gets the model trained with the
attention pattern its decoder declares (`Decoder.attention`: causal, block_causal,
bidirectional or selfspec; a block-causal model read bidirectionally, or the reverse, answers
almost nothing), and a hybrid that drafts with a second model also gets the model of its
`drafter_attention` as drafter_params / drafter_cfg (`loading.load_model("demo", method)`), so
`--model demo --method speculative` needs no `--drafter_model`. A new method registered with
one of these patterns has a demo model without a change here.

The other models start from the AR model. The two diffusion models switch to Dream's shifted
logits (`shift_logits`: slot i is predicted at i - 1, where the AR model already predicts its
next token), as Dream starts from Qwen; from scratch they need thousands of steps, from the
AR model a few hundred. The self-speculative model keeps the AR model's unshifted logits (its
greedy selfspec decode is its own greedy AR decode) and learns to draft with its mask block.

Each model is an ordinary training workdir (config.json + checkpoints/), loadable with
`Sampler.load(path)` like any run. The cache is `$DLLM_JAX_CACHE/demo` (default
`~/.cache/dllm_jax/demo`), one subdirectory per recipe fingerprint, so a changed recipe trains
afresh. A build trains into a private temporary directory beside the target and renames it
into place only when every model has finished: an interrupted build leaves no half model (its
temporary directory is removed, or swept by the next build once its process is gone).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from dllm_jax.training import config as config_lib

CACHE_ENV = "DLLM_JAX_CACHE"
ORDER = ("ar", "block_diffusion", "mdm", "selfspec")  # the others start from the AR one
BLOCK = 4
_PARTIAL = ".partial-"


# Which model decodes with each method: the one trained with the attention pattern the
# method's decoder declares (`Decoder.attention`; a hybrid's drafter: `drafter_attention`).
# No method is named here: a method registered in `decoding.registry` gets its model from
# its attention pattern.
MODEL_FOR = {"causal": "ar", "block_causal": "block_diffusion", "bidirectional": "mdm",
             "selfspec": "selfspec"}
# Steps leave a margin over test_demo's 80% bar on every host seen (fewer made the AR model
# and the MDM a draw of the host's floating point; BENCHMARKS.md records the figures). The
# self-speculative model starts from the AR one and keeps its greedy answers (its greedy
# selfspec decode is its own AR decode) while the mask block learns to draft; a step costs
# about two of the AR model's (two forwards).
STEPS = {"ar": 1200, "block_diffusion": 400, "mdm": 1000, "selfspec": 300}


def model_for_attention(attention: str) -> str:
  """The demo model trained with `attention` (see MODEL_FOR)."""
  if attention not in MODEL_FOR:
    raise ValueError(f"the demo has no model trained with attention {attention!r}; it has "
                     f"{sorted(MODEL_FOR)}.")
  return MODEL_FOR[attention]


def model_for(method: str) -> str:
  """The demo model that decodes with `method`: the one of its decoder's attention."""
  from dllm_jax.decoding import registry
  return model_for_attention(registry.get(method).attention)


def drafter_for(method: str) -> str | None:
  """The demo model that drafts for `method` (its decoder's `drafter_attention`), or None
  for a method without a drafter."""
  from dllm_jax.decoding import registry
  decoder = registry.get(method)
  if not decoder.uses_drafter:
    return None
  if decoder.drafter_attention is None:
    raise ValueError(f"method {method!r} drafts with a second model but its decoder declares "
                     "no drafter_attention, so the demo cannot pick its drafter; pass one.")
  return model_for_attention(decoder.drafter_attention)


def training_config(name: str, root: Path | None = None):
  """The training config of demo model `name`: a small network on two-digit addition.

  The other models start from the AR model in `root` (`train.init_from`). The diffusion
  models switch to Dream's shifted logits (the prediction for slot i is read at i - 1, where
  the AR model predicts its next token), which is what lets them learn the task in a few
  hundred steps. The self-speculative model keeps the AR model's unshifted logits and adds
  the selfspec objective's masked draft block to its causal loss.
  """
  c = config_lib.tiny_arithmetic_config()  # char tokenizer, 8-slot answer canvas, block 4
  c.model.d_model, c.model.n_layers, c.model.mlp_dim = 64, 2, 256
  c.model.n_heads, c.model.n_kv_heads = 4, 4
  c.data.train_size = 20_000
  c.opt.lr = 1e-2
  c.opt.warmup_steps = 50
  c.opt.weight_decay = 0.1
  c.train.batch_size = 64
  c.train.log_every = 10_000     # quiet: one line at the end
  c.train.eval_every = 0         # the final eval only
  c.train.eval_batches = 1
  c.train.ckpt_every = 0         # one checkpoint, at the end
  c.train.keep = 1
  c.train.async_checkpoints = False
  c.decode.eval_examples = 0
  if name not in ORDER:
    raise ValueError(f"unknown demo model {name!r}; the demo has {ORDER}.")
  c.train.steps = STEPS[name]
  c.objective.name = name
  # decode.method keeps its default: the runs decode nothing while training
  # (decode.eval_examples = 0), and the demo picks a model's methods by attention (MODEL_FOR).
  if name != "ar":
    c.opt.lr = 3e-3
    c.train.init_from = str(Path(root or ".") / "ar")
  if name in ("block_diffusion", "mdm"):
    c.model.shift_logits = True
    c.objective.options = ({"block_size": BLOCK, "sft": True} if name == "block_diffusion"
                           else {"sft": True})
  elif name == "selfspec":  # unshifted, like the AR model it continues (selfspec.check_model)
    c.objective.options = {"block_size": BLOCK, "draft_weight": 1.0}
  return config_lib.finalize(c)


def recipe() -> dict:
  """Every training config of the demo, as JSON-able dicts (what the cache is keyed by)."""
  out = {name: json.loads(config_lib.to_json(training_config(name))) for name in ORDER}
  for config in out.values():  # where the build ran is not part of the recipe
    config["train"]["init_from"] = None
  return out


def cache_root() -> Path:
  root = os.environ.get(CACHE_ENV)
  return Path(root).expanduser() if root else Path.home() / ".cache" / "dllm_jax"


def demo_dir(root: Path | None = None) -> Path:
  """Where the demo of the current recipe lives (built or not)."""
  digest = hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:12]
  return (cache_root() if root is None else Path(root)) / "demo" / digest


def is_built(path: Path) -> bool:
  return (path / "recipe.json").is_file() and all((path / n).is_dir() for n in ORDER)


def model_dir(method: str, root: Path | None = None) -> Path:
  """The workdir of the model that decodes with `method`."""
  return (demo_dir() if root is None else Path(root)) / model_for(method)


def drafter_dir(method: str, root: Path | None = None) -> Path | None:
  """The workdir of the model that drafts for `method`, or None if it drafts with none."""
  name = drafter_for(method)
  return None if name is None else (demo_dir() if root is None else Path(root)) / name


def _stderr(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def ensure(root: Path | None = None, *, log: Callable[[str], None] = _stderr) -> Path:
  """The built demo directory, training it first if the cache lacks it."""
  target = demo_dir(root)
  if is_built(target):
    return target
  from dllm_jax.training import trainer
  target.parent.mkdir(parents=True, exist_ok=True)
  for stale in target.parent.glob(f".{target.name}{_PARTIAL}*"):  # left by a killed build
    if not _owned_by_live_process(stale):
      shutil.rmtree(stale, ignore_errors=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{_PARTIAL}{os.getpid()}-",
                              dir=target.parent))
  log(f"[demo] first use: training the demo models into {target} ({sum(STEPS.values())} small "
      "steps: minutes on a CPU; cached afterwards)")
  try:
    for name in ORDER:
      with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the answers
        final = trainer.train(training_config(name, tmp), tmp / name)
      scores = [f"eval {k[5:].replace('_', ' ')} {v:.3f}" for k, v in sorted(final.items())
                if k.startswith("eval/") and k.endswith("accuracy")]  # selfspec: ar, draft
      log(f"[demo] {name}: {', '.join(scores)}")
    (tmp / "recipe.json").write_text(json.dumps(recipe(), indent=1, sort_keys=True))
    try:
      os.rename(tmp, target)
    except OSError:  # another process finished the same build first: use theirs
      if not is_built(target):
        raise
      shutil.rmtree(tmp, ignore_errors=True)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return target


def _owned_by_live_process(path: Path) -> bool:
  """Whether a partial build directory belongs to a process that is still running."""
  pid = path.name.split(_PARTIAL, 1)[-1].split("-", 1)[0]
  if not pid.isdigit():
    return False
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True
