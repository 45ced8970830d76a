"""TFDS builders that write array_record files (no TensorFlow needed) and a loader for them.

  SyntheticReasoning  `synthetic_reasoning/<config>`: a TaskSuite's train and test splits,
                      features prompt, answer, target, task (Text). Record i of a split equals
                      `SyntheticSource(suite, n, seed, split)[i]`, so prepared and in-memory
                      data are interchangeable. Named configs `<task>_<level>` (e.g.
                      `arithmetic_3`) and `mixture`; any other suite via `prepare(..., tasks=)`.
  LocalText           `local_text/<config>`: every `*.txt` file under a folder (recursively),
                      one record per paragraph (blank-line separated) or per file; feature
                      text. A record is in `test` iff the blake2b hash of its text (paragraphs)
                      or of its relative path (files) says so, so repeated paragraphs never
                      straddle the splits.

`prepare(...)` builds and writes a dataset (ours or a catalog one) as array_record under
`data_dir`; `load_source(name, split, data_dir)` opens a prepared split for random access,
decoding Text features from bytes to str. Both builders keep records in generation order
(`disable_shuffling`): the pipeline shuffles indices itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import tensorflow_datasets as tfds
from etils import epath

from dllm_jax.data.sources import SyntheticSource, TextSource
from dllm_jax.data.tasks import LEVELS, TASKS, TaskSuite, split_of

FILE_FORMAT = "array_record"
_RANDOM_ACCESS_FORMATS = ("array_record", "parquet")


class _LocalCodePath:
  """Points TFDS at this file directly.

  TFDS's default `code_path` touches the `importlib_resources` backport for any builder that
  lives in a package, and that backport is not a dependency; the answer is this file anyway.
  """

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(__file__)


class _LocalDatasetInfo(tfds.core.DatasetInfo):
  """DatasetInfo of a dataset that only ever exists on this machine.

  A builder whose data is not prepared yet asks `initialize_from_bucket` for TFDS's published
  metadata, and TFDS 4.9 makes a `tmp*tfds` folder before it checks whether that lookup is
  enabled; nothing removes it, so every construction of an unprepared builder left an empty
  folder in the temp dir. These datasets are generated here and never published: there is
  nothing to look up.
  """

  def initialize_from_bucket(self) -> None:
    return None


def _short_hash(*parts: Any) -> str:
  return hashlib.blake2b(repr(parts).encode(), digest_size=4).hexdigest()


@dataclasses.dataclass
class SyntheticReasoningConfig(tfds.core.BuilderConfig):
  """A TaskSuite spec (`TaskSuite.parse` syntax) and split sizes."""
  tasks: str = "arithmetic:1"
  num_train: int = 10_000
  num_test: int = 1_000
  seed: int = 0
  test_fraction: float = 0.1
  unique_test: bool = True  # no repeated prompt inside the test split

  @classmethod
  def make(cls, name: str | None = None, **fields) -> "SyntheticReasoningConfig":
    """A config named after a hash of its fields unless `name` is given."""
    unknown = set(fields) - {f.name for f in dataclasses.fields(cls)} - {"description"}
    if unknown:
      raise TypeError(f"unknown SyntheticReasoning config fields {sorted(unknown)}; valid: "
                      "tasks, num_train, num_test, seed, test_fraction, unique_test")
    config = cls(name="custom", **fields)
    config.suite()  # validate now, not at prepare time
    key = tuple(getattr(config, f) for f in
                ("tasks", "num_train", "num_test", "seed", "test_fraction", "unique_test"))
    config.name = name or f"custom_{_short_hash(*key)}"
    return config

  def suite(self) -> TaskSuite:
    return TaskSuite.parse(self.tasks, test_fraction=self.test_fraction)


def _default_synthetic_configs() -> list[SyntheticReasoningConfig]:
  configs = [SyntheticReasoningConfig(name=f"{task}_{level}", tasks=f"{task}:{level}",
                                      num_test=500, description=f"{task} at difficulty {level}")
             for task in TASKS for level in LEVELS]
  configs.append(SyntheticReasoningConfig(
      name="mixture", tasks=",".join(f"{task}:2" for task in TASKS), num_train=50_000,
      num_test=2_000, description="every task at difficulty 2, equal weights"))
  return configs


class SyntheticReasoning(_LocalCodePath, tfds.core.GeneratorBasedBuilder):
  """Synthetic reasoning tasks with exactly checkable answers (see dllm_jax.data.tasks)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = _default_synthetic_configs()
  DEFAULT_CONFIG_NAME = "mixture"

  def _info(self) -> tfds.core.DatasetInfo:
    text = tfds.features.Text
    return _LocalDatasetInfo(
        builder=self, description=self.__doc__, disable_shuffling=True,
        features=tfds.features.FeaturesDict(
            {"prompt": text(), "answer": text(), "target": text(), "task": text()}))

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    config = self.builder_config
    return {"train": self._generate_examples("train", config.num_train),
            "test": self._generate_examples("test", config.num_test)}

  def _generate_examples(self, split: str, n: int) -> Iterator[tuple[int, dict[str, str]]]:
    config = self.builder_config
    unique = config.unique_test and split == "test"
    source = SyntheticSource(config.suite(), n, config.seed, split, unique=unique)
    for i, record in enumerate(source):
      yield i, record


@dataclasses.dataclass
class LocalTextConfig(tfds.core.BuilderConfig):
  """A folder of .txt files and how to cut and split it."""
  path: str = ""
  unit: str = "paragraph"  # or "file"
  test_fraction: float = 0.05
  pattern: str = "*.txt"

  @classmethod
  def make(cls, path: str | os.PathLike, name: str | None = None, **fields) -> "LocalTextConfig":
    """A config for `path`, named `<folder>_<hash of path and options>` unless `name` is given."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
      raise FileNotFoundError(f"LocalText: {path!r} is not a folder; pass a folder of .txt files")
    unknown = set(fields) - {"unit", "test_fraction", "pattern", "description"}
    if unknown:
      raise TypeError(f"unknown LocalText config fields {sorted(unknown)}; valid: path, unit, "
                      "test_fraction, pattern")
    config = cls(name="custom", path=path, **fields)
    if config.unit not in ("paragraph", "file"):
      raise ValueError(f"LocalText unit must be 'paragraph' or 'file', got {config.unit!r}")
    if not 0.0 < config.test_fraction < 1.0:
      raise ValueError(f"test_fraction must be in (0, 1), got {config.test_fraction}")
    folder = re.sub(r"[^a-z0-9]+", "_", os.path.basename(path).lower()).strip("_") or "text"
    key = (path, config.unit, config.test_fraction, config.pattern)
    config.name = name or f"{folder}_{_short_hash(*key)}"
    return config


class LocalText(_LocalCodePath, tfds.core.GeneratorBasedBuilder):
  """Plain text from a local folder of .txt files: `LocalText(path=folder, data_dir=...)`."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}

  def __init__(self, *, path: str | os.PathLike | None = None, **kwargs):
    if path is not None:
      if kwargs.get("config") is not None:
        raise ValueError("LocalText takes a folder either as path= or inside config=, not both")
      kwargs["config"] = LocalTextConfig.make(path)
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return _LocalDatasetInfo(
        builder=self, description=self.__doc__, disable_shuffling=True,
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    config = self.builder_config
    if config is None or not config.path:
      raise ValueError("LocalText needs a folder: LocalText(path=..., data_dir=...) or "
                       "prepare(LocalText, data_dir, path=...)")
    return {split: self._generate_examples(split) for split in ("train", "test")}

  def _generate_examples(self, split: str) -> Iterator[tuple[str, dict[str, str]]]:
    config = self.builder_config
    root = os.path.abspath(config.path)
    files = sorted(str(p) for p in pathlib.Path(root).rglob(config.pattern) if p.is_file())
    if not files:
      raise FileNotFoundError(f"LocalText: no files matching {config.pattern!r} under {root!r}")
    for file in files:
      rel = os.path.relpath(file, root)
      try:
        with open(file, encoding="utf-8") as f:
          content = f.read()
      except UnicodeDecodeError as e:
        raise ValueError(f"LocalText: {file} is not UTF-8 ({e}); convert it or remove it") from e
      if config.unit == "file":
        if content.strip() and split_of(rel, config.test_fraction) == split:
          yield rel, {"text": content}
        continue
      paragraphs = [p.strip() for p in re.split(r"\n\s*\n", content)]
      for i, paragraph in enumerate(p for p in paragraphs if p):
        if split_of(paragraph, config.test_fraction) == split:
          yield f"{rel}:{i}", {"text": paragraph}


_OURS = {"synthetic_reasoning": SyntheticReasoning, "local_text": LocalText}
_CONFIG_CLASSES = {SyntheticReasoning: SyntheticReasoningConfig, LocalText: LocalTextConfig}


def prepare(builder: str | type[tfds.core.DatasetBuilder], data_dir: str | os.PathLike, *,
            config: str | tfds.core.BuilderConfig | None = None,
            download_config: tfds.download.DownloadConfig | None = None,
            **fields) -> tfds.core.DatasetBuilder:
  """Builds (or reuses) a dataset as array_record under `data_dir` and returns its builder.

  `builder` is one of our classes or names (`SyntheticReasoning`, `"local_text"`), optionally
  with a config (`"synthetic_reasoning/arithmetic_3"`), or a TFDS catalog name (which
  downloads its sources). `fields` make a config of ours, e.g.
  `prepare(SyntheticReasoning, d, tasks="sorting:2", num_train=1000)` or
  `prepare(LocalText, d, path="my_texts/")`; for catalog builders they are builder kwargs.
  """
  data_dir = os.fspath(data_dir)
  cls = _OURS.get(builder, builder) if isinstance(builder, str) else builder
  if isinstance(cls, type) and cls in _OURS.values():
    if fields:
      if config is not None:
        raise ValueError("pass either config= or config fields, not both")
      config = _CONFIG_CLASSES[cls].make(**fields)
    if cls is LocalText and config is None:
      raise ValueError("LocalText needs a folder: prepare(LocalText, data_dir, path=...)")
    instance = cls(config=config, data_dir=data_dir, file_format=FILE_FORMAT)
  elif isinstance(builder, str):
    if config is not None:
      fields["config"] = config
    instance = tfds.builder(builder, data_dir=data_dir, file_format=FILE_FORMAT, **fields)
  else:
    raise TypeError(f"builder must be a dataset name or a DatasetBuilder class, got {builder!r}")
  if download_config is None:
    download_config = tfds.download.DownloadConfig(try_download_gcs=False)
  instance.download_and_prepare(download_config=download_config, file_format=FILE_FORMAT)
  return instance


def name_of(builder: tfds.core.DatasetBuilder) -> str:
  """`name/config:version`, the string `load_source` and `tfds.data_source` accept."""
  config = f"/{builder.builder_config.name}" if builder.builder_config else ""
  return f"{builder.name}{config}:{builder.version}"


def load_source(name: str | tfds.core.DatasetBuilder, split: str,
                data_dir: str | os.PathLike | None = None, *, decode: bool = True):
  """Random access to a prepared split: ours (`synthetic_reasoning/arithmetic_3`) or a catalog
  dataset prepared as array_record. Text comes back as str unless `decode=False`."""
  if isinstance(name, tfds.core.DatasetBuilder):
    builder, name = name, name_of(name)
  else:
    data_dir = None if data_dir is None else os.fspath(data_dir)
    try:
      builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as e:
      raise ValueError(f"unknown dataset {name!r}: not one of ours ({sorted(_OURS)}) nor in the "
                       f"TFDS catalog; check the name") from e
    except ValueError as e:  # e.g. a config name that is neither built in nor prepared
      raise ValueError(f"cannot open {name!r} in data_dir={data_dir!r}: {e}. Prepare it first "
                       f"with prepare(...) and pass name_of(builder)") from e
  if isinstance(builder, LocalText) and builder.builder_config is None:
    raise ValueError("local_text has one config per folder: pass 'local_text/<config>' as "
                     "given by name_of(prepare(LocalText, data_dir, path=...))")
  if not builder.is_prepared():
    raise FileNotFoundError(
        f"dataset {name!r} is not prepared in data_dir={str(builder.data_dir_root)!r}; run "
        f"dllm_jax.data.prepare({name.split(':')[0]!r}, data_dir) first")
  file_format = builder.info.file_format
  fmt = getattr(file_format, "value", file_format)
  if fmt not in _RANDOM_ACCESS_FORMATS:
    raise ValueError(f"{name!r} is prepared as {fmt} in {builder.data_dir}, which needs "
                     "TensorFlow to read; prepare it again with file_format='array_record' "
                     "in another data_dir")
  base = re.split(r"[\[+]", split)[0]
  if base not in builder.info.splits:
    raise ValueError(f"{name!r} has no split {base!r}; splits: {sorted(builder.info.splits)}")
  source = builder.as_data_source(split=split)
  return TextSource(source) if decode else source
