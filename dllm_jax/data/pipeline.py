"""Random-access source -> shuffled, sharded, resumable numpy batches.

Shape legend: B per-process batch size, L sequence length.

Each batch is a dict of numpy arrays: the row fields of `layouts.py`, stacked to `[B, L]`
(`tokens`, `positions`, `valid`, `segment_ids`, `prompt_mask`, `answer_mask`, `loss_mask`),
plus `index[B]` int32 (the source record of each row, the first document's for packed rows;
-1 on padding rows) and `row_mask[B]` bool (False only on the padding rows of a final eval
batch).

Order: epoch e visits `permutation(N)` drawn from `default_rng([seed, e])` (or 0..N-1 without
shuffle). Process p of n reads entries p, p + n, ... of the first n * (N // n) of them, so
processes see disjoint records and the same number of batches. Batches run on across epoch
boundaries; with `num_epochs` set, the stream ends after that many epochs.

Resuming: `get_state()` is a small JSON-serializable dict of ints (epoch, position in this
process's shard, token offset inside the current document for packed rows, plus the seed and
sizes it was made with). `set_state` on a fresh iterator over the same source continues with
exactly the batch that would have come next. States are per process: save one per process
(packed rows and `drop_long` make their positions differ) and restore each on its own process.
With `drop_long` and a finite `num_epochs`, processes may also end after different numbers of
batches.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np

from dllm_jax.data.layouts import (PackedLayout, Row, SFTLayout, Spans, TooLongError,
                                   empty_row, left_pad_positions)
from dllm_jax.data.sources import Source, SyntheticSource, TextSource

__all__ = ["BatchIterator", "Prefetcher", "eval_batches", "PackedLayout", "SFTLayout",
           "SyntheticSource", "TextSource", "TooLongError", "left_pad_positions"]

_STATE_VERSION = 1
_FIXED_STATE = ("num_records", "seed", "shuffle", "process_index", "process_count")


def _process_info(process_index: int | None, process_count: int | None) -> tuple[int, int]:
  if process_index is None or process_count is None:
    import jax  # only for the defaults, so the pipeline stays testable without devices
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, process_count="
                     f"{process_count})")
  return int(process_index), int(process_count)


class BatchIterator:
  """Yields `[B, L]` numpy batches of a source under an `SFTLayout` or a `PackedLayout`.

  Args:
    source: random access records (`SyntheticSource`, `load_source(...)`, any Sequence).
    layout: how records become rows.
    batch_size: rows per batch on this process.
    seed: shuffling seed (one permutation per epoch).
    shuffle: False reads records in order (eval).
    num_epochs: stop after this many passes; None repeats forever.
    process_index, process_count: this process's shard; default `jax.process_index()` /
      `jax.process_count()`.
    drop_long: skip SFT records that do not fit the layout instead of raising TooLongError.
    pad_final_batch: at the end of the stream emit the last partial batch, completed with
      padding rows (`row_mask` False), instead of dropping it.
  """

  def __init__(self, source: Source, layout: SFTLayout | PackedLayout, *, batch_size: int,
               seed: int = 0, shuffle: bool = True, num_epochs: int | None = None,
               process_index: int | None = None, process_count: int | None = None,
               drop_long: bool = False, pad_final_batch: bool = False):
    if not isinstance(layout, (SFTLayout, PackedLayout)):
      raise TypeError(f"layout must be an SFTLayout or a PackedLayout, got {type(layout)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if num_epochs is not None and num_epochs <= 0:
      raise ValueError(f"num_epochs must be positive or None, got {num_epochs}")
    self.source, self.layout, self.batch_size = source, layout, batch_size
    self.seed, self.shuffle, self.num_epochs = int(seed), bool(shuffle), num_epochs
    self.process_index, self.process_count = _process_info(process_index, process_count)
    self.drop_long, self.pad_final_batch = drop_long, pad_final_batch
    self.num_records = len(source)
    self.shard_size = self.num_records // self.process_count
    if self.shard_size == 0:
      raise ValueError(f"source has {self.num_records} records, fewer than process_count="
                       f"{self.process_count}: every process needs at least one")
    if isinstance(layout, SFTLayout) and self.shard_size < batch_size and not pad_final_batch:
      raise ValueError(f"each process reads {self.shard_size} records per epoch, fewer than "
                       f"batch_size={batch_size}; lower batch_size or use more records")
    self.dropped = 0  # records skipped by drop_long (not part of the state)
    self._epoch, self._position, self._offset = 0, 0, 0
    self._order_epoch, self._order = -1, np.empty(0, np.int64)
    self._doc: tuple[int, list[int]] | None = None  # (record index, tokens) for packing

  # -- position -------------------------------------------------------------------------------

  def _shard(self, epoch: int) -> np.ndarray:
    if self._order_epoch != epoch:
      n = self.shard_size * self.process_count
      order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_records)
               if self.shuffle else np.arange(self.num_records))
      self._order = order[:n][self.process_index::self.process_count]
      self._order_epoch = epoch
    return self._order

  def _exhausted(self) -> bool:
    return self.num_epochs is not None and self._epoch >= self.num_epochs

  def _peek(self) -> int | None:
    """The record index under the cursor, or None at the end of the stream."""
    if self._exhausted():
      return None
    return int(self._shard(self._epoch)[self._position])

  def _advance(self) -> None:
    self._position, self._offset, self._doc = self._position + 1, 0, None
    if self._position == self.shard_size:
      self._epoch, self._position = self._epoch + 1, 0

  def get_state(self) -> dict[str, int]:
    """Where the next batch starts: a JSON-serializable dict of ints."""
    return {"version": _STATE_VERSION, "epoch": self._epoch, "position": self._position,
            "offset": self._offset, "num_records": self.num_records, "seed": self.seed,
            "shuffle": int(self.shuffle), "process_index": self.process_index,
            "process_count": self.process_count}

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from a `get_state()` of an iterator over the same source and settings."""
    missing = {"version", "epoch", "position", "offset", *_FIXED_STATE} - set(state)
    if missing:
      raise ValueError(f"iterator state lacks {sorted(missing)}; pass a dict from get_state()")
    if state["version"] != _STATE_VERSION:
      raise ValueError(f"iterator state version {state['version']} != {_STATE_VERSION}")
    mine = self.get_state()
    for key in _FIXED_STATE:
      if int(state[key]) != mine[key]:
        raise ValueError(f"iterator state was saved with {key}={state[key]} but this iterator "
                         f"has {key}={mine[key]}; resume with the same source and settings")
    if not 0 <= int(state["position"]) < self.shard_size or int(state["offset"]) < 0:
      raise ValueError(f"iterator state position={state['position']} offset={state['offset']} "
                       f"is outside a shard of {self.shard_size} records")
    self._epoch, self._position = int(state["epoch"]), int(state["position"])
    self._offset, self._doc = int(state["offset"]), None

  # -- batches --------------------------------------------------------------------------------

  def __iter__(self) -> "BatchIterator":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    saved = (self._epoch, self._position, self._offset, self._doc)
    try:
      if isinstance(self.layout, SFTLayout):
        rows, indices = self._sft_rows()
      else:
        rows, indices = self._packed_rows()
    except BaseException:
      self._epoch, self._position, self._offset, self._doc = saved  # state stays at batch start
      raise
    if len(rows) < self.batch_size:
      if not rows or not self.pad_final_batch:
        raise StopIteration
      pad = self.batch_size - len(rows)
      empty = (self.layout.empty_spans() if isinstance(self.layout, SFTLayout)
               else empty_row(self.layout))
      rows, indices = rows + [empty] * pad, indices + [-1] * pad
    if isinstance(self.layout, SFTLayout):
      batch = self.layout.assemble(rows)
    else:
      batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    batch["index"] = np.asarray(indices, np.int32)
    batch["row_mask"] = batch["index"] >= 0
    return batch

  def _upcoming(self, n: int) -> list[int]:
    """The record indices of the next `n` cursor positions (fewer at the end of the stream)."""
    epoch, position, indices = self._epoch, self._position, []
    while len(indices) < n and not (self.num_epochs is not None and epoch >= self.num_epochs):
      shard = self._shard(epoch)
      take = min(n - len(indices), self.shard_size - position)
      indices += shard[position:position + take].tolist()
      position += take
      if position == self.shard_size:
        epoch, position = epoch + 1, 0
    self._shard(self._epoch)  # keep the cursor's epoch order cached
    return indices

  def _read_ahead(self) -> dict[int, Any]:
    """The next batch's records, read in one `__getitems__` call where the source has it (the
    same records `source[i]` gives; records that `drop_long` skips are replaced one by one)."""
    read = getattr(self.source, "__getitems__", None)
    if read is None:
      return {}
    indices = self._upcoming(self.batch_size)
    return dict(zip(indices, read(indices))) if indices else {}

  def _sft_rows(self) -> tuple[list[Spans], list[int]]:
    rows, indices, skipped = [], [], 0
    ahead = self._read_ahead()
    while len(rows) < self.batch_size:
      index = self._peek()
      if index is None:
        break
      try:
        row = self.layout.spans(ahead[index] if index in ahead else self.source[index])
      except TooLongError as e:
        if not self.drop_long:
          raise TooLongError(f"record {index}: {e}") from None
        self.dropped, skipped = self.dropped + 1, skipped + 1
        if skipped > self.shard_size:
          raise ValueError("drop_long skipped a whole epoch of records: none fits the layout; "
                           "raise seq_len / prompt_len") from None
      else:
        rows.append(row)
        indices.append(index)
      self._advance()
    return rows, indices

  def _packed_rows(self) -> tuple[list[Row], list[int]]:
    rows, indices, L = [], [], self.layout.seq_len
    while len(rows) < self.batch_size:
      pieces, first, room = [], -1, L
      while room > 0:
        index = self._peek()
        if index is None:
          break
        if self._doc is None or self._doc[0] != index:
          self._doc = (index, self.layout.document(self.source[index]))
        tokens = self._doc[1]
        if self._offset >= len(tokens):
          raise ValueError(f"iterator state offset={self._offset} is past the end of record "
                           f"{index} ({len(tokens)} tokens); was it saved for another source?")
        piece = tokens[self._offset:self._offset + room]
        pieces.append(piece)
        first = index if first < 0 else first
        room -= len(piece)
        if self._offset + len(piece) == len(tokens):
          self._advance()
        else:
          self._offset += len(piece)
      if not pieces:
        break
      if room > 0 and not self.pad_final_batch:
        break  # a partial last row is dropped with its batch
      rows.append(self.layout.row(pieces))
      indices.append(first)
    return rows, indices


def eval_batches(source: Source, layout: SFTLayout | PackedLayout, batch_size: int,
                 **kwargs) -> BatchIterator:
  """One in-order pass over every record; the last batch is padded (see `row_mask`)."""
  kwargs.setdefault("process_index", 0)
  kwargs.setdefault("process_count", 1)
  return BatchIterator(source, layout, batch_size=batch_size, shuffle=False, num_epochs=1,
                       pad_final_batch=True, **kwargs)


class Prefetcher:
  """Runs a `BatchIterator` in a background thread, `buffer_size` batches ahead.

  Batching is Python and numpy work, which overlaps with a jitted step (JAX releases the GIL
  while it computes). `get_state()` is the state after the last batch *returned*, so saving it
  is exact despite the read-ahead. Call `set_state` on the inner iterator before wrapping it.
  """

  _END = object()

  def __init__(self, iterator: BatchIterator, buffer_size: int = 2):
    if buffer_size <= 0:
      raise ValueError(f"buffer_size must be positive, got {buffer_size}")
    self.iterator = iterator
    self._state = iterator.get_state()
    self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._fill, daemon=True, name="dllm-prefetch")
    self._thread.start()

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _fill(self) -> None:
    try:
      for batch in self.iterator:
        if not self._put((batch, self.iterator.get_state())):
          return
      self._put(self._END)
    except BaseException as e:  # re-raised in the consumer's thread
      self._put(e)

  def __iter__(self) -> "Prefetcher":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._stop.is_set():
      raise StopIteration
    item = self._queue.get()
    if item is self._END:
      self._stop.set()
      raise StopIteration
    if isinstance(item, BaseException):
      self._stop.set()
      raise item
    batch, self._state = item
    return batch

  def get_state(self) -> dict[str, int]:
    return dict(self._state)

  def close(self) -> None:
    """Stops the background thread (batches read ahead are discarded)."""
    self._stop.set()
    self._thread.join()
