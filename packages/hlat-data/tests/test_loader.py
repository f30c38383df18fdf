from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from data_helpers import BATCH, SEQ, assert_same_batches, deadline, make_loader

from hlat_data import IGNORE_INDEX, ArrowSource, DataError, JsonlSource, PackedLoader, Tokenizer
from hlat_data.packer import Chunk, Packer


@pytest.fixture(scope="module")
def source(corpus):
    return ArrowSource(corpus)


@pytest.fixture(scope="module")
def reference(source, tokenizer):
    """Two and a half epochs, uninterrupted, with the state after each batch."""
    loader = make_loader(source, tokenizer)
    batches, states = [], []
    epoch_batches = None
    for batch in loader:
        batches.append(batch)
        states.append(loader.state_dict())
        if states[-1]["epoch"] == 1 and epoch_batches is None:
            epoch_batches = len(batches)
        if states[-1]["epoch"] == 2 and states[-1]["position"] >= 10:
            break
    return batches, states, epoch_batches


def cut_points(reference):
    batches, _, epoch_batches = reference
    # the start, mid-epoch, the batch that straddles the epoch boundary, and the one after
    return [0, epoch_batches // 2, epoch_batches - 1, epoch_batches, len(batches) - 5]


def test_reference_run_crosses_epoch_boundaries(reference):
    batches, states, epoch_batches = reference
    assert 20 < epoch_batches < len(batches) - 10
    assert states[-1]["epoch"] == 2


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_resume_gives_the_same_batches_as_the_uninterrupted_run(
    source, tokenizer, reference, workers
):
    batches = reference[0]
    for cut in cut_points(reference):
        first = make_loader(source, tokenizer, num_workers=workers)
        head = list(itertools.islice(first, cut))
        state = first.state_dict()
        second = make_loader(source, tokenizer, num_workers=(workers + 1) % 3)
        second.load_state_dict(state)
        tail = list(itertools.islice(second, len(batches) - cut))
        assert_same_batches(batches, head + tail)


def test_state_is_small_plain_data_independent_of_workers(source, tokenizer, reference):
    state = reference[1][30]
    assert set(state) >= {"epoch", "position", "offset", "seed", "fingerprint", "batches"}
    assert all(isinstance(state[k], int) for k in ("epoch", "position", "offset", "batches"))
    assert len(repr(state)) < 600


def test_batches_do_not_depend_on_the_number_of_workers(source, tokenizer, reference):
    batches = reference[0][:40]
    assert_same_batches(
        batches,
        list(itertools.islice(make_loader(source, tokenizer, num_workers=2, chunk_docs=3), 40)),
    )


def test_batches_are_the_same_with_and_without_the_word_cache(source, tokenizer_path, reference):
    plain = Tokenizer.from_file(tokenizer_path, num_threads=1, cache_size=0)
    assert plain.word_cache is None
    batches = reference[0][:40]
    assert_same_batches(batches, list(itertools.islice(make_loader(source, plain), 40)))
    cached = Tokenizer.from_file(tokenizer_path, num_threads=1)
    assert cached.word_cache is not None
    workers = make_loader(source, cached, num_workers=2, chunk_docs=3)  # a cache in each
    assert_same_batches(batches, list(itertools.islice(workers, 40)))


def test_spawned_workers_give_the_same_batches(source, tokenizer, reference):
    loader = make_loader(source, tokenizer, num_workers=1, mp_context="spawn")
    assert_same_batches(reference[0][:20], list(itertools.islice(loader, 20)))


def test_an_unknown_start_method_is_an_error_naming_the_platform_s(source, tokenizer):
    with pytest.raises(DataError, match=r"mp_context 'threads' is not a start method .*spawn"):
        make_loader(source, tokenizer, num_workers=1, mp_context="threads")


def test_every_row_is_exact_with_next_token_labels_and_consistent_positions(reference, tokenizer):
    batches = reference[0]
    stream = np.concatenate([b.input_ids.reshape(-1) for b in batches])
    for k, batch in enumerate(batches):
        assert (
            batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (BATCH, SEQ)
        )
        flat_labels = batch.labels.reshape(-1)
        np.testing.assert_array_equal(flat_labels[:-1], batch.input_ids.reshape(-1)[1:])
        if k + 1 < len(batches):
            assert flat_labels[-1] == stream[(k + 1) * BATCH * SEQ]
        for row in range(BATCH):
            ids, positions, lens = (
                batch.input_ids[row],
                batch.position_ids[row],
                batch.doc_lens[row],
            )
            lens = lens[lens > 0]
            assert lens.sum() == SEQ
            np.testing.assert_array_equal(positions, np.concatenate([np.arange(n) for n in lens]))
            # every segment but the last ends with EOS; the next one starts after it
            ends = np.cumsum(lens)[:-1] - 1
            assert (ids[ends] == tokenizer.eos_id).all()
            eos_inside = np.flatnonzero(ids[:-1] == tokenizer.eos_id)
            np.testing.assert_array_equal(eos_inside, ends)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_an_epoch_packs_every_document_once_across_ranks(source, tokenizer, documents, dp_size):
    expected = sorted(tuple(tokenizer.encode(d)) for d in documents if d)
    seen, packed, counts = [], 0, []
    for rank in range(dp_size):
        loader = make_loader(
            source, tokenizer, dp_rank=rank, dp_size=dp_size, num_epochs=1, drop_last=False
        )
        batches = list(loader)
        counts.append(len(batches))
        real = [b.input_ids.reshape(-1)[: b.doc_lens.sum()] for b in batches]
        packed += sum(len(r) for r in real)
        stream = np.concatenate(real)
        assert stream[-1] == tokenizer.eos_id
        cuts = np.flatnonzero(stream == tokenizer.eos_id)
        seen += [tuple(doc) for doc in np.split(stream, cuts + 1)[:-1]]
        seen = [tuple(d[:-1]) if d and d[-1] == tokenizer.eos_id else d for d in seen]
        assert loader.empty_documents == (
            1 if any(not documents[i] for i in loader.share(0).documents(0, len(documents))) else 0
        )
    assert sorted(seen) == expected
    assert packed == sum(len(d) for d in expected) + len(expected)  # + one EOS each
    if dp_size == 2:  # ranks hold the same blocks, not the same tokens (README: Epochs)
        assert counts[0] != counts[1], counts


def test_final_partial_batch_is_padded_past_doc_lens(source, tokenizer):
    last = list(make_loader(source, tokenizer, num_epochs=1, drop_last=False))[-1]
    real = int(last.doc_lens.sum())
    assert 0 < real < BATCH * SEQ
    assert (last.labels.reshape(-1)[real - 1 :] == IGNORE_INDEX).all()
    assert last.input_ids.shape == (BATCH, SEQ)
    # the real tokens keep their next-token labels, within each row and across rows
    np.testing.assert_array_equal(
        last.labels.reshape(-1)[: real - 1], last.input_ids.reshape(-1)[1:real]
    )
    for row, n in enumerate(last.doc_lens.sum(-1)):
        if n:
            np.testing.assert_array_equal(last.labels[row, : n - 1], last.input_ids[row, 1:n])


@pytest.mark.parametrize("count", [2, 5, 8])
def test_a_partial_batch_labels_each_real_token_with_the_next(count):
    packer = Packer(seq_len=4, micro_batch_size=2)
    packer.push(Chunk(0, 0, np.arange(10, 10 + count), np.array([count])))
    batch = packer.pop_partial()
    expected = np.full(8, IGNORE_INDEX)
    expected[: count - 1] = np.arange(11, 10 + count)
    np.testing.assert_array_equal(batch.labels.reshape(-1), expected)
    assert packer.pop_partial() is None


def test_a_single_token_left_makes_no_batch():
    packer = Packer(seq_len=4, micro_batch_size=2)  # n = 8
    packer.push(Chunk(0, 0, np.arange(1, 10), np.array([9])))  # n + 1 tokens
    np.testing.assert_array_equal(packer.pop().labels.reshape(-1), np.arange(2, 10))
    assert packer.pop_partial() is None
    assert packer.buffered == 0 and packer.cursor() == (0, 1, 0)
    assert packer.pop_partial() is None


def test_a_final_single_token_yields_no_batch_without_labels(source, tokenizer, documents):
    # one row per batch, of a length that leaves exactly one token after the last full batch
    total = sum(len(tokenizer.encode(d)) + 1 for d in documents if d)
    seq_len = next(s for s in range(16, total) if (total - 1) % s == 0)
    kwargs = dict(seq_len=seq_len, micro_batch_size=1, num_epochs=1, drop_last=False)
    loader = make_loader(source, tokenizer, **kwargs)
    batches, states = [], []
    for batch in loader:
        batches.append(batch)
        states.append(loader.state_dict())
    assert len(batches) == (total - 1) // seq_len
    assert all((b.labels != IGNORE_INDEX).any() for b in batches)
    resumed = make_loader(source, tokenizer, **kwargs)
    resumed.load_state_dict(states[-2])
    assert_same_batches(batches[-1:], list(resumed))


def test_bos_and_eos_surround_each_document(source, tokenizer):
    batch = next(iter(make_loader(source, tokenizer, add_bos=True, shuffle=False, block_size=1)))
    ids = batch.input_ids.reshape(-1)
    assert ids[0] == tokenizer.bos_id
    first_eos = int(np.flatnonzero(ids == tokenizer.eos_id)[0])
    assert ids[first_eos + 1] == tokenizer.bos_id
    assert batch.position_ids.reshape(-1)[first_eos + 1] == 0


@pytest.mark.parametrize("add_bos", [False, True])
def test_a_document_that_encodes_to_no_tokens_is_empty(tmp_path, documents, add_bos):
    """Whitespace under a normalising model (SentencePiece's default ``nmt_nfkc``) encodes
    to nothing: the document is skipped and counted, with no EOS (or BOS) of its own."""
    import pyarrow as pa
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([d for d in documents if d.strip()]),
        model_prefix=str(tmp_path / "nfkc"),
        model_type="bpe",
        vocab_size=300,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    tokenizer = Tokenizer.from_file(tmp_path / "nfkc.model")
    texts = ["hello world", "   ", "\n\n\t", "", "more text"]
    assert [len(tokenizer.encode(t)) > 0 for t in texts] == [True, False, False, False, True]
    path = tmp_path / "ws.arrow"
    table = pa.table({"text": texts})
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    loader = PackedLoader(
        ArrowSource(path), tokenizer, 64, 1, shuffle=False, block_size=5, num_epochs=1,
        drop_last=False, add_bos=add_bos,
    )  # fmt: skip
    batch = next(iter(loader))
    extra = [tokenizer.bos_id] if add_bos else []
    expected = [extra + tokenizer.encode(t) + [tokenizer.eos_id] for t in (texts[0], texts[-1])]
    assert batch.doc_lens[0][batch.doc_lens[0] > 0].tolist() == [len(e) for e in expected]
    assert batch.input_ids[0][: len(expected[0]) + len(expected[1])].tolist() == [
        *expected[0],
        *expected[1],
    ]
    assert loader.empty_documents == 3
    # a state that points inside such a document (versions before 0.8 packed it as BOS EOS)
    # resumes at the next document
    from hlat_data.loader import _Encoder

    encoder = _Encoder(ArrowSource(path), tokenizer, add_bos=True, add_eos=True)
    resumed = encoder((0, 1, np.array([1, 4]), 1))
    assert resumed.lens.tolist() == [0, len(expected[1]) + (0 if add_bos else 1)]


def test_changed_corpus_is_an_error_naming_what_changed(
    tmp_path, source, tokenizer, documents, arrow_writer
):
    state = make_loader(source, tokenizer).state_dict()
    other = ArrowSource(arrow_writer(tmp_path / "corpus.arrow", documents[:-3]))
    with pytest.raises(
        DataError, match=r"source changed: documents: state has 49, this loader has 46$"
    ):
        make_loader(other, tokenizer).load_state_dict(state)
    with pytest.raises(
        DataError, match=r"source changed: max_chars: state has 500000, this loader has 900$"
    ):
        make_loader(ArrowSource(source.files, max_chars=900), tokenizer).load_state_dict(state)
    renamed = arrow_writer(tmp_path / "renamed.arrow", documents)
    with pytest.raises(
        DataError, match=r"source changed: the files' base names, sizes or row counts differ"
    ):
        make_loader(ArrowSource(renamed), tokenizer).load_state_dict(state)
    # a state whose fingerprint names none of the source's settings is checked by its hash
    bare = dict(state, fingerprint=dict(state["fingerprint"]))
    bare["fingerprint"]["source"] = {
        k: v for k, v in state["fingerprint"]["source"].items() if k in ("hash", "documents")
    }
    make_loader(source, tokenizer).load_state_dict(bare)


def test_a_run_stopped_by_a_null_text_resumes_skipping_nulls(tmp_path, tokenizer, documents,
                                                             arrow_writer):  # fmt: skip
    texts = [d for d in documents if d][:40]
    texts[30] = None
    path = arrow_writer(tmp_path / "nulls.arrow", texts, batch_rows=8)
    kwargs = dict(seq_len=32, shuffle=False, block_size=8, num_epochs=1)
    assert ArrowSource(path).fingerprint() == ArrowSource(path, nulls="skip").fingerprint()
    stopped = make_loader(ArrowSource(path), tokenizer, **kwargs)
    head = []
    with pytest.raises(DataError, match=r"row 30 has a null 'text'"):
        for batch in stopped:
            head.append(batch)
    assert head
    resumed = make_loader(ArrowSource(path, on_bad_record="skip"), tokenizer, **kwargs)
    resumed.load_state_dict(stopped.state_dict())
    whole = list(make_loader(ArrowSource(path, on_bad_record="skip"), tokenizer, **kwargs))
    assert_same_batches(whole, head + list(resumed))
    assert resumed.bad_records == 1


def test_changed_tokenizer_seed_or_separators_are_errors(
    source, tokenizer, tokenizer_path, tmp_path
):
    from hlat_data import train_tokenizer

    state = make_loader(source, tokenizer).state_dict()
    with pytest.raises(DataError, match=r"seed: state has 7, this loader has 8"):
        make_loader(source, tokenizer, seed=8).load_state_dict(state)
    with pytest.raises(DataError, match=r"packing changed"):
        make_loader(source, tokenizer, add_bos=True).load_state_dict(state)
    text = tmp_path / "t.txt"
    text.write_text("different text for a different model\n" * 50)
    other = Tokenizer.from_file(train_tokenizer(str(text), tmp_path / "o", vocab_size=300))
    with pytest.raises(DataError, match=r"tokenizer changed"):
        make_loader(source, other).load_state_dict(state)


def test_loading_another_ranks_state_is_an_error(source, tokenizer):
    state = make_loader(source, tokenizer, dp_rank=1, dp_size=2).state_dict()
    with pytest.raises(DataError, match=r"state is rank 1 of 2, this loader is rank 0 of 2"):
        make_loader(source, tokenizer, dp_rank=0, dp_size=2).load_state_dict(state)


def test_missing_tokenizer_file_is_an_error_with_a_remedy(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer file .*nope\.model not found.*train-tokenizer"):
        Tokenizer.from_file(tmp_path / "nope.model")


def test_invalid_arguments_are_errors_before_any_work(source, tokenizer):
    with pytest.raises(DataError, match=r"seq_len must be at least 1"):
        make_loader(source, tokenizer, seq_len=0)
    with pytest.raises(DataError, match=r"fewer than dp_size 64"):
        make_loader(source, tokenizer, dp_rank=0, dp_size=64)
    for seed in (-1, 1.5, "7", None):
        with pytest.raises(DataError, match=rf"seed must be an integer of 0 or more, got {seed!r}"):
            make_loader(source, tokenizer, seed=seed)
    make_loader(source, tokenizer, seed=np.int64(2**40))


@pytest.mark.parametrize("epochs", [1.5, 2.0, True, "2", 0])
def test_num_epochs_must_be_an_integer(source, tokenizer, epochs):
    with pytest.raises(
        DataError, match=rf"num_epochs must be an integer of at least 1 or None, got {epochs!r}"
    ):
        make_loader(source, tokenizer, num_epochs=epochs)


def test_reading_from_s3_gives_the_same_batches_as_the_local_file(
    corpus, tokenizer, s3_bucket, reference
):
    import fsspec

    url, options = s3_bucket
    fsspec.filesystem("s3", **options).put(str(corpus), f"{url}/corpus.arrow")
    remote = ArrowSource(f"{url}/corpus.arrow", storage_options=options)
    batches = list(itertools.islice(make_loader(remote, tokenizer, num_workers=1), 60))
    assert_same_batches(reference[0][:60], batches)


def test_hlat_data_imports_and_packs_without_torch(corpus, tokenizer_path):
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked")
sys.meta_path.insert(0, Block())
from hlat_data import ArrowSource, PackedLoader, Tokenizer
loader = PackedLoader(ArrowSource({str(corpus)!r}), Tokenizer.from_file({tokenizer_path!r}), 32, 2, block_size=4)
batch = next(iter(loader))
assert "torch" not in sys.modules
print(batch.input_ids.shape)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(2, 32)"


def test_a_corpus_of_more_files_than_the_descriptor_limit_is_read(tmp_path, tokenizer_path):
    import gzip
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    count = 300
    for i in range(count):
        line = json.dumps({"text": f"document {i} of the corpus"}).encode() + b"\n"
        (tmp_path / f"{i:03d}.jsonl").write_bytes(line)
        (tmp_path / f"{i:03d}.jsonl.gz").write_bytes(gzip.compress(line))
        table = pa.table({"text": [f"document {i} of the corpus"]})
        with pa.ipc.new_file(tmp_path / f"{i:03d}.arrow", table.schema) as writer:
            writer.write_table(table)
        pq.write_table(table, tmp_path / f"{i:03d}.parquet")
    code = f"""
import os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from hlat_data import ArrowSource, JsonlSource, PackedLoader, Tokenizer
from hlat_data.source import _OPEN_FILES
base = len(os.listdir("/proc/self/fd"))
for cls, pattern in [(JsonlSource, "*.jsonl"), (JsonlSource, "*.jsonl.gz"),
                     (ArrowSource, "*.arrow"), (ArrowSource, "*.parquet")]:
    source = cls(os.path.join({str(tmp_path)!r}, pattern))
    for _ in range(2):
        texts = [source.text(i) for i in range(len(source))]
        assert texts == [f"document {{i}} of the corpus" for i in range({count})], pattern
    assert len(os.listdir("/proc/self/fd")) <= base + _OPEN_FILES, pattern
    tokenizer = Tokenizer.from_file({tokenizer_path!r})
    loader = PackedLoader(source, tokenizer, 16, 1, block_size=8, num_epochs=2, drop_last=False)
    real = (b.input_ids.reshape(-1)[: b.doc_lens.sum()] for b in loader)
    print(pattern, sum(int((ids == tokenizer.eos_id).sum()) for ids in real))
    del source, loader
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        word
        for pattern in ("*.jsonl", "*.jsonl.gz", "*.arrow", "*.parquet")
        for word in (pattern, str(2 * count))
    ]


def _consumed(source, tokenizer, dp_size, steps):
    """Run each of ``dp_size`` ranks for ``steps`` batches; their states and loaders."""
    loaders = [
        make_loader(source, tokenizer, dp_rank=r, dp_size=dp_size, block_size=2)
        for r in range(dp_size)
    ]
    for loader in loaders:
        list(itertools.islice(loader, steps))
    return [loader.state_dict() for loader in loaders], loaders


@pytest.mark.parametrize(("old", "new"), [(2, 3), (4, 1), (1, 2)])
def test_changing_dp_size_mid_epoch_reads_every_document_of_the_epoch_once(
    source, tokenizer, old, new
):
    from hlat_data import merge_states

    states, loaders = _consumed(source, tokenizer, old, steps=40)
    assert {s["epoch"] for s in states} == {0}
    read = [
        loader.share(0).documents(0, s["position"] + (1 if s["offset"] else 0))
        for loader, s in zip(loaders, states, strict=True)
    ]
    merged = merge_states(states)
    resumed = [
        make_loader(source, tokenizer, dp_rank=r, dp_size=new, block_size=2) for r in range(new)
    ]
    for loader in resumed:
        loader.load_state_dict(merged)
        read.append(loader.share(0).documents(0, len(loader.share(0))))
        assert loader.state_dict()["epoch"] == 0
    seen = np.concatenate(read)
    assert np.array_equal(np.sort(seen), np.arange(len(source)))
    # the next epoch follows the new layout
    nxt = np.concatenate([loader.share(1).documents(0, 10**6) for loader in resumed])
    assert np.array_equal(np.sort(nxt), np.arange(len(source)))


def test_a_resumed_layout_itself_resumes_exactly(source, tokenizer):
    from hlat_data import merge_states

    states, _ = _consumed(source, tokenizer, 2, steps=30)
    first = make_loader(source, tokenizer, dp_rank=1, dp_size=3, block_size=2)
    first.load_state_dict(merge_states(states))
    expected = list(itertools.islice(first, 30))
    again = make_loader(source, tokenizer, dp_rank=1, dp_size=3, block_size=2)
    again.load_state_dict(merge_states(states))
    head = list(itertools.islice(again, 12))
    state = again.state_dict()
    assert state["resumed_from"] is not None
    last = make_loader(source, tokenizer, dp_rank=1, dp_size=3, block_size=2)
    last.load_state_dict(state)
    assert_same_batches(expected, head + list(itertools.islice(last, 18)))


def test_a_second_change_of_dp_size_waits_for_the_end_of_the_epoch_of_the_first(source, tokenizer):
    from hlat_data import merge_states

    states, _ = _consumed(source, tokenizer, 2, steps=20)
    three = [make_loader(source, tokenizer, dp_rank=r, dp_size=3, block_size=2) for r in range(3)]
    for loader in three:
        loader.load_state_dict(merge_states(states))
        list(itertools.islice(loader, 3))
    mid_epoch = merge_states([loader.state_dict() for loader in three])
    four = make_loader(source, tokenizer, dp_rank=0, dp_size=4, block_size=2)
    with pytest.raises(DataError, match=r"dp_size changed again \(3 -> 4\) before the epoch"):
        four.load_state_dict(mid_epoch)
    for loader in three:  # into the next epoch, which is laid out for 3 ranks
        while loader.state_dict()["epoch"] == 0:
            next(iter(loader))
    four.load_state_dict(merge_states([loader.state_dict() for loader in three]))
    assert four.state_dict()["epoch"] == 1


def test_a_merged_state_with_the_same_dp_size_resumes_each_rank_exactly(source, tokenizer):
    from hlat_data import merge_states

    states, _ = _consumed(source, tokenizer, 2, steps=25)
    for rank in range(2):
        expected = list(
            itertools.islice(
                make_loader(source, tokenizer, dp_rank=rank, dp_size=2, block_size=2), 35
            )
        )[25:]
        loader = make_loader(source, tokenizer, dp_rank=rank, dp_size=2, block_size=2)
        loader.load_state_dict(merge_states(states))
        assert_same_batches(expected, list(itertools.islice(loader, 10)))


def test_merging_an_incomplete_set_of_ranks_is_an_error(source, tokenizer):
    from hlat_data import merge_states

    states, _ = _consumed(source, tokenizer, 4, steps=1)
    with pytest.raises(DataError, match=r"needs ranks 0..3, got \[0, 1, 3\]"):
        merge_states([states[0], states[1], states[3]])


def test_an_error_in_a_worker_reaches_the_caller_with_its_message(
    tmp_path, tokenizer, arrow_writer
):
    path = arrow_writer(
        tmp_path / "nulls.arrow", ["fine text"] * 30 + [None] + ["more"] * 9, batch_rows=8
    )
    loader = make_loader(ArrowSource(path), tokenizer, num_workers=1, shuffle=False, block_size=8)
    with pytest.raises(DataError, match=r"nulls\.arrow: row 30 has a null 'text'"):
        list(itertools.islice(loader, 1000))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_corpus_without_tokens_is_an_error_not_an_endless_loop(
    tmp_path, tokenizer, arrow_writer, workers
):
    empty = ArrowSource(arrow_writer(tmp_path / "empty.arrow", [""] * 12))
    nothing = r"empty\.arrow gives no tokens: all of its 12 documents"
    with pytest.raises(DataError, match=nothing), deadline(30):
        next(iter(make_loader(empty, tokenizer, num_workers=workers)))
    # every record bad and skipped; dp 2: each epoch deals the ranks other blocks, until
    # every block has been seen empty
    lines = "".join(f'{{"body": "document {i}"}}\n' for i in range(12))
    (tmp_path / "bad.jsonl").write_text(lines)
    bad = JsonlSource(tmp_path / "bad.jsonl", on_bad_record="skip")
    for rank in range(2):
        loader = make_loader(bad, tokenizer, dp_rank=rank, dp_size=2, num_workers=workers)
        nothing = r"bad\.jsonl gives no tokens.*bad records read"
        with pytest.raises(DataError, match=nothing), deadline(30):
            next(iter(loader))


def test_a_rank_without_tokens_is_an_error_only_when_it_would_never_get_one(
    tmp_path, tokenizer, documents, arrow_writer
):
    # blocks of two: block 0 holds text, the three others are empty
    texts = [documents[1], documents[2]] + [""] * 6
    source = ArrowSource(arrow_writer(tmp_path / "mostly_empty.arrow", texts))
    # without shuffling rank 1 reads blocks 1 and 3 in every epoch
    kwargs = dict(seq_len=16, micro_batch_size=1, block_size=2, dp_size=2)
    nothing = r"rank 1 of 2 gets no tokens from .*mostly_empty\.arrow"
    with pytest.raises(DataError, match=nothing), deadline(30):
        next(iter(make_loader(source, tokenizer, dp_rank=1, shuffle=False, **kwargs)))
    rank_0 = make_loader(source, tokenizer, shuffle=False, **kwargs)
    with deadline(30):
        assert len(list(itertools.islice(rank_0, 3))) == 3
    # shuffled, a rank whose share of an epoch is empty reads on to block 0 in a later one
    # (rank 1 gets blocks 2 and 3 in epoch 0, block 0 in epoch 1)
    encoded = set(tokenizer.encode(texts[0]) + tokenizer.encode(texts[1]) + [tokenizer.eos_id])
    epochs = []
    for rank in range(2):
        loader = make_loader(source, tokenizer, dp_rank=rank, **kwargs)
        with deadline(30):
            batches = list(itertools.islice(loader, 3))
        assert len(batches) == 3
        assert set(np.concatenate([b.input_ids[0] for b in batches]).tolist()) <= encoded
        epochs.append(loader.epoch)
    assert epochs == [0, 1]
