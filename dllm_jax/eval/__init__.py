"""dllm_jax under lm-evaluation-harness: importing this package registers the model
`dllm_jax` with lm-eval (>= 0.4, the `eval` extra).

    python -m dllm_jax.eval --model_args checkpoint=demo,method=d2f --tasks gsm8k

    import dllm_jax.eval, lm_eval
    lm_eval.simple_evaluate(model="dllm_jax", model_args="checkpoint=demo,method=llada",
                            tasks=["gsm8k"])

Modules: `args` (the model args, read without JAX), `harness` (the lm-eval model),
`likelihood` (exact AR log-likelihoods and LLaDA's Monte-Carlo ELBO, jitted), `speed` (the
decode speed the results JSON carries). docs/evaluation.md describes the estimator and how
speed is counted.
"""

from dllm_jax import _extras

_extras.require("dllm_jax.eval", "eval", {"lm_eval": "lm-evaluation-harness"})

from dllm_jax.eval.args import EvalArgs, parse_model_args
from dllm_jax.eval.harness import DllmJaxLM

__all__ = ["DllmJaxLM", "EvalArgs", "parse_model_args"]
