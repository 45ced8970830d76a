"""Tests for dllm_jax.data layouts, sources and the resumable batch iterator."""

import json

import numpy as np
import pytest

from dllm_jax.data.layouts import PackedLayout, SFTLayout, TooLongError
from dllm_jax.data.pipeline import BatchIterator, Prefetcher, eval_batches
from dllm_jax.data.sources import SyntheticSource, TextSource, record_to_example
from dllm_jax.data.tasks import TASK_ALPHABET, TaskSuite
from dllm_jax.data.tokenizers import ByteTokenizer, CharTokenizer

TOK = CharTokenizer("0123456789+=ab")  # '0' -> 4, ..., '9' -> 13, '+' 14, '=' 15
PAD, BOS, EOS = 0, 1, 2
SUITE = TaskSuite.parse("arithmetic:1,sorting:1,running_sum:1")
ONE_PROC = dict(process_index=0, process_count=1)


def _mask(s):
  return np.array([c == "x" for c in s])


def test_sft_free_prompt_row():
  row = SFTLayout(TOK, seq_len=10).encode({"prompt": "1+2=", "answer": "3"})
  assert row["tokens"].tolist() == [BOS, 5, 14, 6, 15, 7, EOS, EOS, EOS, EOS]
  assert row["tokens"].dtype == np.int32 and row["positions"].tolist() == list(range(10))
  np.testing.assert_array_equal(row["prompt_mask"], _mask("xxxxx....."))
  np.testing.assert_array_equal(row["answer_mask"], _mask(".....xx..."))
  np.testing.assert_array_equal(row["loss_mask"], _mask(".....xxxxx"))  # LLaDA trains on pads
  np.testing.assert_array_equal(row["valid"], np.ones(10, bool))
  np.testing.assert_array_equal(row["segment_ids"], np.ones(10, np.int32))


def test_sft_fixed_prompt_left_pads_and_pad_mode():
  layout = SFTLayout(TOK, seq_len=10, prompt_len=6, pad="pad")
  row = layout.encode({"prompt": b"1+2=", "answer": "34"})  # bytes from TFDS are fine
  assert row["tokens"].tolist() == [PAD, BOS, 5, 14, 6, 15, 7, 8, EOS, PAD]
  np.testing.assert_array_equal(row["valid"], _mask(".xxxxxxxx."))
  np.testing.assert_array_equal(row["prompt_mask"], _mask(".xxxxx...."))
  np.testing.assert_array_equal(row["answer_mask"], _mask("......xxx."))
  np.testing.assert_array_equal(row["loss_mask"], row["answer_mask"])
  assert row["positions"].tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7, 7]
  assert row["segment_ids"].tolist() == row["valid"].astype(int).tolist()


def test_sft_without_bos_and_with_eot():
  row = SFTLayout(TOK, seq_len=6, add_bos=False, terminator="eot").encode(
      {"prompt": "1=", "answer": "1"})
  assert row["tokens"].tolist() == [5, 15, 5, TOK.eot_id, EOS, EOS]


def test_sft_too_long_raises():
  layout = SFTLayout(TOK, seq_len=8, prompt_len=4)
  with pytest.raises(TooLongError, match="prompt has 5 tokens .* > prompt_len=4"):
    layout.encode({"prompt": "1+2=", "answer": "3"})
  with pytest.raises(TooLongError, match="needs 9 tokens .* > seq_len=8"):
    layout.encode({"prompt": "1=", "answer": "1234"})
  with pytest.raises(ValueError, match="needs 9 tokens"):  # TooLongError is a ValueError
    SFTLayout(TOK, seq_len=8).encode({"prompt": "1+2=", "answer": "123"})
  with pytest.raises(KeyError, match="no field 'answer'"):
    layout.encode({"prompt": "1=", "response": "1"})


@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_len=0), "seq_len must be a positive int"),
    (dict(seq_len=8, prompt_len=8), "leaves no room"),
    (dict(seq_len=8, pad="zero"), "pad must be one of"),
    (dict(seq_len=8, terminator="eom"), "terminator must be one of"),
])
def test_sft_layout_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SFTLayout(TOK, **kwargs)


def test_encode_prompts_for_decoding():
  layout = SFTLayout(TOK, seq_len=12, prompt_len=6)
  out = layout.encode_prompts(["1+2=", "9="])
  assert out["tokens"].tolist() == [[PAD, BOS, 5, 14, 6, 15], [PAD, PAD, PAD, BOS, 13, 15]]
  assert out["positions"].tolist() == [[0, 0, 1, 2, 3, 4], [0, 0, 0, 0, 1, 2]]
  assert layout.encode_prompts(["9="], length=3)["tokens"].tolist() == [[BOS, 13, 15]]
  assert SFTLayout(TOK, seq_len=12).encode_prompts(["1=", "12="])["tokens"].shape == (2, 4)
  with pytest.raises(TooLongError, match="prompt 1 has 5 tokens"):
    layout.encode_prompts(["1=", "1+2="], length=4)


def test_for_suite_fits_every_example_and_aligns_blocks():
  tok = CharTokenizer(TASK_ALPHABET)
  suite = TaskSuite.parse("arithmetic:5,between:2,sorting:3")
  layout = SFTLayout.for_suite(tok, suite, block_size=8)
  assert layout.prompt_len == suite.max_prompt_len + 1
  assert (layout.seq_len - layout.prompt_len) % 8 == 0
  for record in SyntheticSource(suite, 400, seed=0):
    layout.encode(record)
  assert SFTLayout.for_suite(ByteTokenizer(), suite, fixed_prompt=False).prompt_len is None


# -- sources -----------------------------------------------------------------------------------


def test_synthetic_source_random_access_is_deterministic():
  src = SyntheticSource(SUITE, 50, seed=7)
  forward = [src[i] for i in range(50)]
  assert [src[i] for i in reversed(range(50))] == forward[::-1]
  assert list(SyntheticSource(SUITE, 50, seed=7)) == forward
  assert list(SyntheticSource(SUITE, 50, seed=8)) != forward
  assert src[-1] == forward[-1]
  ex = record_to_example(src[3])
  assert SUITE.score(ex.answer, ex)
  with pytest.raises(IndexError, match="out of range"):
    src[50]
  with pytest.raises(TypeError, match="must be ints"):
    src[1.0]


def test_synthetic_source_splits_and_unique():
  train = {r["prompt"] for r in SyntheticSource(SUITE, 2000, seed=0)}
  test = [r["prompt"] for r in SyntheticSource(SUITE, 300, seed=0, split="test", unique=True)]
  assert len(set(test)) == 300 and not train & set(test)
  with pytest.raises(ValueError, match="distinct 'test' prompts"):
    SyntheticSource(TaskSuite.parse("arithmetic:1", test_fraction=0.05), 600, split="test",
                    unique=True)
  with pytest.raises(ValueError, match="split must be one of"):
    SyntheticSource(SUITE, 10, split="eval")
  with pytest.raises(ValueError, match="n > 0"):
    SyntheticSource(SUITE, 0)


def test_text_source_decodes_bytes():
  src = TextSource([{"text": b"caf\xc3\xa9", "n": 3}])
  assert src[0] == {"text": "café", "n": 3} and len(src) == 1
  assert src.__getitems__([0, -1]) == [src[0], src[0]]


class _BatchedReads(list):
  """A list of records that also reads many at once (as array_record sources do), counting."""

  def __init__(self, records):
    super().__init__(records)
    self.batched, self.single = [], 0

  def __getitem__(self, index):
    self.single += 1
    return super().__getitem__(index)

  def __getitems__(self, indices):
    self.batched.append(list(indices))
    return [super(_BatchedReads, self).__getitem__(i) for i in indices]


def test_text_source_reads_batches_through():
  inner = _BatchedReads([{"text": b"a"}, {"text": b"b"}, {"text": b"c"}])
  assert TextSource(inner).__getitems__([2, 0]) == [{"text": "c"}, {"text": "a"}]
  assert inner.batched == [[2, 0]] and inner.single == 0
  with pytest.raises(IndexError, match="index 3 out of range"):
    TextSource(inner).__getitems__([3])


# -- BatchIterator -----------------------------------------------------------------------------


def _sft_iter(n=40, batch_size=4, **kwargs):
  layout = SFTLayout.for_suite(CharTokenizer(TASK_ALPHABET), SUITE)
  kwargs = {**ONE_PROC, **kwargs}
  return BatchIterator(SyntheticSource(SUITE, n, seed=1), layout, batch_size=batch_size, **kwargs)


def test_batch_shapes_and_dtypes():
  batch = next(_sft_iter())
  L = SFTLayout.for_suite(CharTokenizer(TASK_ALPHABET), SUITE).seq_len
  for key in ("tokens", "positions", "segment_ids"):
    assert batch[key].shape == (4, L) and batch[key].dtype == np.int32
  for key in ("valid", "prompt_mask", "answer_mask", "loss_mask"):
    assert batch[key].shape == (4, L) and batch[key].dtype == bool
  assert batch["index"].dtype == np.int32 and batch["row_mask"].all()


def test_epochs_are_permutations_with_fresh_order():
  it = _sft_iter(n=40, batch_size=4, seed=3)
  epochs = [np.concatenate([next(it)["index"] for _ in range(10)]) for _ in range(2)]
  assert all(sorted(e) == list(range(40)) for e in epochs)
  assert epochs[0].tolist() != epochs[1].tolist() != list(range(40))
  again = _sft_iter(n=40, batch_size=4, seed=3)
  assert np.concatenate([next(again)["index"] for _ in range(10)]).tolist() == epochs[0].tolist()
  unshuffled = _sft_iter(n=40, batch_size=4, shuffle=False)
  assert np.concatenate([next(unshuffled)["index"] for _ in range(10)]).tolist() == list(range(40))


def test_processes_read_disjoint_shards():
  shards = []
  for p in range(3):
    it = _sft_iter(n=31, batch_size=5, process_index=p, process_count=3, num_epochs=1)
    shards.append(np.concatenate([b["index"] for b in it]))
  assert [len(s) for s in shards] == [10, 10, 10]  # 31 // 3 each; the last batch is dropped...
  assert len(set(np.concatenate(shards).tolist())) == 30  # ...and no record is read twice


def test_default_process_info_comes_from_jax():
  it = _sft_iter(process_index=None, process_count=None)
  assert (it.process_index, it.process_count) == (0, 1)
  with pytest.raises(ValueError, match="process_index=3 must be in"):
    _sft_iter(process_index=3, process_count=2)


def _assert_same(a, b):
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("consumed", [0, 3, 7])
def test_resume_continues_with_the_same_batches(consumed):
  reference = _sft_iter(n=10, batch_size=4, seed=5)  # batches straddle epoch boundaries
  expected = [next(reference) for _ in range(consumed + 6)][consumed:]
  first = _sft_iter(n=10, batch_size=4, seed=5)
  for _ in range(consumed):
    next(first)
  state = json.loads(json.dumps(first.get_state()))
  assert all(isinstance(v, int) for v in state.values())
  resumed = _sft_iter(n=10, batch_size=4, seed=5)
  resumed.set_state(state)
  for want in expected:
    _assert_same(next(resumed), want)


@pytest.mark.parametrize("kwargs, reads", [
    (dict(batch_size=4, seed=5), [4] * 5),  # batches straddle epochs of 10 records
    (dict(batch_size=4, num_epochs=1, pad_final_batch=True), [4, 4, 2]),
    (dict(batch_size=4, shuffle=False), [4] * 5)])
def test_batched_reads_give_the_same_batches(kwargs, reads):
  records = list(SyntheticSource(SUITE, 10, seed=1))
  layout = SFTLayout.for_suite(CharTokenizer(TASK_ALPHABET), SUITE)
  plain = BatchIterator(records, layout, **kwargs, **ONE_PROC)
  want = [next(plain) for _ in range(len(reads))]
  source = _BatchedReads(records)
  batched = BatchIterator(source, layout, **kwargs, **ONE_PROC)
  for expected in want:
    _assert_same(next(batched), expected)
  # one read per batch, of exactly the records it holds, and none one by one
  assert [len(r) for r in source.batched] == reads and source.single == 0
  assert sum(source.batched, []) == [i for b in want for i in b["index"].tolist() if i >= 0]


def test_batched_reads_replace_dropped_records_one_by_one():
  records = ([{"prompt": "1=", "answer": "1"}] * 2 + [{"prompt": "1=", "answer": "1" * 20}]
             + [{"prompt": "1=", "answer": "1"}] * 3)
  source = _BatchedReads(records)
  it = BatchIterator(source, SFTLayout(TOK, seq_len=8), batch_size=3, shuffle=False,
                     drop_long=True, **ONE_PROC)
  assert next(it)["index"].tolist() == [0, 1, 3] and it.dropped == 1
  assert source.batched == [[0, 1, 2]] and source.single == 1  # record 3 read alone


def test_prefetcher_matches_and_tracks_state():
  plain, ahead = _sft_iter(n=10, seed=4), Prefetcher(_sft_iter(n=10, seed=4), buffer_size=3)
  for _ in range(4):
    _assert_same(next(ahead), next(plain))
    assert ahead.get_state() == plain.get_state()
  ahead.close()
  assert len(list(Prefetcher(_sft_iter(n=10, num_epochs=1)))) == 2
  bad = Prefetcher(BatchIterator([{"prompt": "1=", "answer": "1" * 20}] * 2,
                                 SFTLayout(TOK, seq_len=8), batch_size=1, **ONE_PROC))
  with pytest.raises(TooLongError, match="record"):
    next(bad)


def test_set_state_rejects_other_settings():
  state = _sft_iter(seed=1).get_state()
  with pytest.raises(ValueError, match="saved with seed=1 but this iterator has seed=2"):
    _sft_iter(seed=2).set_state(state)
  with pytest.raises(ValueError, match="num_records=40 .* has num_records=41"):
    _sft_iter(n=41, seed=1).set_state(state)
  with pytest.raises(ValueError, match="lacks"):
    _sft_iter().set_state({"epoch": 0})


def test_num_epochs_and_padded_final_batch():
  assert len(list(_sft_iter(n=10, batch_size=4, num_epochs=1))) == 2
  layout = SFTLayout.for_suite(CharTokenizer(TASK_ALPHABET), SUITE)
  batches = list(eval_batches(SyntheticSource(SUITE, 10, seed=1), layout, batch_size=4))
  assert len(batches) == 3
  assert np.concatenate([b["index"] for b in batches]).tolist() == list(range(10)) + [-1, -1]
  assert batches[-1]["row_mask"].tolist() == [True, True, False, False]
  assert not batches[-1]["valid"][2:].any() and not batches[-1]["loss_mask"][2:].any()


def test_too_long_records_raise_or_drop():
  records = [{"prompt": "1=", "answer": "1"}] * 5 + [{"prompt": "1=", "answer": "1" * 20}] * 2
  layout = SFTLayout(TOK, seq_len=8)
  it = BatchIterator(records, layout, batch_size=3, shuffle=False, **ONE_PROC)
  next(it)
  before = it.get_state()
  with pytest.raises(TooLongError, match="record 5: example needs"):
    next(it)
  assert it.get_state() == before  # a failed batch does not move the cursor
  it = BatchIterator(records, layout, batch_size=3, shuffle=False, drop_long=True, **ONE_PROC)
  indices = [next(it)["index"].tolist() for _ in range(3)]
  assert indices == [[0, 1, 2], [3, 4, 0], [1, 2, 3]] and it.dropped == 2
  hopeless = BatchIterator(records[5:] * 3, layout, batch_size=2, drop_long=True, **ONE_PROC)
  with pytest.raises(ValueError, match="none fits the layout"):
    next(hopeless)


def test_iterator_argument_errors():
  layout = SFTLayout(TOK, seq_len=8)
  records = [{"prompt": "1=", "answer": "1"}] * 6
  with pytest.raises(ValueError, match="fewer than batch_size=4"):
    BatchIterator(records, layout, batch_size=4, process_index=0, process_count=2)
  with pytest.raises(ValueError, match="fewer than process_count"):
    BatchIterator(records[:1], layout, batch_size=1, process_index=0, process_count=2)
  with pytest.raises(ValueError, match="batch_size must be a positive int"):
    BatchIterator(records, layout, batch_size=0, **ONE_PROC)
  with pytest.raises(TypeError, match="layout must be"):
    BatchIterator(records, "sft", batch_size=2, **ONE_PROC)


# -- packing -----------------------------------------------------------------------------------

DOCS = [{"text": "hello world"}, {"text": "abc"}, {"text": "a longer document here"}]


def _packed(**kwargs):
  return BatchIterator(DOCS, PackedLayout(ByteTokenizer(), 16), batch_size=2,
                       **{**ONE_PROC, "shuffle": False, **kwargs})


def test_packed_rows_concatenate_documents():
  tok = ByteTokenizer()
  batch = next(_packed())
  assert tok.decode(batch["tokens"][0], skip_special=False) == "hello world<|eos|>abc<|eos|>"
  assert tok.decode(batch["tokens"][1]) == "a longer documen"
  assert batch["segment_ids"][0].tolist() == [1] * 12 + [2] * 4
  assert batch["positions"].tolist() == [list(range(16))] * 2
  assert batch["loss_mask"].all() and batch["valid"].all() and not batch["prompt_mask"].any()
  assert batch["index"].tolist() == [0, 2]
  stream = np.concatenate([b["tokens"].ravel() for b in _packed(num_epochs=3)])
  docs = np.concatenate([tok.encode(d["text"]) + [tok.eos_id] for d in DOCS] * 3)
  np.testing.assert_array_equal(stream, docs[:len(stream)])
  assert len(stream) == (len(docs) // 32) * 32


def test_packed_padded_tail_and_bos():
  batches = list(_packed(num_epochs=1, pad_final_batch=True))
  last = batches[-1]
  total = sum(len(d["text"]) + 1 for d in DOCS)  # ASCII text and one EOS per document
  assert len(batches) == 2 and last["valid"][0].sum() == total - 32 and not last["row_mask"][1]
  assert (last["tokens"][0][~last["valid"][0]] == ByteTokenizer().pad_id).all()
  it = BatchIterator(DOCS, PackedLayout(ByteTokenizer(), 8, add_bos=True), batch_size=1,
                     shuffle=False, **ONE_PROC)
  assert next(it)["tokens"][0].tolist()[:2] == [ByteTokenizer().bos_id, ord("h") + 4]


@pytest.mark.parametrize("consumed", [1, 2, 5])
def test_packed_resume_mid_document(consumed):
  reference = _packed(seed=2, shuffle=True)
  expected = [next(reference) for _ in range(consumed + 4)][consumed:]
  first = _packed(seed=2, shuffle=True)
  for _ in range(consumed):
    next(first)
  resumed = _packed(seed=2, shuffle=True)
  resumed.set_state(json.loads(json.dumps(first.get_state())))
  for want in expected:
    _assert_same(next(resumed), want)
