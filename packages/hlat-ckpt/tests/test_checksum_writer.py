"""Checksums computed while DCP writes (hlat_ckpt.checksum_writer) and how they reach the
manifest; the fsyncs of a save."""

import collections
import io
import json
import os
import threading
import zipfile
import zlib

import pytest
import torch
from ckpt_helpers import make_state

import hlat_ckpt.policy
from hlat_ckpt import MANIFEST_NAME, Checkpointer, CheckpointError
from hlat_ckpt.checksum_writer import OVERLAP_BYTES, ChecksumFileSystem, zip_crc_skipped
from hlat_ckpt.manifest import checksum_files, file_checksum
from hlat_ckpt.storage import Storage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def crc_of(data: bytes) -> str:
    return f"crc32:{zlib.crc32(data):08x}"


def test_a_stream_checksums_exactly_the_bytes_written_in_order(tmp_path):
    fs = ChecksumFileSystem()
    big = torch.arange(OVERLAP_BYTES // 2, dtype=torch.float32)  # 2 MiB: hashed beside the write
    pieces = [b"header", memoryview(big.numpy()), bytearray(b"x" * 1000), b""]
    with fs.create_stream(tmp_path / "f", "wb") as stream:
        for piece in pieces:
            before = stream.tell()
            assert stream.write(piece) == memoryview(piece).nbytes
            assert stream.tell() == before + memoryview(piece).nbytes
            # fileno() flushes first, so an fsync of it covers every byte written so far
            assert os.fstat(stream.fileno()).st_size == stream.tell()
        stream.close()  # DCP closes inside the with block; the exit closes again
    data = (tmp_path / "f").read_bytes()
    assert len(data) == 6 + big.numel() * 4 + 1000
    assert fs.checksums(tmp_path) == {"f": (crc_of(data), len(data))}
    assert fs.checksums(tmp_path)["f"][0] == file_checksum(Storage(tmp_path), "", "f")


def test_a_write_out_of_order_drops_the_checksum_and_renames_carry_it(tmp_path):
    fs = ChecksumFileSystem()
    with fs.create_stream(tmp_path / "kept", "wb") as stream:
        stream.write(b"abc")
        stream.seek(0, os.SEEK_END)  # a seek to where the next write goes anyway
        stream.write(b"def")
    with fs.create_stream(tmp_path / "seeked", "wb") as stream:
        stream.write(b"abcdef")
        stream.seek(1)
        stream.write(b"X")
    with fs.create_stream(tmp_path / "gone", "wb") as stream:
        stream.write(b"1")
    fs.rm_file(tmp_path / "gone")
    with fs.create_stream(tmp_path / "meta.tmp", "wb") as stream:
        stream.write(b"meta")
    fs.rename(tmp_path / "meta.tmp", tmp_path / "meta")
    with fs.create_stream(tmp_path / "meta", "rb") as stream:  # reading changes nothing
        assert stream.read() == b"meta"
    assert fs.checksums(tmp_path) == {
        "kept": (crc_of(b"abcdef"), 6),
        "meta": (crc_of(b"meta"), 4),
    }


def test_a_failed_write_records_no_checksum(tmp_path):
    fs = ChecksumFileSystem()
    with pytest.raises(TypeError), fs.create_stream(tmp_path / "f", "wb") as stream:
        stream.write(b"abc")
        stream.write("not bytes")
    assert fs.checksums(tmp_path) == {}


def big_state() -> dict:
    torch.manual_seed(0)
    state = make_state(0)
    state["wide"] = torch.nn.Linear(1024, 1024)  # a 4 MiB weight: one write of >= 1 MiB
    return state


@pytest.mark.parametrize(
    ("async_save", "io_threads"),
    [(False, 1), (True, 1), (False, 2)],
    ids=["sync", "async", "sync-2-threads"],
)
def test_a_local_save_records_the_checksums_of_the_write_and_reads_nothing_back(
    tmp_path, monkeypatch, async_save, io_threads
):
    def no_read_back(storage, dirname, names):
        names = list(names)
        assert not names, f"read back {names}"
        return {}

    monkeypatch.setattr(hlat_ckpt.policy, "checksum_files", no_read_back)
    ck = Checkpointer(tmp_path, async_save=async_save, io_threads=io_threads)
    state = big_state()
    ck.save(1, state)
    ck.wait()
    (stats,) = ck.pop_save_stats()
    manifest = json.loads((tmp_path / "step_0000000001" / MANIFEST_NAME).read_text())
    shards = {f"__0_{i}.distcp" for i in range(io_threads)}  # one file per writing thread
    assert set(manifest["files"]) == {*shards, ".metadata"}
    assert stats.checksums_in_write == stats.files == io_threads + 1
    storage = Storage(tmp_path)
    fresh = checksum_files(storage, "step_0000000001", manifest["files"])
    assert manifest["checksums"] == fresh
    monkeypatch.undo()

    # the recorded checksums are what load checks: a flipped byte is still caught
    assert Checkpointer(tmp_path).load_latest(big_state()) == 1
    shard = tmp_path / "step_0000000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"file __0_0\.distcp has checksum crc32:"):
        Checkpointer(tmp_path).load(1, big_state())


class ExtraFileCheckpointer(Checkpointer):
    """Adds a file of its own to each checkpoint, beside DCP's, and reports a wrong byte
    count with the checksum that the write computed for ``.metadata``."""

    def _commit(self, dirname, written):
        with open(os.path.join(self._storage.path(dirname), "extra.bin"), "wb") as f:
            f.write(b"written by another path")
        _, nbytes = written.checksums[".metadata"]
        written.checksums[".metadata"] = ("crc32:00000000", nbytes + 1)
        super()._commit(dirname, written)


def test_files_without_a_whole_checksum_from_the_write_are_read_back(tmp_path):
    ck = ExtraFileCheckpointer(tmp_path, async_save=False, io_threads=1)
    ck.save(1, make_state(0))
    manifest = json.loads((tmp_path / "step_0000000001" / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {"__0_0.distcp", ".metadata", "extra.bin"}
    fresh = checksum_files(Storage(tmp_path), "step_0000000001", manifest["files"])
    assert manifest["checksums"] == fresh  # not the write's claim for .metadata
    stats = ck.last_save
    assert stats is not None and (stats.files, stats.checksums_in_write) == (3, 1)
    assert Checkpointer(tmp_path).load_latest(make_state(1)) == 1


@pytest.fixture
def s3_root(request):
    return request.getfixturevalue("s3_bucket")


def test_on_s3_the_commit_reads_the_files_back(s3_root):
    url, options = s3_root
    ck = Checkpointer(f"{url}/run", storage_options=options, async_save=False)
    ck.save(1, make_state(0))
    stats = ck.last_save
    assert stats is not None and stats.files == 2 and stats.checksums_in_write == 0
    storage = Storage(f"{url}/run", options)
    manifest = json.loads(storage.read_bytes("step_0000000001", MANIFEST_NAME))
    fresh = checksum_files(storage, "step_0000000001", manifest["files"])
    assert manifest["checksums"] == fresh


def test_each_file_and_directory_is_fsynced_once_with_all_its_bytes(tmp_path, monkeypatch):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name the fsynced files")
    real_fsync = os.fsync
    synced: list[tuple[str, int]] = []

    def spy(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real_fsync(fd)

    root = tmp_path / "ckpt"
    ck = Checkpointer(root, async_save=False, save_rng=False, io_threads=1)
    # a small state: DCP's .metadata stays smaller than the file's write buffer
    state = {"model": torch.nn.Linear(4, 4)}
    ck.save(1, state)
    monkeypatch.setattr(os, "fsync", spy)
    ck.save(2, state)
    monkeypatch.undo()
    counts = collections.Counter(path for path, _ in synced)
    assert all(n == 1 for n in counts.values()), counts
    tmp = str(root / "step_0000000002.tmp")
    final = root / "step_0000000002"
    by_name = {}
    for path, size in synced:
        if path.startswith(tmp + "/"):
            by_name[path[len(tmp) + 1 :]] = size
    manifest_part = [n for n in by_name if n.startswith(MANIFEST_NAME)]
    assert set(counts) == {tmp, str(root), *(f"{tmp}/{n}" for n in by_name)}, counts
    assert set(by_name) == {"__0_0.distcp", ".metadata.tmp", *manifest_part}, by_name
    assert len(manifest_part) == 1
    # every file's fsync came after its last byte (DCP's .metadata included)
    assert by_name["__0_0.distcp"] == (final / "__0_0.distcp").stat().st_size
    assert by_name[".metadata.tmp"] == (final / ".metadata").stat().st_size
    assert by_name[manifest_part[0]] == (final / MANIFEST_NAME).stat().st_size


def zip_records(shard, metadata):
    """``{fqn: [(record name, its zip header's CRC-32)]}`` of the tensors DCP wrote
    into ``shard``: each is a ``torch.save`` zip at the offset its metadata gives."""
    data = shard.read_bytes()
    found = {}
    for index, info in metadata.storage_data.items():
        if info.relative_path != shard.name:
            continue
        piece = io.BytesIO(data[info.offset : info.offset + info.length])
        with zipfile.ZipFile(piece) as z:
            found[index.fqn] = [(i.filename, i.CRC) for i in z.infolist()]
    return found


@pytest.mark.parametrize("io_threads", [1, 2], ids=["1-thread", "2-threads"])
@pytest.mark.parametrize("user_option", [True, False], ids=["crc-on", "crc-off"])
def test_torch_save_writes_no_record_crc_into_a_checkpoint_and_the_option_comes_back(
    tmp_path, user_option, io_threads
):
    import torch.distributed.checkpoint as dcp

    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(user_option)
    try:
        state = big_state()
        ck = Checkpointer(tmp_path, async_save=False, io_threads=io_threads)
        ck.save(1, state)
        assert torch.serialization.get_crc32_options() is user_option
        folder = tmp_path / "step_0000000001"
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        records = {}
        for i in range(io_threads):  # each writing thread's file
            shard = folder / f"__0_{i}.distcp"
            found = zip_records(shard, metadata)
            assert found, shard.name
            records.update(found)
            # the manifest's checksum of the whole file is still what a load checks
            assert manifest["checksums"][shard.name] == crc_of(shard.read_bytes())
        assert "wide/weight" in records
        for fqn, entries in records.items():
            data = [(name, crc) for name, crc in entries if "/data/" in name]
            assert data and all(crc == 0 for _, crc in data), (fqn, entries)
        loaded = big_state()
        with torch.no_grad():
            loaded["wide"].weight.zero_()
        assert Checkpointer(tmp_path).load_latest(loaded) == 1
        assert torch.equal(loaded["wide"].weight, state["wide"].weight)

        # a plain torch.save outside a checkpoint keeps the user's option
        buf = io.BytesIO()
        torch.save(torch.arange(10.0), buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            crcs = [i.CRC for i in z.infolist() if "/data/" in i.filename]
        assert (crcs[0] != 0) is user_option
    finally:
        torch.serialization.set_crc32_options(before)


def test_overlapping_checkpoint_writes_restore_the_option_when_the_last_one_ends():
    first_in, second_done, order = threading.Event(), threading.Event(), []

    def first():
        with zip_crc_skipped():
            first_in.set()
            second_done.wait(10)
            order.append(("first, after the second ended", torch.serialization.get_crc32_options()))
        order.append(("after both", torch.serialization.get_crc32_options()))

    assert torch.serialization.get_crc32_options() is True
    t = threading.Thread(target=first)
    t.start()
    assert first_in.wait(10)
    with zip_crc_skipped():
        order.append(("second", torch.serialization.get_crc32_options()))
    second_done.set()
    t.join(10)
    assert order == [
        ("second", False),
        ("first, after the second ended", False),
        ("after both", True),
    ]
