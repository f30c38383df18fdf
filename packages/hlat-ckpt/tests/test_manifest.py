import pytest

from hlat_ckpt.manifest import (
    MANIFEST_NAME,
    IncompleteCheckpointError,
    Manifest,
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
