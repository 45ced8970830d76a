"""Data: tokenizers, synthetic reasoning tasks, TFDS array_record builders and batch pipelines.

Everything is importable from here. The TFDS builders (`prepare`, `load_source`, ...) load
lazily, so code that only needs tokenizers, tasks or the pipeline never imports TFDS.
"""

from dllm_jax.data.layouts import PackedLayout, SFTLayout, TooLongError, left_pad_positions
from dllm_jax.data.pipeline import BatchIterator, Prefetcher, eval_batches
from dllm_jax.data.sources import SyntheticSource, TextSource, record_to_example
from dllm_jax.data.tasks import (TASK_ALPHABET, TASKS, Example, Task, TaskSpec, TaskSuite,
                                 extract_final, get_task, split_of)
from dllm_jax.data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer

_LAZY = {"prepare", "load_source", "name_of", "SyntheticReasoning", "SyntheticReasoningConfig",
         "LocalText", "LocalTextConfig"}


def __getattr__(name):
  if name in _LAZY:
    from dllm_jax.data import builders
    return getattr(builders, name)
  raise AttributeError(f"module 'dllm_jax.data' has no attribute {name!r}")


__all__ = ["BatchIterator", "ByteTokenizer", "CharTokenizer", "Example", "HFTokenizer",
           "PackedLayout", "Prefetcher", "SFTLayout", "SyntheticSource", "TASKS",
           "TASK_ALPHABET", "Task", "TaskSpec", "TaskSuite", "TextSource", "Tokenizer",
           "TooLongError", "eval_batches", "extract_final", "get_task", "left_pad_positions",
           "record_to_example", "split_of", *sorted(_LAZY)]
