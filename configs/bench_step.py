"""The decode step's own cost (`studylib.step_bench`): each decoder's jitted step against a
bare jitted forward over the same slots and cache, at the tiny LLaDA shape and at base_100m.

  python experiments/bench_step.py                       # runs/bench_step
  python experiments/bench_step.py --config.scales='("tiny",)' --config.repeats=3

Random weights, no stop ids (every row writes G); D2F at its release's thresholds, Fast-dLLM
at threshold 0.9 with each cache, speculative with an AR drafter, self-speculation at k = 3.
"""

from ml_collections import config_dict


def get_config():
  c = config_dict.ConfigDict()
  c.seed = 0
  c.tiny = config_dict.ConfigDict(
      {"vocab_size": 96, "d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_dim": 192})
  c.scales = ("tiny", "base_100m")
  c.decoders = ("ar", "llada", "dream", "fast_dllm", "d2f", "block_diffusion", "speculative",
                "selfspec")
  c.gen_length = 64
  c.block_length = 16
  c.draft_length = 3
  c.threshold = 0.9
  c.d2f_taus = (("tau_add", 0.1), ("tau_act", 0.95), ("tau_conf", 0.9))
  c.batches = (1, 8)
  c.min_prompt_len = 8
  c.max_prompt_len = 24
  c.points = (0.25, 0.5, 0.75)   # where along the decode the step is measured
  c.repeats = 5
  c.inner = 5                     # calls per timed repeat
  c.loop_steps = 20               # calls inside one compiled loop (the in-loop timing)
  c.batch_cost_rows = 4           # the batch-vs-rows table (0: skip it)
  c.head_scale = 100.0            # its model's logits times this: rows finish at different steps
  c.dtype_scales = ("base_100m",)  # AR forward in float32 vs bfloat16 at these scales
  return c
