import json
import zlib

import pytest

from hlat_ckpt.manifest import (
    MANIFEST_NAME,
    DamagedCheckpointError,
    IncompleteCheckpointError,
    Manifest,
    checksum_files,
    validate,
    write_manifest,
)
from hlat_ckpt.storage import Storage


@pytest.fixture
def committed(tmp_path):
    storage = Storage(tmp_path)
    storage.makedirs("step_0000000007")
    (tmp_path / "step_0000000007" / "shard").write_bytes(b"x" * 100)
    manifest = Manifest(step=7, world_size=1, entries={"model": "module"}, files={"shard": 100})
    write_manifest(storage, "step_0000000007", manifest)
    return storage, tmp_path / "step_0000000007"


def test_a_committed_checkpoint_validates(committed):
    storage, _ = committed
    assert validate(storage, "step_0000000007", 7).files == {"shard": 100}


def test_a_truncated_file_makes_it_incomplete(committed):
    storage, path = committed
    (path / "shard").write_bytes(b"x" * 99)
    with pytest.raises(
        IncompleteCheckpointError, match="shard has 99 bytes, manifest recorded 100"
    ):
        validate(storage, "step_0000000007", 7)


def test_a_missing_file_makes_it_incomplete(committed):
    storage, path = committed
    (path / "shard").unlink()
    with pytest.raises(IncompleteCheckpointError, match="shard is missing"):
        validate(storage, "step_0000000007", 7)


def test_a_torn_manifest_makes_it_incomplete(committed):
    storage, path = committed
    data = (path / MANIFEST_NAME).read_bytes()
    (path / MANIFEST_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(IncompleteCheckpointError, match="not valid JSON"):
        validate(storage, "step_0000000007", 7)


def test_a_manifest_of_another_step_is_refused(committed):
    storage, path = committed
    (path.parent / "step_0000000008").mkdir()
    (path / MANIFEST_NAME).rename(path.parent / "step_0000000008" / MANIFEST_NAME)
    with pytest.raises(IncompleteCheckpointError, match="manifest says step 7"):
        validate(storage, "step_0000000008", 8)


def test_no_manifest_means_never_committed(tmp_path):
    (tmp_path / "step_0000000001").mkdir()
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        validate(Storage(tmp_path), "step_0000000001", 1)


@pytest.fixture
def checksummed(tmp_path):
    storage = Storage(tmp_path)
    storage.makedirs("step_0000000003")
    shard = tmp_path / "step_0000000003" / "__0_0.distcp"
    shard.write_bytes(bytes(range(256)) * 40_000)  # > one read chunk
    (tmp_path / "step_0000000003" / ".metadata").write_bytes(b"meta")
    names = ["__0_0.distcp", ".metadata"]
    manifest = Manifest(
        step=3,
        world_size=1,
        entries={"model": "module"},
        files=storage.file_sizes("step_0000000003"),
        checksums=checksum_files(storage, "step_0000000003", names),
    )
    write_manifest(storage, "step_0000000003", manifest)
    return storage, shard


def test_checksums_are_the_crc32_of_each_file_and_round_trip(checksummed):
    storage, shard = checksummed
    manifest = validate(storage, "step_0000000003", 3, checksums=True)
    assert manifest.checksums == {
        "__0_0.distcp": f"crc32:{zlib.crc32(shard.read_bytes()):08x}",
        ".metadata": f"crc32:{zlib.crc32(b'meta'):08x}",
    }
    assert manifest.total_bytes == 256 * 40_000 + 4


def test_a_flipped_byte_is_caught_by_the_checksum_not_by_the_size(checksummed):
    storage, shard = checksummed
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    validate(storage, "step_0000000003", 3)  # same size: the cheap check passes
    with pytest.raises(DamagedCheckpointError, match=r"file __0_0\.distcp has checksum crc32:"):
        validate(storage, "step_0000000003", 3, checksums=True)


def test_a_manifest_without_checksums_still_validates(checksummed):
    storage, shard = checksummed
    path = shard.parent / MANIFEST_NAME
    record = json.loads(path.read_text())
    del record["checksums"]  # as hlat-ckpt 0.1 wrote it
    path.write_text(json.dumps(record))
    shard.write_bytes(shard.read_bytes()[::-1])  # nothing recorded to compare with
    assert validate(storage, "step_0000000003", 3, checksums=True).checksums == {}
