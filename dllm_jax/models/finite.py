"""A finite check of a params tree: a NaN/inf weight is named at load, never decoded.

One NaN in one q kernel makes every decoder propose token 0 (or the mask id) with full
lengths: a silent wrong answer. Loaders call `check_finite` once, so the error names the
tensor and the file it came from instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class NonFiniteParamsError(ValueError):
  """A parameter tensor holds NaN or inf."""


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                  for k in path)


@jax.jit
def _all_finite(x):
  """[] bool: no NaN/inf in `x` (one fused reduction, no array-sized temporary)."""
  return jnp.all(jnp.isfinite(x))


@jax.jit
def _bad_count(x):
  return jnp.sum(~jnp.isfinite(x), dtype=jnp.int32)


def check_finite(params, source: str = "params") -> None:
  """Raises NonFiniteParamsError naming every tensor of `params` that holds NaN or inf.

  Args:
    params: a params pytree (NumPy or jax arrays, sharded or not).
    source: where the params came from (a path), for the message.
  """
  # Leaf by leaf: one tree-wide program would hold temporaries for every leaf at once (a
  # second model's worth of memory during a load); a leaf at a time holds none.
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  inexact = [(p, x) for p, x in leaves if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  flags = jax.device_get([_all_finite(x) for _, x in inexact])
  bad = [(_path_name(p), int(_bad_count(x)), int(np.size(x)))
         for (p, x), ok in zip(inexact, flags) if not ok]
  if bad:
    listed = ", ".join(f"{name} ({count} of {size} entries)" for name, count, size in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise NonFiniteParamsError(
        f"{source}: non-finite weights (NaN or inf) in {listed}{more}; the checkpoint is "
        "damaged or was saved from a diverged run: load an earlier step or re-convert it.")
