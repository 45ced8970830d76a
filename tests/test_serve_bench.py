"""The serving benchmark's hybrid cells: the engine and static batching give the same tokens.

`studylib.serve_bench.run` on a few requests of its mixed workload (short sums and long worked
additions, character-tokenized, each with its own seed and answer budget) for the three
round-based hybrids; every cell records whether the engine's outputs equal static
batching's (`outputs_equal`), here for adaptive with a task tag per request (the tags map
short sums to AR and leave long additions to the rule). AR and D2F run in the README test
(`python experiments/serve_bench.py`).
"""

import importlib.util
import json
import os

from studylib import serve_bench

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "serve_bench.py")


def serve_bench_config():
  spec = importlib.util.spec_from_file_location("serve_bench_config", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_hybrid_cells_serve_what_static_batching_decodes(tmp_path):
  config = serve_bench_config()
  config.num_requests, config.concurrency = 6, (2,)
  config.gen_length, config.max_prompt_len = 16, 16
  config.methods = serve_bench.HYBRIDS
  report = serve_bench.run(config, str(tmp_path))
  cells = {cell["method"]: cell for cell in report["cells"]}
  assert sorted(cells) == sorted(serve_bench.HYBRIDS)
  for method, cell in cells.items():
    assert cell["outputs_equal"], method
    assert cell["engine"]["nfe_mean"] > 0 and cell["static"]["throughput"] > 0, cell
  saved = json.loads((tmp_path / "serve_bench.json").read_text())
  assert [c["outputs_equal"] for c in saved["cells"]] == [True] * 3
  assert "| adaptive | 2 | engine |" in (tmp_path / "serve_bench.md").read_text()


def test_http_bench_ratio_interval_is_the_bootstrap_of_the_median():
  """`serve_http_bench.median_interval`: the median of the paired ratios and the percentile
  interval of the medians of resamples (restated here with the same draws)."""
  import numpy as np
  from studylib import serve_http_bench
  ratios = [0.8, 1.1, 0.95, 0.9, 1.3]
  median, low, high = serve_http_bench.median_interval(ratios, resamples=500, seed=3)
  draws = np.random.default_rng(3).choice(np.asarray(ratios), (500, 5))
  want = np.percentile(np.median(draws, axis=1), [2.5, 97.5])
  assert median == 0.95 and (low, high) == tuple(want)
  assert min(ratios) <= low <= median <= high <= max(ratios)
  assert serve_http_bench.median_interval([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
