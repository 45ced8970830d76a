"""The decoding methods by name, without importing JAX.

The command line checks `--method` and prints its `--help` from these before JAX loads (a
typo is reported in well under a second, not after the ~5-10 s import of JAX and flax).
`api.METHODS` maps each name to its decoder; tests/test_generate_cli.py checks the two agree.
"""

# Every method `decoding.generate` accepts, in api.METHODS' order.
METHOD_NAMES = ("ar", "llada", "dream", "fast_dllm", "d2f", "block_diffusion", "speculative",
                "selfspec", "adaptive")

# The methods that draft with a second model (they take drafter_params / drafter_cfg).
DRAFTER_METHODS = ("speculative", "adaptive")

# The methods that rank confidences and so take the `batch_invariant` option (the command
# line's --batch_invariant flag); ar and selfspec never rank.
RANKING_METHODS = ("llada", "dream", "fast_dllm", "d2f", "block_diffusion", "speculative",
                   "adaptive")
