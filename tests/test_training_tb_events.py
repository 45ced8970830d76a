"""TensorBoard event files (tensorboardX's writer) hold exactly the scalars of metrics.jsonl.

The files are read back independently of the writer: TFRecord framing parsed here, every CRC
checked with tensorboardX's masked crc32c, each record decoded as the `Event` protocol buffer.
"""

import glob
import os
import struct

import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from dllm_jax.training import metrics as metrics_lib


def read_scalars(path) -> list[tuple[int, str, float]]:
  """(step, tag, value) of every scalar in one event file; checks every CRC."""
  with open(path, "rb") as f:
    data = f.read()
  out, pos = [], 0
  while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    if struct.unpack("<I", data[pos + 8:pos + 12])[0] != masked_crc32c(header):
      raise ValueError(f"{path}: corrupted record length at byte {pos}")
    body = data[pos + 12:pos + 12 + length]
    if struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] != masked_crc32c(body):
      raise ValueError(f"{path}: corrupted record at byte {pos}")
    pos += 16 + length
    event = event_pb2.Event.FromString(body)
    out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
  return out


def _event_files(workdir, split):
  return glob.glob(os.path.join(workdir, "tb", split, "events.out.tfevents.*"))


def test_metric_writer_events_equal_jsonl(tmp_path):
  writer = metrics_lib.MetricWriter(tmp_path)
  writer.write(10, "train", {"loss": 1.25, "accuracy": 0.5})
  writer.write(20, "train", {"loss": 0.75, "accuracy": 0.75})
  writer.write(20, "eval", {"loss": 0.5})
  writer.close()
  for split in ("train", "eval"):
    files = _event_files(tmp_path, split)
    assert len(files) == 1
    events = read_scalars(files[0])
    jsonl = [(r["step"], k, v) for r in metrics_lib.read_metrics(tmp_path, split)
             for k, v in r.items() if k not in ("step", "split")]
    assert sorted(events) == sorted(jsonl)
  # A resumed run (same process, same second) starts a new file and keeps the old one.
  again = metrics_lib.MetricWriter(tmp_path, resume_step=20)
  again.write(30, "eval", {"loss": 0.25})
  again.close()
  files = _event_files(tmp_path, "eval")
  assert len(files) == 2
  assert sorted(s for f in files for s in read_scalars(f)) == [(20, "loss", 0.5),
                                                               (30, "loss", 0.25)]


def test_non_finite_values_and_a_corrupted_file(tmp_path):
  writer = metrics_lib.MetricWriter(tmp_path)
  writer.write(3, "train", {"loss": float("nan"), "lr": 1e-3})
  writer.close()
  (path,) = _event_files(tmp_path, "train")
  (step_a, tag_a, nan), (step_b, tag_b, lr) = read_scalars(path)
  assert (step_a, tag_a, step_b, tag_b) == (3, "loss", 3, "lr")
  assert nan != nan and lr == pytest.approx(1e-3)
  assert metrics_lib.read_metrics(tmp_path)[0]["loss"] == "nan"  # JSON has no NaN
  raw = bytearray(open(path, "rb").read())
  raw[-6] ^= 0xFF
  open(path, "wb").write(bytes(raw))
  with pytest.raises(ValueError, match="corrupted"):
    read_scalars(path)
