"""The weight-streaming bound of batch-1 decoding: how fast AR could possibly go here.

At batch 1 an AR step reads every weight once to produce one token, so on any device

    t_step >= param_bytes / memory_bandwidth       (the *weight-read time*)
    AR tokens/s <= memory_bandwidth / param_bytes  (the *bound*)

A parallel decoder reads the same weights once per forward but may commit several tokens, so
where decoding sits at this bound, a forward over a window costs about one AR step and the
speedup tends to the ratio of forward counts. Where it does not (a CPU running a tiny model
that fits in cache, which is compute- or overhead-bound), a window costs more than an AR step.
`fraction_of_bound` = bound time / measured step time says which regime a run is in.

Bandwidth: the nominal peak of known accelerators (vendor spec sheets, per chip), or, on a
CPU, a measured streaming copy (`measure_copy_bandwidth`); a config value overrides both.
"""

from __future__ import annotations

import time

import jax
import numpy as np

# device_kind substring -> nominal peak memory bandwidth in GB/s (1e9 bytes/s), per chip.
# Most specific first: the first substring found in `device_kind` wins.
NOMINAL_BANDWIDTH_GBPS = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100-PCIE-80GB", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("V100", 900.0),
    ("T4", 320.0),
    ("TPU v6 lite", 1640.0),
    ("TPU v5 lite", 819.0),
    ("TPU v5p", 2765.0),
    ("TPU v5", 2765.0),
    ("TPU v4", 1200.0),
    ("TPU v3", 900.0),
)


def nominal_bandwidth_gbps(device_kind: str) -> float | None:
  """The spec-sheet bandwidth of a known accelerator, else None."""
  for key, gbps in NOMINAL_BANDWIDTH_GBPS:
    if key.lower() in device_kind.lower():
      return gbps
  return None


def measure_copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
  """Host memory bandwidth in GB/s from the best of `repeats` copies of `nbytes` (a copy
  reads and writes every byte, so it moves 2 * nbytes)."""
  src = np.ones(nbytes // 8, np.float64)
  dst = np.empty_like(src)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - t0)
  return 2 * src.nbytes / best / 1e9


def memory_bandwidth(override_gbps: float = 0.0, device=None) -> dict:
  """{"gbps": ..., "source": "config" | "nominal" | "measured copy"} for `device` (default:
  the first device). `override_gbps` > 0 wins."""
  if override_gbps < 0:
    raise ValueError(f"memory_bandwidth_gbps must be >= 0 (0 = look up or measure), "
                     f"got {override_gbps}.")
  if override_gbps > 0:
    return {"gbps": float(override_gbps), "source": "config"}
  device = device or jax.devices()[0]
  nominal = nominal_bandwidth_gbps(device.device_kind)
  if nominal is not None:
    return {"gbps": nominal, "source": f"nominal peak of {device.device_kind}"}
  if device.platform != "cpu":
    raise ValueError(f"no known memory bandwidth for device {device.device_kind!r}; set "
                     "memory_bandwidth_gbps in the config to its spec-sheet value.")
  return {"gbps": measure_copy_bandwidth(), "source": "measured host copy (numpy)"}


def param_bytes(params) -> int:
  """Bytes of every array in a params tree (what one forward must read)."""
  return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                 for x in jax.tree.leaves(params)))


def ar_bound(nbytes: int, bandwidth_gbps: float, *, step_s: float, batch: int = 1) -> dict:
  """The weight-streaming bound of an AR decode measured at `step_s` seconds per forward.

  Returns weight_read_s (bytes / bandwidth), bound_tokens_per_s (batch rows per
  weight_read_s) and fraction_of_bound (weight_read_s / step_s: 1.0 means at the bound).
  """
  if nbytes <= 0 or bandwidth_gbps <= 0 or step_s <= 0:
    raise ValueError(f"need positive bytes, bandwidth and step time, got {nbytes}, "
                     f"{bandwidth_gbps}, {step_s}.")
  read_s = nbytes / (bandwidth_gbps * 1e9)
  return {"param_bytes": int(nbytes), "bandwidth_gbps": float(bandwidth_gbps),
          "weight_read_s": read_s, "bound_tokens_per_s": batch / read_s,
          "measured_step_s": float(step_s), "fraction_of_bound": read_s / step_s}
