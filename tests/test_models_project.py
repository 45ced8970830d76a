"""`Transformer(head=False)` + `project` gives the logits `head=True` gives, at any slots."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.models import Transformer, get_preset, init_cache, init_params
from dllm_jax.models import transformer as model_lib


@pytest.mark.parametrize("tied,active", [(False, None), (True, 40)])
def test_project_equals_the_head(tied, active):
  cfg = get_preset("tiny").replace(tie_embeddings=tied, active_vocab_size=active)
  params = init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 4, cfg.vocab_size)
  ids = jnp.zeros((2, 10), jnp.int32)
  model = Transformer(cfg)
  logits, cache = model.apply({"params": params}, tokens, block_ids=ids,
                              cache=init_cache(cfg, 2, 16), write_len=6)
  hidden, cache2 = model.apply({"params": params}, tokens, block_ids=ids,
                               cache=init_cache(cfg, 2, 16), write_len=6, head=False)
  assert hidden.shape == (2, 10, cfg.d_model)
  np.testing.assert_allclose(model_lib.project(params, cfg, hidden), logits, rtol=1e-6,
                             atol=1e-6)
  at = jnp.array([[9, 0, 4], [3, 3, 7]])
  np.testing.assert_allclose(model_lib.project(params, cfg, hidden, at),
                             jnp.take_along_axis(logits, at[..., None], axis=1), rtol=1e-6,
                             atol=1e-6)
  for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(cache2)):
    np.testing.assert_array_equal(a, b)
