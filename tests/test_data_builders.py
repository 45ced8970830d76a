"""Tests for dllm_jax.data.builders: array_record datasets written and read without TensorFlow."""

import re

import numpy as np
import pydoc_data.topics
import pytest
import tensorflow_datasets as tfds

from dllm_jax.data import builders
from dllm_jax.data.layouts import SFTLayout
from dllm_jax.data.pipeline import BatchIterator
from dllm_jax.data.sources import SyntheticSource
from dllm_jax.data.tasks import TASK_ALPHABET, TaskSuite
from dllm_jax.data.tokenizers import CharTokenizer

SUITE = "arithmetic:2,sorting:1,between:1"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def synthetic(data_dir):
  return builders.prepare(builders.SyntheticReasoning, data_dir, tasks=SUITE, num_train=96,
                          num_test=24, seed=3)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("texts")
  topics = pydoc_data.topics.topics
  for name in ("assert", "while", "for", "if"):
    (folder / f"{name}.txt").write_text(topics[name], encoding="utf-8")
  (folder / "sub").mkdir()
  (folder / "sub" / "try.txt").write_text(topics["try"], encoding="utf-8")
  (folder / "notes.md").write_text("not a txt file", encoding="utf-8")
  return folder


def _paragraphs(folder):
  out = []
  for path in sorted(folder.rglob("*.txt")):
    out += [p.strip() for p in re.split(r"\n\s*\n", path.read_text()) if p.strip()]
  return out


def test_synthetic_writes_array_record(synthetic, data_dir):
  name = builders.name_of(synthetic)
  assert re.fullmatch(r"synthetic_reasoning/custom_[0-9a-f]{8}:1\.0\.0", name)
  files = list((data_dir / "synthetic_reasoning").rglob("*.array_record*"))
  assert {f.name.split(".")[0] for f in files} == {"synthetic_reasoning-train",
                                                  "synthetic_reasoning-test"}
  raw = tfds.data_source(name, split="test", data_dir=data_dir)
  assert len(raw) == 24
  assert set(raw[0]) == {"prompt", "answer", "target", "task"}
  assert isinstance(raw[0]["prompt"], bytes)  # TFDS text comes back as bytes


def test_synthetic_matches_in_memory_source(synthetic, data_dir):
  suite = TaskSuite.parse(SUITE)
  for split, n in (("train", 96), ("test", 24)):
    source = builders.load_source(builders.name_of(synthetic), split, data_dir)
    assert len(source) == n
    expected = SyntheticSource(suite, n, seed=3, split=split, unique=split == "test")
    assert list(source) == list(expected)
  train = {r["prompt"] for r in builders.load_source(synthetic, "train")}
  test = [r["prompt"] for r in builders.load_source(synthetic, "test")]
  assert not train & set(test) and len(set(test)) == len(test)


def test_tfds_source_is_a_drop_in_for_the_pipeline(synthetic):
  tok = CharTokenizer(TASK_ALPHABET)
  layout = SFTLayout.for_suite(tok, TaskSuite.parse(SUITE))
  kwargs = dict(batch_size=8, seed=1, process_index=0, process_count=1)
  a = BatchIterator(builders.load_source(synthetic, "train"), layout, **kwargs)
  b = BatchIterator(SyntheticSource(TaskSuite.parse(SUITE), 96, seed=3), layout, **kwargs)
  for _ in range(3):
    x, y = next(a), next(b)
    assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def test_prepare_reuses_prepared_data(synthetic, data_dir):
  again = builders.prepare("synthetic_reasoning", data_dir, tasks=SUITE, num_train=96,
                           num_test=24, seed=3)
  assert builders.name_of(again) == builders.name_of(synthetic)
  other = builders.SyntheticReasoningConfig.make(tasks=SUITE, num_train=96, num_test=24, seed=4)
  assert other.name != synthetic.builder_config.name  # different data, different folder


def test_building_leaves_no_temp_folders(tmp_path, monkeypatch, text_dir):
  """Preparing a dataset with either builder, or constructing one over unprepared data, writes
  nothing to the temp dir (TFDS's GCS metadata lookup made an empty tmp*tfds folder each time)."""
  temp = tmp_path / "temp"
  temp.mkdir()
  monkeypatch.setattr("tempfile.tempdir", str(temp))
  builders.prepare(builders.SyntheticReasoning, tmp_path / "data", tasks="arithmetic:1",
                   num_train=8, num_test=4, seed=5)
  builders.prepare(builders.LocalText, tmp_path / "data", path=text_dir)
  builders.SyntheticReasoning(config=builders.SyntheticReasoningConfig.make(
      tasks="sorting:1", num_train=8, num_test=4), data_dir=tmp_path / "unprepared")
  assert sorted(p.name for p in temp.iterdir()) == []


def test_named_configs_cover_every_task_and_level():
  names = {c.name for c in builders.SyntheticReasoning.BUILDER_CONFIGS}
  assert {"arithmetic_1", "sorting_5", "running_sum_3", "between_2", "mixture"} <= names
  for config in builders.SyntheticReasoning.BUILDER_CONFIGS:
    config.suite()  # parses


def test_local_text_paragraphs(text_dir, data_dir):
  builder = builders.prepare(builders.LocalText, data_dir, path=text_dir, test_fraction=0.3)
  name = builders.name_of(builder)
  assert name.startswith("local_text/texts")
  train = [r["text"] for r in builders.load_source(name, "train", data_dir)]
  test = [r["text"] for r in builders.load_source(name, "test", data_dir)]
  expected = _paragraphs(text_dir)
  assert train and test
  assert sorted(train + test) == sorted(expected)
  assert not set(train) & set(test)
  assert train == [p for p in expected if p in set(train)]  # file order is kept


def test_local_text_files_and_constructor_arg(text_dir, data_dir):
  builder = builders.prepare("local_text", data_dir, path=text_dir, unit="file",
                             test_fraction=0.4)
  texts = [r["text"] for s in ("train", "test") for r in builders.load_source(builder, s)]
  assert sorted(texts) == sorted(p.read_text() for p in text_dir.rglob("*.txt"))
  direct = builders.LocalText(path=text_dir, data_dir=data_dir, file_format="array_record")
  direct.download_and_prepare()
  assert len(direct.as_data_source("train")) + len(direct.as_data_source("test")) == len(
      _paragraphs(text_dir))


def test_load_source_errors(synthetic, data_dir, tmp_path):
  with pytest.raises(ValueError, match="unknown dataset 'no_such_dataset'"):
    builders.load_source("no_such_dataset", "train", data_dir)
  with pytest.raises(FileNotFoundError, match="not prepared"):
    builders.load_source("synthetic_reasoning/sorting_2", "train", tmp_path)
  with pytest.raises(ValueError, match=r"no split 'validation'; splits: \['test', 'train'\]"):
    builders.load_source(synthetic, "validation")
  with pytest.raises(ValueError, match="one config per folder"):
    builders.load_source("local_text", "train", data_dir)


def test_prepare_errors(tmp_path, data_dir):
  with pytest.raises(TypeError, match="unknown SyntheticReasoning config fields"):
    builders.prepare("synthetic_reasoning", data_dir, task="sorting:1")
  with pytest.raises(ValueError, match="unknown task"):
    builders.prepare("synthetic_reasoning", data_dir, tasks="sort:1")
  with pytest.raises(FileNotFoundError, match="not a folder"):
    builders.prepare("local_text", data_dir, path=tmp_path / "missing")
  with pytest.raises(ValueError, match="needs a folder"):
    builders.prepare("local_text", data_dir)
  with pytest.raises(ValueError, match="unit must be"):
    builders.prepare("local_text", data_dir, path=tmp_path, unit="line")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no files matching"):
    builders.prepare("local_text", tmp_path / "out", path=tmp_path / "empty")
