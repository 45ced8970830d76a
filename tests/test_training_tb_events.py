"""TensorBoard event files written without TensorFlow: format details and agreement with JSONL."""

import glob
import os
import struct

import pytest

from dllm_jax.training import metrics as metrics_lib
from dllm_jax.training import tb_events


def test_crc32c_known_vector():
  assert tb_events.crc32c(b"123456789") == 0xE3069283  # the Castagnoli check value
  assert tb_events.crc32c(b"") == 0


def test_event_encoding_matches_protobuf_wire_format():
  data = tb_events.encode_event(7, 1.5, {"a": 2.0})
  expected = (b"\x09" + struct.pack("<d", 1.5) + b"\x10\x07" +
              b"\x2a\x0a" + b"\x0a\x08" + b"\x0a\x01a" + b"\x15" + struct.pack("<f", 2.0))
  assert data == expected


def test_round_trip_and_corruption(tmp_path):
  w = tb_events.EventWriter(tmp_path)
  w.scalars(1, {"loss": 2.5, "lr": 1e-3})
  w.scalars(300, {"loss": 0.25})
  got = tb_events.read_scalars(w.path)
  assert got == [(1, "loss", 2.5), (1, "lr", pytest.approx(1e-3)), (300, "loss", 0.25)]
  raw = bytearray(open(w.path, "rb").read())
  raw[-6] ^= 0xFF
  open(w.path, "wb").write(bytes(raw))
  with pytest.raises(ValueError, match="corrupted"):
    tb_events.read_scalars(w.path)


def test_metric_writer_events_equal_jsonl(tmp_path):
  writer = metrics_lib.MetricWriter(tmp_path)
  writer.write(10, "train", {"loss": 1.25, "accuracy": 0.5})
  writer.write(20, "train", {"loss": 0.75, "accuracy": 0.75})
  writer.write(20, "eval", {"loss": 0.5})
  for split in ("train", "eval"):
    files = glob.glob(os.path.join(tmp_path, "tb", split, "events.out.tfevents.*"))
    assert len(files) == 1
    events = tb_events.read_scalars(files[0])
    jsonl = [(r["step"], k, v) for r in metrics_lib.read_metrics(tmp_path, split)
             for k, v in r.items() if k not in ("step", "split")]
    assert sorted(events) == sorted(jsonl)
