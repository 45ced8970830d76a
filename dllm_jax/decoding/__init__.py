"""Decoders for autoregressive and masked-diffusion LMs behind one `generate` entry point.

  generate(params, cfg, prompts, method=<a registry name; default "d2f">, rng=None,
           mesh=None, **options) -> DecodeOutput
  stream(params, cfg, prompts, method=..., rng=None, **options) -> Iterator[StreamEvent]

Option vocabulary (one name and one default per concept; `api.option_names(method)`):

  option          default           methods              traced?  meaning
  gen_length      128               all                  static   response slots G
  block_length    32, capped at G   all but ar, hybrids  static   slots per block (divides G)
  temperature     0.0 (greedy)      all                  traced   token sampling temperature
                                                         (hybrids: static)
  early_stop      True              ar, llada, dream,    static   stop rows whose answer is
                                    fast_dllm, hybrids            final (output unchanged)
  on_nonfinite    "raise"           all                  host     "raise" NonFiniteLogitsError
                                                                  or "flag" the rows
  top_k, top_p    0, 1.0            ar, hybrids          traced   filtering before sampling
                                                         (hybrids: static)
  draft_length    4 (selfspec 3)    hybrids              static   tokens drafted per round
  drafter_params, drafter_cfg       speculative,         -        the drafting model (same
                                    adaptive                      tokenizer as the target)
  drafter         "d2f"             speculative          static   "ar", "d2f", "block_diffusion",
                                                                  "selfspec"
  steps           gen_length        llada, dream         static   forwards in total
  remasking       "low_confidence"  llada (dream:        static   confidence ranking
                  "entropy")
  alg_temp        0.0               llada, dream         traced   Dream's order temperature
  cfg_scale       0.0 (off)         llada, dream         traced*  guidance scale (*on/off is
                                                                  static: CFG doubles the batch)
  logits_eos_inf, confidence_eos_eot_inf   llada, dream  static   LLaDA's EOS handling
  rule            "threshold"       fast_dllm            static   "threshold" or "factor"
  threshold       0.9               fast_dllm            traced   commit probability bound
  factor          1.0               fast_dllm            traced   factor rule's f
  cache           "none"            fast_dllm            static   "none", "prefix", "dual"
  tau_add, tau_act, tau_conf  0.1, 0.95, 0.9   d2f       traced   D2F block thresholds
  max_active_blocks  None (no bound)  d2f                static   blocks in flight
  steps_per_block block_length      block_diffusion      static   forwards per block
  unmasking       "even"            llada, dream,        static   tokens committed per step:
                                    block_diffusion               "even" (LLaDA's split),
                                                                  "cosine" (MaskGIT),
                                                                  "entropy_bound" (adaptive)
  entropy_bound   0.1               llada, dream,        traced   the entropy_bound rule's
                                    block_diffusion               bound in nats (>= 0)
  remasking       "probability"     d2f, block_diffusion static   confidence ranking
  use_cache       True              d2f, block_diffusion static   exact K/V cache
  batch_invariant False             llada, dream,        static   rank confidences on a
                                    fast_dllm, d2f,               2^-12 grid (a row alone ==
                                    block_diffusion,              in a batch == on a mesh);
                                    speculative,                  False: exact float32 order,
                                    adaptive                      ties to the lowest slot, as
                                                                  the references rank (the
                                                                  serving engine forces True)

unmasking (`decoding.unmasking` states each rule exactly): even commits k // s per step of a
block of k slots and s steps, plus one for the first k % s steps; cosine commits the
differences of M_j = min(floor(k cos(pi/2 (j+1)/s)), M_{j-1} - 1) (slots still masked after
step j; equal to even at s = k); entropy_bound commits, in the ranking's order, the longest
prefix of masked slots whose entropies sum, less their largest, to at most entropy_bound (at
least one): steps are dynamic, `steps` / `steps_per_block` stay unset, and nfe counts the
forwards run.

remasking takes the same names in every diffusion method: LLaDA's "low_confidence" /
"random", Dream's "maskgit_plus" / "topk_margin" / "entropy" / "origin", and "probability" /
"margin" (`llada.REMASKING`).

batch_invariant (`sampling` module docstring): by default every ranking compares the exact
float32 confidences, ties to the lowest slot, as the reference decoders do, so a row commits
the slots their `generate` commits. A forward's float noise depends on the batch size and
the mesh, so a near-tie may then rank differently for a row alone, in a batch (another batch
bucket) or on a mesh; batch_invariant=True ranks on a 2^-12 grid instead and a row's tokens
are the same in all three (docs/design.md, "Ranking: reference order vs batch invariance").
In the hybrids only a diffusion drafter with more than one forward per draft ranks; ar and
selfspec never rank and take no such option.

Traced options are data, not compile keys: sweeping them never recompiles. Every method
checks prompt + gen_length <= max_seq_len with one check (`base.check_window`) whose message
names the largest gen_length that fits; NaN (and inf where meaningless) options are a
ValueError naming the option. The old D2F name `block_size` is a ValueError saying to use
`block_length`.

The hybrids are "speculative", "selfspec" and "adaptive" (their block is the draft); they
stream one event per round (drafter forwards + one verifying forward).

Every `DecodeOutput` carries `finite` [B]: False for a row whose logits were ever NaN/inf;
such a row's tokens are pad and its length 0, and `generate` / `stream` raise
`NonFiniteLogitsError` naming it unless on_nonfinite="flag".
"""

from __future__ import annotations

from dllm_jax import _lazy

# The package loads its modules on first use (PEP 562): `adaptive_rule`, which a config file
# reads, and `registry`, which the command line reads, import no JAX. Every module is also
# an attribute (`decoding.api`, `decoding.sampling`).
_EXPORTS = {
    "generate": "api", "option_names": "api",
    "Decoder": "protocol", "Plan": "protocol",
    "DEFAULT_METHOD": "registry", "register": "registry",
    "AROptions": "ar", "ar_generate": "ar",
    "DecodeOutput": "base", "NonFiniteLogitsError": "base", "pad_prompts": "base",
    "block_diffusion_generate": "d2f", "d2f_generate": "d2f",
    "FastDLLMOptions": "fast_dllm", "fast_dllm_generate": "fast_dllm",
    "LLaDAOptions": "llada", "dream_generate": "llada", "llada_generate": "llada",
    "StreamEvent": "streaming", "stream": "streaming",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy.attach(__name__, _EXPORTS, submodules=True)
