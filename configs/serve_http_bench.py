"""HTTP serving benchmark: the OpenAI-compatible server (`dllm_jax.serve`) driven by the
official async openai client, against the in-process engine on the same requests (see
`studylib.serve_http_bench`).

  python experiments/serve_http_bench.py                     # runs/serve_http_bench
  python experiments/serve_http_bench.py --config.concurrency='(1,16,64)' --config.repeats=7
  python experiments/serve_http_bench.py --config.preset=tiny --config.num_requests=96

Workload and model: those of the serving benchmark (configs/serve_bench.py: the mixed
synthetic suite, short sums and long worked additions, each request with its own answer
budget and seed; peaked random weights), character-tokenized, on `base_100m` (83M
parameters): the HTTP layer costs a fixed few milliseconds of CPU per request (server and
client, which share the host), so its share depends on the decode's; the tiny preset
(a few ms a request) shows that cost at its largest. Each (method, concurrency) cell serves
every request through an engine of `concurrency` slots, in process and over HTTP (all
requests sent at once, streamed), `repeats` times each, interleaved; the ratio is the median
of the paired ratios with a bootstrap interval. The default (d2f and ar at concurrency 16,
32 requests, 3 repeats) takes about 4 minutes on a 2-core CPU host.
"""

from ml_collections import config_dict


def get_config():
  c = config_dict.ConfigDict()
  c.seed = 0
  c.preset = "base_100m"
  c.peak = 20.0
  c.eos_scale = 1.0
  c.temperature = 1.0
  c.tasks = "arithmetic:1,arithmetic:2,long_addition:3,long_addition:5"
  c.num_requests = 32
  c.concurrency = (16,)
  c.methods = ("d2f", "ar")
  c.repeats = 3  # interleaved engine / http passes per cell
  c.gen_length = 64
  c.block_length = 8
  c.max_prompt_len = 32
  c.max_steps_per_run = 16
  c.d2f_taus = (("tau_add", 0.1), ("tau_act", 0.95), ("tau_conf", 0.9))
  c.d2f_max_active_blocks = 2
  c.draft_length = 4
  c.adaptive_task_modes = (("arithmetic", "ar"), ("long_addition", "auto"))
  c.timeout = 600.0  # seconds a cell's HTTP run may take
  return c
