"""From `config.data` to global device batches.

Shape legend: B global batch, B_p = B / process_count rows made by this process, L length.

Each process reads its own shard of the records (`BatchIterator` strides the epoch
permutation by `jax.process_index()`), builds a numpy batch of B_p rows, and
`jax.make_array_from_process_local_data` assembles the global [B, L] array sharded over the
mesh's batch axes. On one host this is a plain `device_put` with a sharding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from dllm_jax.data.layouts import SFTLayout
from dllm_jax.data.pipeline import BatchIterator
from dllm_jax.data.sources import SyntheticSource
from dllm_jax.data.tasks import TASK_ALPHABET, TaskSuite
from dllm_jax.data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer
from dllm_jax.diffusion.layout import BATCH_KEYS
from dllm_jax.models.config import ModelConfig
from dllm_jax.parallel import mesh as mesh_lib


def make_tokenizer(data_cfg) -> Tokenizer:
  """"char" (one id per TASK_ALPHABET symbol), "byte", or a path to a tokenizer.json."""
  name = data_cfg.tokenizer
  if name == "char":
    return CharTokenizer(TASK_ALPHABET)
  if name == "byte":
    return ByteTokenizer()
  if os.path.exists(name):
    return HFTokenizer.from_file(name)
  raise ValueError(f"data.tokenizer={name!r} is neither 'char', 'byte' nor an existing "
                   "tokenizer.json path.")


def make_suite(data_cfg) -> TaskSuite:
  return TaskSuite.parse(data_cfg.tasks, test_fraction=float(data_cfg.test_fraction))


def make_layout(data_cfg, tokenizer: Tokenizer) -> SFTLayout:
  """A prompt/answer layout every example of the mixture fits: an answer region (G) of
  `data.gen_length` slots when set, else the longest answer rounded up to `data.block_size`."""
  return SFTLayout.for_suite(tokenizer, make_suite(data_cfg),
                             fixed_prompt=bool(data_cfg.fixed_prompt),
                             block_size=data_cfg.block_size,
                             gen_length=data_cfg.get("gen_length"), pad=data_cfg.pad)


def check_compatible(model_cfg: ModelConfig, tokenizer: Tokenizer, layout: SFTLayout) -> None:
  """The model must cover the tokenizer's ids, agree on special ids and fit the rows."""
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                     f"{model_cfg.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}.")
  for name, model_id, tok_id in (("mask_token_id", model_cfg.mask_token_id, tokenizer.mask_id),
                                 ("eos_token_id", model_cfg.eos_token_id, tokenizer.eos_id),
                                 ("pad_token_id", model_cfg.pad_token_id, tokenizer.pad_id)):
    if model_id is not None and model_id != tok_id:
      raise ValueError(f"model.{name}={model_id} but the tokenizer uses {tok_id}; set "
                       f"model.{name}={tok_id}.")
  if layout.seq_len > model_cfg.max_seq_len:
    raise ValueError(f"rows of data.tasks are {layout.seq_len} tokens but model.max_seq_len="
                     f"{model_cfg.max_seq_len}; raise model.max_seq_len or lower the difficulty.")


def make_sources(data_cfg):
  """(train source, eval source) of prompt/answer records."""
  if data_cfg.source == "synthetic":
    suite = make_suite(data_cfg)
    return (SyntheticSource(suite, int(data_cfg.train_size), int(data_cfg.seed), "train"),
            SyntheticSource(suite, int(data_cfg.eval_size), int(data_cfg.seed), "test",
                            unique=True))
  from dllm_jax.data import builders  # imports tensorflow_datasets: only when asked for
  if not data_cfg.data_dir:
    raise ValueError("data.source='tfds' needs data.data_dir (where builders.prepare wrote "
                     "the array_record files).")
  name = builders.name_of(builders.prepare(
      "synthetic_reasoning", data_cfg.data_dir, tasks=data_cfg.tasks,
      num_train=int(data_cfg.train_size), num_test=int(data_cfg.eval_size),
      seed=int(data_cfg.seed), test_fraction=float(data_cfg.test_fraction)))
  return (builders.load_source(name, "train", data_cfg.data_dir),
          builders.load_source(name, "test", data_cfg.data_dir))


def local_batch_size(global_batch: int) -> int:
  count = jax.process_count()
  if global_batch % count:
    raise ValueError(f"train.batch_size={global_batch} must be divisible by the number of "
                     f"processes ({count}).")
  return global_batch // count


def train_iterator(source, layout: SFTLayout, global_batch: int, seed: int) -> BatchIterator:
  """Endless shuffled batches of this process's shard."""
  return BatchIterator(source, layout, batch_size=local_batch_size(global_batch), seed=seed)


def eval_iterator(source, layout: SFTLayout, global_batch: int) -> BatchIterator:
  """Full batches of the eval split in a fixed order, cycling (so every eval sees the same)."""
  return BatchIterator(source, layout, batch_size=local_batch_size(global_batch),
                       shuffle=False)


def batch_shardings(mesh: Mesh, rules, keys=tuple(BATCH_KEYS)) -> dict:
  """NamedSharding of every [B, L] batch array: rows over the batch axes."""
  return {k: mesh_lib.batch_sharding(mesh, 2, rules) for k in keys}


def to_global(local: Mapping[str, np.ndarray], shardings: Mapping) -> dict[str, jax.Array]:
  """This process's rows of the contract keys -> global arrays with `shardings`."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(local[k]))
          for k, sharding in shardings.items()}
