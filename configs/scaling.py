"""Scaling mode of the speed study: decoder cost against G, batch and model width.

  python experiments/scaling.py --config configs/scaling.py --workdir runs/scaling
  python experiments/scaling.py --config configs/scaling.py:full --workdir runs/scaling_full
  python experiments/scaling.py --config configs/scaling.py:1b --workdir runs/scaling_1b

Random-weight models without stop ids, every decoder at one token per forward; see
`studylib.scaling`. The default sweep fits a few minutes on a 2-core CPU: the width
line runs at G=64, and cells whose estimated compute exceeds `max_cell_tflop` are skipped
(and listed as skipped). `full` is the whole grid for an accelerator, with no cap. `1b` is
only its weight-streaming point: AR, Fast-dLLM (dual cache) and D2F at batch 1 and G = 256
on the 92M and 1.2B bf16 models, a few minutes on one accelerator
(experiments/accelerator_check.sh runs it).
"""

from ml_collections import config_dict

DECODERS = ("ar", "llada", "fast_dllm_none", "fast_dllm_prefix", "fast_dllm_dual", "d2f",
            "block_diffusion")


MODES = ("cpu", "full", "1b")


def get_config(mode: str = "cpu"):
  if mode not in MODES:
    raise ValueError(f"Unknown scaling mode {mode!r}; use one of {MODES} ('cpu' is the "
                     "default).")
  full = mode in ("full", "1b")
  c = config_dict.ConfigDict()
  c.mode = mode
  c.seed = 0
  c.vocab_size = 260               # byte-level vocabulary + specials
  c.prompt_len = 16
  c.decoders = DECODERS
  c.block_length = 32              # Fast-dLLM blocks, D2F / block-diffusion block size k
  c.d2f_max_active_blocks = 2      # D2F forwards a window of A * k (sometimes (A + 1) * k)
  c.d2f_tau_add = 0.1
  c.d2f_tau_act = 0.95
  # Three sweep lines through (G, batch, width).
  c.lengths = config_dict.ConfigDict({
      "sweep": (64, 128, 256, 512, 1024) if full else (64, 256, 1024),
      "batch": 1, "width": 256 if full else 64})
  c.batches = config_dict.ConfigDict({
      "sweep": (1, 4, 16, 64) if full else (1, 8), "gen_length": 256,
      "width": 256 if full else 64})
  c.widths = config_dict.ConfigDict({
      # 768: 92M params; 1792: 1.2B (28 layers), the accelerator mode's ~1B model.
      "sweep": (64, 128, 256, 512, 768, 1792) if full else (64, 256, 768),
      "gen_length": 256 if full else 64, "batch": 1})
  c.repeats = 5 if full else 3     # timed calls per cell (median), after a warm-up call
  c.timing_budget_s = 5.0 if full else 1.0  # stop repeating once timed calls took this long
  # Skip cells whose estimated compute per decode exceeds this many TFLOP (0: no cap).
  c.max_cell_tflop = 0.0 if full else 0.5
  # Memory bandwidth for the weight-streaming bound, GB/s; 0 = the nominal peak of a known
  # accelerator, or a measured copy on a CPU (studylib.roofline).
  c.memory_bandwidth_gbps = 0.0
  # Parameter and compute dtype of the random-weight models (bf16 as served on accelerators).
  c.dtype = "bfloat16" if full else "float32"
  if mode == "1b":  # the width line's two largest models only, at batch 1
    c.decoders = ("ar", "fast_dllm_dual", "d2f")
    c.lengths.sweep, c.batches.sweep, c.widths.sweep = (), (), (768, 1792)
  return c
