"""The published claims the study judges (`verdict.judge`): each one's method, baseline,
thresholds and the published figure it stands for. Data only; the rule is verdict.py's."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Claim:
  """One published claim: `method` at >= `speedup` x the `baseline`'s tokens/s, with accuracy
  at most `tolerance_points` below it (0 with `exact`: the same number of correct answers).

  `accuracy_on`: "task" (the headline task) or "all" (every prompt: the mixed suite);
  `speed_on`: the same choice for tokens/s, forwards and tokens per verifier forward (None:
  as accuracy_on).
  `tokens_per_verifier_forward`: the lossless-hybrid bar on response tokens per AR-verifier
  forward. `premise_d2f_loss_points`: adaptive switching is judged only where the most accurate
  D2F cell loses more than this to AR. `exclude_drafters`: cells whose setting's "drafter"
  is one of these are not the method the claim is about (and are not judged).
  """
  id: str
  text: str
  method: str
  baseline: str  # "ar", "llada" or "selfspec_ar" (the self-speculative model's AR decode)
  speedup: float
  tolerance_points: float
  published: str
  accuracy_on: str = "task"
  speed_on: str | None = None
  strict_speedup: bool = False  # "faster than": speedup > threshold, not >=
  exact: bool = False
  tokens_per_verifier_forward: float | None = None
  premise_d2f_loss_points: float | None = None
  exclude_drafters: tuple[str, ...] = ()

  def threshold(self) -> dict:
    out = {"speedup": self.speedup, "speedup_strict": self.strict_speedup,
           "accuracy_tolerance_points": self.tolerance_points, "exact_accuracy": self.exact}
    if self.tokens_per_verifier_forward is not None:
      out["tokens_per_verifier_forward"] = self.tokens_per_verifier_forward
    if self.premise_d2f_loss_points is not None:
      out["premise_d2f_loss_points"] = self.premise_d2f_loss_points
    return out


CLAIMS = (
    Claim("d2f_vs_ar", "D2F >= 2.5x AR tokens/s within 2 accuracy points of AR", "d2f", "ar",
          2.5, 2.0, "D2F-LLaDA block 32: 119.9 tok/s vs LLaMA3-8B-Instruct 48.0 (GSM8K, "
          "A100, batch 1)"),
    Claim("d2f_vs_llada_10x", "D2F >= 10x vanilla LLaDA tokens/s at the same G, within 2 "
          "points", "d2f", "llada", 10.0, 2.0,
          "GSM8K, A100, batch 1: D2F-LLaDA 52.5 vs LLaDA 7.2 tok/s (7.3x); D2F-Dream 91.2 vs "
          "Dream 9.5 (9.6x)"),
    Claim("d2f_vs_llada_50x", "D2F >= 50x vanilla LLaDA tokens/s at the same G, within 2 "
          "points", "d2f", "llada", 50.0, 2.0,
          "MBPP on LLaDA-8B, long generations (256-512 tokens), A100, batch 1: 47.6 vs 0.9 "
          "tok/s (52.9x)"),
    Claim("fast_dllm_vs_llada", "Fast-dLLM >= 27.6x vanilla LLaDA tokens/s at the same G, "
          "within 2 points", "fast_dllm", "llada", 27.6, 2.0,
          "LLaDA GSM8K, A100, batch 1: 27.6x at length 1024 (8.1x at length 256, 79.3 -> "
          "78.5 accuracy)"),
    Claim("lossless_hybrid", "Speculative (diffusion drafter, AR verifier): AR's accuracy exactly, "
          ">= 5 response tokens per AR-verifier forward, >= 1.2x AR tokens/s", "speculative",
          "ar", 1.2, 0.0, "DFlash: 6.2x lossless on Qwen3-8B; TiDAR 4.71-5.91x over AR (H100, "
          "batch 1)", accuracy_on="all", speed_on="task", exact=True,
          tokens_per_verifier_forward=5.0,
          exclude_drafters=("ar",)),
    Claim("self_speculation", "Self-speculation (one network drafts in every forward and "
          "verifies the last draft in the same forward): its own AR decode's answers exactly, "
          ">= 2 response tokens per forward, faster than that AR decode", "selfspec",
          "selfspec_ar", 1.0, 0.0, "TiDAR: 4.71x (1.5B) and 5.91x (8B) tokens/s over AR, one "
          "H100, batch 1", accuracy_on="all", speed_on="task", exact=True,
          strict_speedup=True, tokens_per_verifier_forward=2.0),
    Claim("adaptive_switching", "Adaptive switching: within 1 point of AR accuracy on the "
          "mixed suite, where D2F alone loses > 5 points, and faster than AR", "adaptive", "ar",
          1.0, 1.0, "the hybrid issue's bar (no published anchor)", accuracy_on="all",
          strict_speedup=True, premise_d2f_loss_points=5.0),
)
