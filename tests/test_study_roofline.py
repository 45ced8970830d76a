"""The weight-streaming bound: byte counts, bandwidth lookup and the bound's arithmetic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from studylib import roofline


def test_param_bytes_counts_every_leaf_at_its_dtype():
  tree = {"a": jnp.zeros((3, 4), jnp.float32), "b": {"c": jnp.zeros((5,), jnp.bfloat16)},
          "d": np.zeros((2, 2), np.int8)}
  assert roofline.param_bytes(tree) == 3 * 4 * 4 + 5 * 2 + 4


@pytest.mark.parametrize("kind,gbps", [
    ("NVIDIA H200", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0),
    ("NVIDIA A100-SXM4-80GB", 2039.0), ("NVIDIA A100-SXM4-40GB", 1555.0),
    ("TPU v5 lite", 819.0), ("TPU v5p", 2765.0), ("TPU v4", 1200.0), ("NVIDIA L4", 300.0),
    ("cpu", None), ("Some Future Chip", None),
])
def test_nominal_bandwidth_lookup_prefers_the_most_specific_name(kind, gbps):
  assert roofline.nominal_bandwidth_gbps(kind) == gbps


def test_memory_bandwidth_sources():
  assert roofline.memory_bandwidth(123.0) == {"gbps": 123.0, "source": "config"}
  with pytest.raises(ValueError, match="memory_bandwidth_gbps"):
    roofline.memory_bandwidth(-1.0)
  cpu = roofline.memory_bandwidth(0.0, jax.devices("cpu")[0])
  assert cpu["source"].startswith("measured") and 0.1 < cpu["gbps"] < 10_000

  class FakeTPU:
    platform, device_kind = "tpu", "TPU v4"
  assert roofline.memory_bandwidth(0.0, FakeTPU())["gbps"] == 1200.0

  class Unknown:
    platform, device_kind = "gpu", "Mystery GPU"
  with pytest.raises(ValueError, match="set memory_bandwidth_gbps"):
    roofline.memory_bandwidth(0.0, Unknown())


def test_ar_bound_arithmetic():
  # 2 GB of bf16 weights (a 1B model) at 4800 GB/s: 0.4167 ms a step, 2400 forwards/s.
  out = roofline.ar_bound(2_000_000_000, 4800.0, step_s=0.5e-3)
  assert out["weight_read_s"] == pytest.approx(2e9 / 4.8e12)
  assert out["bound_tokens_per_s"] == pytest.approx(2400.0)
  assert out["fraction_of_bound"] == pytest.approx((2e9 / 4.8e12) / 0.5e-3)
  assert roofline.ar_bound(100, 1.0, step_s=1.0, batch=8)["bound_tokens_per_s"] == \
      pytest.approx(8 / 1e-7)
  with pytest.raises(ValueError, match="positive"):
    roofline.ar_bound(0, 1.0, step_s=1.0)
