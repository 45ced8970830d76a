"""Decode benchmark: D2F's fitted forward window against the full one, beside AR, LLaDA and
Fast-dLLM (see `studylib.decode_bench`).

  python experiments/bench_decode.py                 # this config, runs/bench_decode
  python experiments/bench_decode.py --config.repeats=3 --config.batches='(1,)'

The model is the tiny LLaDA shape (d 64, 2 layers, vocab 96) with random weights and no stop
ids; the shapes are G = 64 with k = 16 and G = 256 with k = 32, at batch 1 and 8; D2F runs
at the reference thresholds (tau_add 0.1, tau_act 0.95, tau_conf 0.9) with no bound on the
blocks in flight.
"""

from ml_collections import config_dict


def get_config():
  c = config_dict.ConfigDict()
  c.seed = 0
  c.model = config_dict.ConfigDict(
      {"vocab_size": 96, "d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_dim": 192})
  c.shapes = ((64, 16), (256, 32))    # (G, k)
  c.batches = (1, 8)
  c.min_prompt_len = 8
  c.max_prompt_len = 24
  c.methods = ("d2f", "ar", "llada", "fast_dllm")
  c.d2f_taus = (("tau_add", 0.1), ("tau_act", 0.95), ("tau_conf", 0.9))
  c.fast_dllm_threshold = 0.9
  c.repeats = 5
  return c
