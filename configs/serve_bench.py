"""Serving benchmark: the continuous-batching engine against static batching
(see `studylib.serve_bench`).

  python experiments/serve_bench.py                          # runs/serve_bench
  python experiments/serve_bench.py --config.concurrency='(16,)' --config.num_requests=96

Workload: `num_requests` prompts from the synthetic suite `tasks` (short arithmetic answers
mixed with long worked additions), character-tokenized; each request may return up to its
reference answer's length + 1 tokens (`max_new_tokens`, at most gen_length), so short and
long answers mix. All requests arrive at once, in a fixed order.

Model: the tiny preset (d 32, 2 layers, vocab 64) with random weights scaled by `peak`
(peaked softmaxes, as in the decoder tests), sampled at `temperature` with one seed per
request; the EOS logit column is scaled by `eos_scale` so that the model also ends answers
on its own at varied lengths (at eos_scale 1 it rarely does: the answer budgets make the
mix). D2F keeps at most `d2f_max_active_blocks` blocks in flight. Random weights, not a
trained model: the benchmark measures
scheduling, which depends on the mix of answer lengths, not on what the tokens say. The
hybrids (`--config.methods='("speculative","selfspec","adaptive")'`) draft with the same
random weights, so they measure the scheduling of round-based decoders, not drafting.
"""

from ml_collections import config_dict


def get_config():
  c = config_dict.ConfigDict()
  c.seed = 0
  c.preset = "tiny"
  c.peak = 20.0
  c.eos_scale = 1.0
  c.temperature = 1.0
  c.tasks = "arithmetic:1,arithmetic:2,long_addition:3,long_addition:5"
  c.num_requests = 192
  c.concurrency = (1, 4, 16, 64)
  c.methods = ("ar", "d2f")
  c.gen_length = 64
  c.block_length = 8
  c.max_prompt_len = 32
  c.max_steps_per_run = 16
  c.d2f_taus = (("tau_add", 0.1), ("tau_act", 0.95), ("tau_conf", 0.9))
  # Blocks in flight per D2F row (None: no bound, the reference). A slot batch mixes rows at
  # every stage, so its fitted window is the widest row's: with no bound that is most of the
  # response every step, and the engine gains less over static batching than with a bound
  # of 2 (BENCHMARKS.md, the serving benchmark).
  c.d2f_max_active_blocks = 2
  # The hybrids (methods "speculative", "selfspec", "adaptive"): tokens drafted per round,
  # and adaptive's task tag -> mode map (each request's tag is its task's name).
  c.draft_length = 4
  c.adaptive_task_modes = (("arithmetic", "ar"), ("long_addition", "auto"))
  return c
