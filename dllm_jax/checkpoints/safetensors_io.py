"""Safetensors files read one tensor at a time, and written as a stream.

A safetensors file is `u64 little-endian header length | JSON header | raw bytes`; the header
maps each tensor name to `{dtype, shape, data_offsets}` (offsets relative to the end of the
header). We parse the header ourselves so that:
  * every tensor, bfloat16 included, is read with one `readinto` into a NumPy buffer
    (`ml_dtypes.bfloat16`, which the `safetensors` NumPy framework cannot return);
  * a corrupted or truncated file is reported before any tensor is read, naming the file;
  * a checkpoint is written tensor by tensor (the header is computed from shapes first), so
    exporting never holds more than one tensor on the host.

A checkpoint directory holds either `<stem>.safetensors` or shards listed in
`<stem>.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

_CODES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
_CODES = {k: np.dtype(v) for k, v in _CODES.items()}
_ST_DTYPES = {v: k for k, v in _CODES.items()}
# Only float tensors load: quantized checkpoints need a dequantization step we do not do.
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")
_MAX_HEADER = 100 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lives: file, dtype (safetensors code), shape and absolute byte range."""
  name: str
  path: Path
  dtype: str
  shape: tuple[int, ...]
  start: int
  end: int

  @property
  def nbytes(self) -> int:
    return self.end - self.start


def numpy_dtype(code: str, name: str, path: Path) -> np.dtype:
  """NumPy dtype of a float tensor; other dtypes are refused with what to do."""
  if code not in _FLOAT_CODES:
    raise ValueError(
        f"{path}: tensor {name!r} has dtype {code}; only float tensors {list(_FLOAT_CODES)} "
        "can be loaded. Dequantize the checkpoint (or export it in bf16/fp32) first.")
  return _CODES[code]


def safetensors_dtype(dtype) -> str:
  dtype = np.dtype(dtype)
  if dtype not in _ST_DTYPES:
    raise ValueError(f"cannot write dtype {dtype} to safetensors; use one of "
                     f"{sorted(str(d) for d in _ST_DTYPES)}.")
  return _ST_DTYPES[dtype]


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
  """Parses and validates a safetensors header; no tensor data is read."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"safetensors file {path} does not exist.")
  size = path.stat().st_size
  fix = "the file is corrupted or truncated: re-download or re-export it."
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise ValueError(f"{path}: only {size} bytes, too short for a safetensors header; {fix}")
    (header_len,) = struct.unpack("<Q", raw)
    if header_len > min(size - 8, _MAX_HEADER):
      raise ValueError(f"{path}: header length {header_len} does not fit in a file of "
                       f"{size} bytes; {fix}")
    try:
      header = json.loads(f.read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{path}: the JSON header cannot be parsed ({e}); {fix}") from None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: the header is not a JSON object; {fix}")
  base = 8 + header_len
  out = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    try:
      code, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
      begin, end = (int(o) for o in entry["data_offsets"])
    except (TypeError, KeyError, ValueError):
      raise ValueError(f"{path}: malformed header entry for tensor {name!r}: {entry!r}; "
                       f"{fix}") from None
    itemsize = _CODES[code].itemsize if code in _CODES else None
    if itemsize is not None and end - begin != itemsize * int(np.prod(shape)):
      raise ValueError(f"{path}: tensor {name!r} spans {end - begin} bytes but shape {shape} "
                       f"{code} needs {itemsize * int(np.prod(shape))}; {fix}")
    if not 0 <= begin <= end or base + end > size:
      raise ValueError(f"{path}: tensor {name!r} ends at byte {base + end} but the file has "
                       f"{size} bytes; {fix}")
    out[name] = TensorInfo(name, path, code, shape, base + begin, base + end)
  return out


def read_tensor(info: TensorInfo) -> np.ndarray:
  """Reads one tensor into a fresh NumPy array of its stored dtype (bf16 as ml_dtypes)."""
  out = np.empty(info.shape, numpy_dtype(info.dtype, info.name, info.path))
  with open(info.path, "rb") as f:
    f.seek(info.start)
    got = f.readinto(out.reshape(-1).view(np.uint8))
  if got != info.nbytes:
    raise ValueError(f"{info.path}: tensor {info.name!r} is truncated ({got} of {info.nbytes} "
                     "bytes); the file changed or is corrupted: re-download or re-export it.")
  return out


class TensorStore:
  """Name -> TensorInfo over one file or an index of shards; reads tensors on demand."""

  def __init__(self, infos: dict[str, TensorInfo], description: str):
    self.infos = infos
    self.description = description

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> "TensorStore":
    return cls(read_header(path), str(path))

  @classmethod
  def from_directory(cls, directory: str | os.PathLike, stem: str = "model") -> "TensorStore":
    """Opens `<stem>.safetensors.index.json` (shards) or else `<stem>.safetensors`."""
    directory = Path(directory)
    index_path = directory / f"{stem}.safetensors.index.json"
    single = directory / f"{stem}.safetensors"
    if index_path.is_file():
      return cls._from_index(index_path)
    if single.is_file():
      return cls.from_file(single)
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    hint = (" PyTorch .bin weights are not supported: re-save them with safe_serialization."
            if any(n.endswith(".bin") for n in found) else "")
    raise FileNotFoundError(
        f"no weights in {directory}: expected {single.name} or {index_path.name}; "
        f"found {found}.{hint}")

  @classmethod
  def _from_index(cls, index_path: Path) -> "TensorStore":
    try:
      weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index_path}: not a valid safetensors index ({e!r}); it must hold "
                       '{"weight_map": {tensor: file}}.') from None
    headers = {}
    for shard in sorted(set(weight_map.values())):
      shard_path = index_path.parent / shard
      if not shard_path.is_file():
        listed = sum(1 for f in weight_map.values() if f == shard)
        raise FileNotFoundError(
            f"shard {shard_path} is listed in {index_path.name} ({listed} tensors) but is "
            "missing; download every shard of the checkpoint.")
      headers[shard] = read_header(shard_path)
    infos = {}
    for name, shard in weight_map.items():
      if name not in headers[shard]:
        raise ValueError(f"{index_path.name} says tensor {name!r} is in {shard}, but that file "
                         "does not contain it; the index and shards come from different saves.")
      infos[name] = headers[shard][name]
    return cls(infos, str(index_path))

  def __contains__(self, name: str) -> bool:
    return name in self.infos

  def names(self) -> list[str]:
    return list(self.infos)

  def shape(self, name: str) -> tuple[int, ...]:
    return self.infos[name].shape

  def read(self, name: str) -> np.ndarray:
    if name not in self.infos:
      raise ValueError(f"tensor {name!r} is not in {self.description}.")
    return read_tensor(self.infos[name])


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """A tensor to write: its name, NumPy dtype and shape (data comes from a producer)."""
  name: str
  dtype: np.dtype
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    return np.dtype(self.dtype).itemsize * int(np.prod(self.shape))


def write_file(path: str | os.PathLike, specs: Sequence[TensorSpec],
               produce: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None):
  """Writes `specs` in order, asking `produce(name)` for one tensor at a time."""
  header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
  offset = 0
  for spec in specs:
    header[spec.name] = {"dtype": safetensors_dtype(spec.dtype), "shape": list(spec.shape),
                         "data_offsets": [offset, offset + spec.nbytes]}
    offset += spec.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for spec in specs:
      array = np.asarray(produce(spec.name))
      if array.shape != tuple(spec.shape) or array.dtype != np.dtype(spec.dtype):
        raise ValueError(f"tensor {spec.name!r} produced {array.shape} {array.dtype}, "
                         f"declared {spec.shape} {np.dtype(spec.dtype)}.")
      f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def write_checkpoint(directory: str | os.PathLike, specs: Sequence[TensorSpec],
                     produce: Callable[[str], np.ndarray], max_shard_bytes: int,
                     stem: str = "model") -> list[str]:
  """Writes one file, or shards plus an index when the tensors exceed `max_shard_bytes`."""
  if max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}.")
  groups: list[list[TensorSpec]] = [[]]
  size = 0
  for spec in specs:
    if groups[-1] and size + spec.nbytes > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(spec)
    size += spec.nbytes
  directory = Path(directory)
  if len(groups) == 1:
    write_file(directory / f"{stem}.safetensors", groups[0], produce)
    return [f"{stem}.safetensors"]
  files = [f"{stem}-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
  weight_map = {}
  for name, group in zip(files, groups):
    write_file(directory / name, group, produce)
    weight_map.update({spec.name: name for spec in group})
  index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
  (directory / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
  return files

