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
def _bad_counts(params):
  """Per-leaf count of non-finite entries (one device reduction per leaf, one transfer)."""
  return jax.tree.map(
      lambda x: jnp.sum(~jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
      else jnp.zeros((), jnp.int32), params)


def check_finite(params, source: str = "params") -> None:
  """Raises NonFiniteParamsError naming every tensor of `params` that holds NaN or inf.

  Args:
    params: a params pytree (NumPy or jax arrays, sharded or not).
    source: where the params came from (a path), for the message.
  """
  counts = jax.device_get(_bad_counts(params))
  bad = [(_path_name(p), int(c), int(np.size(x))) for (p, c), x in zip(
      jax.tree_util.tree_flatten_with_path(counts)[0], jax.tree.leaves(params)) if int(c)]
  if bad:
    listed = ", ".join(f"{name} ({count} of {size} entries)" for name, count, size in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise NonFiniteParamsError(
        f"{source}: non-finite weights (NaN or inf) in {listed}{more}; the checkpoint is "
        "damaged or was saved from a diverged run: load an earlier step or re-convert it.")
