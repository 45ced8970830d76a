"""A dependency-free TensorBoard scalar writer (event files, no TensorFlow).

TensorBoard reads `events.out.tfevents.*` files: TFRecord framing around serialized `Event`
protocol buffers. clu's and flax's writers need TensorFlow for this, so the few bytes are
written here directly:

  record  = uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
  Event   = {1: wall_time (double), 2: step (int64), 3: file_version (string),
             5: summary (Summary)}
  Summary = {1: repeated Value};  Value = {1: tag (string), 2: simple_value (float)}

`read_scalars` parses the same format back (used by the tests, and handy in notebooks).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Mapping

_CRC_TABLE = []
for _i in range(256):
  _c = _i
  for _ in range(8):
    _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
  _CRC_TABLE.append(_c)


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
  out = bytearray()
  value &= (1 << 64) - 1
  while True:
    bits = value & 0x7F
    value >>= 7
    out.append(bits | (0x80 if value else 0))
    if not value:
      return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
  return _varint((number << 3) | wire) + payload


def _bytes_field(number: int, payload: bytes) -> bytes:
  return _field(number, 2, _varint(len(payload)) + payload)


def encode_event(step: int, wall_time: float, scalars: Mapping[str, float] | None = None,
                 file_version: str | None = None) -> bytes:
  """Serializes one `Event` holding scalar summaries (or the file-version header)."""
  event = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(int(step)))
  if file_version is not None:
    event += _bytes_field(3, file_version.encode())
  if scalars:
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", v)))
        for tag, v in scalars.items())
    event += _bytes_field(5, values)
  return event


def frame(data: bytes) -> bytes:
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", _masked_crc(length)) + data +
          struct.pack("<I", _masked_crc(data)))


class EventWriter:
  """Appends scalar events to one new event file in `logdir`."""

  def __init__(self, logdir: str | os.PathLike):
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    self.path = os.path.join(logdir, name)
    with open(self.path, "ab") as f:
      f.write(frame(encode_event(0, time.time(), file_version="brain.Event:2")))

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    with open(self.path, "ab") as f:
      f.write(frame(encode_event(step, time.time(), {k: float(v) for k, v in values.items()})))


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
  shift = result = 0
  while True:
    byte = buf[pos]
    pos += 1
    result |= (byte & 0x7F) << shift
    if not byte & 0x80:
      return result, pos
    shift += 7


def _fields(buf: bytes):
  pos = 0
  while pos < len(buf):
    key, pos = _read_varint(buf, pos)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, pos = _read_varint(buf, pos)
    elif wire == 1:
      value, pos = buf[pos:pos + 8], pos + 8
    elif wire == 5:
      value, pos = buf[pos:pos + 4], pos + 4
    elif wire == 2:
      n, pos = _read_varint(buf, pos)
      value, pos = buf[pos:pos + n], pos + n
    else:
      raise ValueError(f"unsupported protobuf wire type {wire}")
    yield number, value


def read_scalars(path: str | os.PathLike) -> list[tuple[int, str, float]]:
  """(step, tag, value) of every scalar in one event file; checks every CRC."""
  out = []
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    if struct.unpack("<I", data[pos + 8:pos + 12])[0] != _masked_crc(header):
      raise ValueError(f"{path}: corrupted record length at byte {pos}")
    body = data[pos + 12:pos + 12 + length]
    if struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] != _masked_crc(body):
      raise ValueError(f"{path}: corrupted record at byte {pos}")
    pos += 16 + length
    step = 0
    for number, value in _fields(body):
      if number == 2:
        step = value
      elif number == 5:
        for _, v in _fields(value):
          tag, simple = None, None
          for n2, v2 in _fields(v):
            if n2 == 1:
              tag = v2.decode()
            elif n2 == 2:
              simple = struct.unpack("<f", v2)[0]
          if tag is not None and simple is not None:
            out.append((step, tag, simple))
  return out
