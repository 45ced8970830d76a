"""Data-parallel decode benchmark: shard_map (one loop per data shard) vs SPMD (one loop over
the batch) on 8 fake CPU devices, one long row and seven short ones
(see `studylib.dp_bench`).

  python experiments/bench_data_parallel.py
  python experiments/bench_data_parallel.py --config.repeats=3 --config.methods='("ar",)'
"""

from ml_collections import config_dict


def get_config():
  c = config_dict.ConfigDict()
  c.seed = 0
  c.preset = "tiny"
  c.gen_length = 64
  c.temperature = 0.0
  c.methods = ("ar", "d2f", "llada", "fast_dllm")
  c.uneven_method = "ar"   # whose greedy answers pick the EOS that makes one row long
  c.options = config_dict.ConfigDict({
      "d2f": {"block_length": 8},
      "llada": {"block_length": 8},
      "fast_dllm": {"block_length": 8, "cache": "dual"},
  })
  c.repeats = 5
  return c
