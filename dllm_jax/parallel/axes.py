"""Mesh axis names and the default logical-axis rules, as plain data.

Kept apart from `mesh.py` so that configs (`training.config`) name them without importing JAX;
`mesh.MESH_AXES`, `mesh.DEFAULT_RULES` and `mesh.rules_from_config` are these.
"""

from __future__ import annotations

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or None: replicated). Batch is split over data *and* fsdp
# (FSDP shards parameters along `embed` and gathers them per layer).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("cache_len", None),
    ("head_dim", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
    ("norm", None),
    ("lora", None),
)


def rules_from_config(rules) -> tuple:
  """Accepts a list of [logical, mesh] pairs (from ml_collections) or None (defaults)."""
  if rules is None:
    return DEFAULT_RULES
  out = []
  for pair in rules:
    logical, physical = pair
    if isinstance(physical, list):
      physical = tuple(physical)
    if physical is not None:
      for axis in (physical if isinstance(physical, tuple) else (physical,)):
        if axis not in MESH_AXES:
          raise ValueError(f"rule {pair!r} names unknown mesh axis {axis!r}; use {MESH_AXES}.")
    out.append((logical, physical))
  return tuple(out)
