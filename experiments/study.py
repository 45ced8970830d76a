"""The speed-versus-quality study: train (or load) AR, MDM and D2F models, decode the same
held-out prompts with every decoder, and write a table, a JSON file and a Pareto plot.

  python experiments/study.py [--config configs/study.py[:full]] [--workdir runs/study]

Rerunning reuses the trained models cached (as orbax checkpoints) under the workdir.
"""

from absl import app, flags
from ml_collections import config_flags

from dllm_jax.study import study

_CONFIG = config_flags.DEFINE_config_file("config", "configs/study.py", "Study config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/study", "Where models and reports go.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  study.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
