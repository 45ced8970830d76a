"""Metric logs: `workdir/metrics.jsonl`, TensorBoard event files, and the console.

The JSONL file is the source of truth: a line `{"step": 100, "split": "train", "loss": 1.23}`
is read back by `read_metrics` (or pandas) with no dependency. TensorBoard scalars go to
`workdir/tb/<split>/events.out.tfevents.*` through tensorboardX's `SummaryWriter` (clu's and
flax's writers import TensorFlow, which is not part of this stack), imported when the first
scalar is written. Its thread flushes every `TB_FLUSH_SECS` and at `close()` (the trainer
closes it even when the run fails); point `tensorboard --logdir workdir/tb` at them.

On resume the JSONL log is cut back to the restored step, so it always describes one unbroken
run; a resumed run starts a new event file (TensorBoard shows the overlap, if any).
Only process 0 writes. Console lines go through `tqdm.write`, so they print above the
progress bar; the absl log gets them too.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Mapping

import jax
import tqdm
from absl import logging
from etils import epath

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
TB_FLUSH_SECS = 10
_writer_ids = itertools.count()  # event file names are unique within a second


def _clean(value):
  value = float(value)
  return value if math.isfinite(value) else str(value)  # JSON has no nan/inf


class MetricWriter:
  """Appends records to `workdir/metrics.jsonl` and logs them (process 0 only)."""

  def __init__(self, workdir: str | os.PathLike, resume_step: int | None = None):
    self.path = epath.Path(workdir) / METRICS_FILE
    self.tb_root = epath.Path(workdir) / TB_DIR
    self._tb: dict = {}  # split -> tensorboardX.SummaryWriter
    self.enabled = jax.process_index() == 0
    if self.enabled:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      self._truncate(resume_step)

  def _truncate(self, resume_step: int | None) -> None:
    """Drops records written after `resume_step` (all of them for a fresh run)."""
    if not self.path.exists():
      return
    if resume_step is None:
      self.path.unlink()
      return
    keep = [line for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= resume_step]
    self.path.write_text("".join(line + "\n" for line in keep))

  def write(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    record = {"step": int(step), "split": split, **{k: _clean(v) for k, v in metrics.items()}}
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")
    if split not in self._tb:
      import tensorboardX  # pylint: disable=g-import-not-at-top  # imports torch if present
      self._tb[split] = tensorboardX.SummaryWriter(
          str(self.tb_root / split), flush_secs=TB_FLUSH_SECS,
          filename_suffix=f".{os.getpid()}.{next(_writer_ids)}")
    for key, value in metrics.items():
      self._tb[split].add_scalar(key, float(value), int(step))
    shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in record.items() if k not in ("step", "split"))
    console(f"[{split}] step {step}: {shown}")


  def close(self) -> None:
    """Flushes and closes the event files (the JSONL file is complete after every write)."""
    for writer in self._tb.values():
      writer.close()
    self._tb = {}


def console(message: str) -> None:
  """A line on the console (above the progress bar), process 0 only.

  absl gets it at verbosity 1 (`-v 1`): at the default level absl would print it to stderr a
  second time.
  """
  logging.vlog(1, "%s", message)
  if jax.process_index() == 0:
    tqdm.tqdm.write(message)


def read_metrics(workdir: str | os.PathLike, split: str | None = None) -> list[dict]:
  """The records of a run, in order (optionally only one split)."""
  path = epath.Path(workdir) / METRICS_FILE
  if not path.exists():
    return []
  records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return [r for r in records if split is None or r["split"] == split]
