import json
import multiprocessing
import os
import re
import shutil
import struct
import subprocess
import sys

import fsspec
import numpy as np
import pytest
import torch
from ckpt_helpers import ForkParent, make_state, snapshot, train_step
from ckpt_workers import save_past_a_file_size_limit

from hlat_ckpt import (
    MANIFEST_NAME,
    Checkpointer,
    CheckpointError,
    UnsupportedFormatError,
    consolidate,
)
from hlat_ckpt.manifest import file_checksum
from hlat_ckpt.storage import Storage

# DCP warns on every single-process save/load; hlat-ckpt filters it, pytest re-enables it.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def checkpointer(root, **kwargs) -> Checkpointer:
    url, options = root
    return Checkpointer(url, storage_options=options, **kwargs)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_round_trip_is_bit_identical_and_the_next_step_is_identical(root, async_save):
    ck = checkpointer(root, async_save=async_save)
    a = make_state(0)
    for _ in range(3):
        train_step(a)
    ck.save(3, a)
    saved = snapshot(a)
    saved_scheduler = a["scheduler"].state_dict()
    ck.wait()
    expected_loss = train_step(a)

    b = make_state(1)
    assert ck.load_latest(b) == 3
    for name, tensor in snapshot(b).items():
        assert torch.equal(tensor, saved[name]), name
    assert b["scheduler"].state_dict() == saved_scheduler
    assert (b["counters"].steps, b["loader"]) == (3, {"position": 48, "epoch": 0})
    assert train_step(b) == expected_loss
    for pa, pb in zip(a["model"].parameters(), b["model"].parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_async_save_does_not_see_changes_made_after_it_returns(tmp_path):
    ck = Checkpointer(tmp_path, async_save=True)
    a = make_state(0)
    ck.save(1, a)
    saved = snapshot(a)
    with torch.no_grad():
        for p in a["model"].parameters():
            p.add_(1.0)  # the next training step, racing the background write
    a["loader"]["position"] = 999
    ck.wait()
    b = make_state(1)
    ck.load(1, b)
    assert all(torch.equal(t, saved[n]) for n, t in snapshot(b).items())
    assert b["loader"]["position"] == 0


# A script whose last save is still being written when the interpreter exits: it ends, or
# raises. 4 MiB of weights: the writes of 1 MiB and more are checksummed in a helper thread.
_ENDS_SAVING = """
import json, sys, torch
from hlat_ckpt import Checkpointer
url, options, ending = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
ck = Checkpointer(url, storage_options=options, async_save=True)
ck.save(1, {"model": torch.nn.Linear(1024, 1024), "loader": {"position": 7}})
if ending == "raises":
    raise RuntimeError("the training loop failed")
"""


@pytest.mark.parametrize("ending", ["ends", "raises"])
def test_an_async_save_pending_when_the_interpreter_exits_is_committed(root, ending):
    url, options = root
    args = [url, json.dumps(options or {}), ending]
    done = subprocess.run(
        [sys.executable, "-c", _ENDS_SAVING, *args], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == (0 if ending == "ends" else 1), done.stderr
    assert "not committed" not in done.stderr, done.stderr
    torch.manual_seed(0)
    expected = torch.nn.Linear(1024, 1024)
    model, loader = torch.nn.Linear(1024, 1024), {}
    assert checkpointer(root).load_latest({"model": model, "loader": loader}) == 1
    assert torch.equal(model.weight, expected.weight) and loader == {"position": 7}


def test_a_synchronous_save_from_an_exit_handler_is_committed(tmp_path):
    # atexit handlers run once concurrent.futures takes no more work: the checksums of the
    # large writes and the deletion of the checkpoint retention drops run inline there
    script = """
import atexit, sys, torch
from hlat_ckpt import Checkpointer
torch.manual_seed(0)
model = torch.nn.Linear(1024, 1024)
ck = Checkpointer(sys.argv[1], keep_last=1, async_save=False)
ck.save(1, {"model": model})
atexit.register(ck.save, 2, {"model": model})
"""
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    torch.manual_seed(0)
    expected = torch.nn.Linear(1024, 1024)
    model = torch.nn.Linear(1024, 1024)
    ck = Checkpointer(tmp_path)
    assert [c.step for c in ck.list()] == [2]
    assert ck.load_latest({"model": model}) == 2 and torch.equal(model.weight, expected.weight)


# A script that forks a child (as a DataLoader worker on Linux) while its async save is
# pending: the save is held behind a gate in the writing thread until the child has ended.
_FORKS_WHILE_SAVING = """
import multiprocessing, sys, threading, torch
from hlat_ckpt import Checkpointer
torch.manual_seed(0)
ck = Checkpointer(sys.argv[1], async_save=True)
gate = threading.Event()
ck._executor.submit(gate.wait)
ck.save(1, {"model": torch.nn.Linear(1024, 1024)})
child = multiprocessing.get_context("fork").Process(target=int)
child.start()
child.join(timeout=60)
print("child", "alive" if child.is_alive() else child.exitcode)
if child.is_alive():
    child.kill()
gate.set()
ck.close()
"""


def test_a_child_forked_while_an_async_save_is_pending_exits(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _FORKS_WHILE_SAVING, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["child", "0"], done.stdout + done.stderr
    torch.manual_seed(0)
    expected = torch.nn.Linear(1024, 1024)
    model = torch.nn.Linear(1024, 1024)
    assert Checkpointer(tmp_path).load_latest({"model": model}) == 1
    assert torch.equal(model.weight, expected.weight)


def test_load_latest_on_an_empty_root_is_a_fresh_start(root):
    assert checkpointer(root).load_latest(make_state(0)) is None


def _two_checkpoints_the_newest_damaged(root) -> Checkpointer:
    ck = checkpointer(root, async_save=False)
    a = make_state(0)
    ck.save(1, a)
    train_step(a)
    ck.save(2, a)
    url, options = root
    fs, path = fsspec.core.url_to_fs(f"{url}/step_0000000002/__0_0.distcp", **(options or {}))
    fs.pipe_file(path, fs.cat_file(path)[:-10])  # a shard cut short
    return ck


def test_load_latest_skips_an_incomplete_newest_checkpoint_with_a_warning(root):
    ck = _two_checkpoints_the_newest_damaged(root)
    b = make_state(1)
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint.*step_0000000002"):
        assert ck.load_latest(b) == 1
    assert b["counters"].steps == 0


def test_a_resumed_run_replaces_a_damaged_checkpoint_of_the_step_it_reaches_again(root):
    ck = _two_checkpoints_the_newest_damaged(root)
    b = make_state(1)
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint"):
        assert ck.load_latest(b) == 1
    train_step(b)
    ck.save(2, b)  # the damaged step 2 is replaced, not refused
    c = make_state(2)
    assert ck.load_latest(c) == 2
    assert torch.equal(c["model"][0].weight, b["model"][0].weight)


MARK = 1234.5678  # a weight value whose four bytes occur once in the shard file


def _flip_a_weight_byte(root, step: int) -> float:
    """Flip one bit of the stored bytes of the weight set to ``MARK``, in the middle of the
    shard file: the file keeps its size and still unpickles. Returns the damaged value."""
    url, options = root
    fs, path = fsspec.core.url_to_fs(f"{url}/step_{step:010d}/__0_0.distcp", **(options or {}))
    data = bytearray(fs.cat_file(path))
    at = data.find(struct.pack("<f", MARK))
    assert at > 0 and data.find(struct.pack("<f", MARK), at + 1) == -1
    data[at] ^= 0x01  # the lowest mantissa bit
    fs.pipe_file(path, bytes(data))
    return struct.unpack("<f", bytes(data[at : at + 4]))[0]


def test_a_flipped_byte_in_a_shard_is_named_and_resume_takes_the_previous_checkpoint(root):
    ck = checkpointer(root, async_save=False)
    a = make_state(0)
    ck.save(1, a)
    train_step(a)
    with torch.no_grad():
        a["model"][0].weight[3, 5] = MARK
    ck.save(2, a)
    damaged = _flip_a_weight_byte(root, 2)

    # Without checksums the damage is silent: the weight loads changed.
    unchecked = make_state(1)
    checkpointer(root, verify_checksums=False).load(2, unchecked)
    assert damaged != MARK and float(unchecked["model"][0].weight[3, 5].detach()) == damaged

    with pytest.raises(
        CheckpointError,
        match=r"cannot load step 2: .*step_0000000002: file __0_0\.distcp has checksum "
        r"crc32:[0-9a-f]{8}, manifest recorded crc32:[0-9a-f]{8}",
    ):
        ck.load(2, make_state(1))
    b = make_state(1)
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoint: .*__0_0\.distcp"):
        assert ck.load_latest(b) == 1
    assert b["counters"].steps == 0
    with pytest.warns(UserWarning, match=r"damaged checkpoint: .*__0_0\.distcp"):
        restored = consolidate(root[0], root[1])["model"]
    assert torch.equal(restored["0.weight"], make_state(0)["model"][0].weight)

    train_step(b)
    ck.save(2, b)  # the damaged step 2 is replaced, not refused
    c = make_state(2)
    assert ck.load_latest(c) == 2
    assert torch.equal(c["model"][0].weight, b["model"][0].weight)


def test_retention_does_not_keep_a_damaged_checkpoint_in_place_of_a_good_one(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2, async_save=False)
    a = make_state(0)
    ck.save(1, a)
    ck.save(4, a)
    shard = tmp_path / "step_0000000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="skipping damaged checkpoint"):
        assert ck.load_latest(make_state(1)) == 1
    ck.save(2, a)  # the resumed run saves at other steps than the damaged one
    # step 1 stays: the two kept are 1 and 2, the damaged 4 is not one of them (and, newer
    # than the commit, is left alone); in commit order, 4 of the lineage the resume left
    assert [(c.step, c.current) for c in ck.list()] == [(1, True), (4, False), (2, True)]
    ck.save(5, a)  # once a newer step commits, the damaged one goes
    assert [c.step for c in ck.list()] == [2, 5]


def test_a_checkpoint_whose_manifest_has_no_checksums_loads(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    a = make_state(0)
    ck.save(1, a)
    path = tmp_path / "step_0000000001" / MANIFEST_NAME
    record = json.loads(path.read_text())
    assert set(record.pop("checksums")) == set(record["files"])
    path.write_text(json.dumps(record))  # a manifest as hlat-ckpt 0.1 wrote it
    b = make_state(1)
    assert ck.load_latest(b) == 1
    assert all(torch.equal(t, snapshot(a)[n]) for n, t in snapshot(b).items())


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_every_committed_save_reports_its_stall_write_time_and_size(tmp_path, async_save):
    ck = Checkpointer(tmp_path, async_save=async_save)
    a = make_state(0)
    for step in (1, 2):
        train_step(a)
        ck.save(step, a)
    ck.wait()
    stats = ck.pop_save_stats()
    assert ck.pop_save_stats() == []  # each save is reported once
    assert [s.step for s in stats] == [1, 2] and ck.last_save == stats[-1]
    for s in stats:
        manifest = json.loads((tmp_path / f"step_{s.step:010d}" / MANIFEST_NAME).read_text())
        assert s.bytes == sum(manifest["files"].values()) and s.files == len(manifest["files"])
        assert s.async_save is async_save
        assert 0 <= s.wait_s <= s.stall_s <= s.save_s and 0 < s.checksum_s < s.write_s
        if async_save:
            assert s.stall_s + s.write_s <= s.save_s + 1e-6  # the write ran after save()
        else:
            assert s.stall_s == s.save_s


def test_retention_keeps_last_k_and_every_mth_step(root):
    ck = checkpointer(root, keep_last=2, keep_every=3, async_save=True)
    a = make_state(0)
    for step in range(1, 8):
        ck.save(step, a)
    ck.wait()
    assert [c.step for c in ck.list()] == [3, 6, 7]
    url, options = root
    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) == [
        "step_0000000003",
        "step_0000000006",
        "step_0000000007",
    ]


def test_saving_a_step_twice_is_refused_and_keeps_the_first(root):
    ck = checkpointer(root, async_save=False)
    a = make_state(0)
    ck.save(5, a)
    with pytest.raises(CheckpointError, match="step 5 already exists"):
        ck.save(5, make_state(1))
    b = make_state(2)
    ck.load(5, b)
    assert torch.equal(b["model"][0].weight, a["model"][0].weight)


def test_unsupported_state_is_refused_before_anything_is_written(tmp_path):
    ck = Checkpointer(tmp_path / "ckpt", async_save=True)
    with pytest.raises(TypeError, match=r"loader\['handle'\]"):
        ck.save(1, {"loader": {"handle": object()}})
    ck.wait()
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    with pytest.raises(TypeError, match=r"state\['lr'\] is a float"):
        ck.save(1, {"lr": 0.1})


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_closed_checkpointer_refuses_to_save_or_load(tmp_path, async_save):
    state = {"model": torch.nn.Linear(4, 4)}
    with Checkpointer(tmp_path, keep_last=1, async_save=async_save) as ck:
        ck.save(1, state)
    for call in (
        lambda: ck.save(2, state),
        lambda: ck.load(1, state),
        lambda: ck.load_latest(state),
    ):
        with pytest.raises(
            CheckpointError, match=r"this Checkpointer of .* is closed; create a new"
        ):
            call()
    ck.close()  # again: nothing to do
    assert [c.step for c in ck.list()] == [1]
    assert Checkpointer(tmp_path).load_latest(state) == 1


@pytest.mark.parametrize(
    ("layout", "error", "message"),
    [
        ({"tp": np.int64(2)}, ValueError, r"layout\['tp'\] is np.int64\(2\) \(int64\)"),
        ({1: "x"}, ValueError, r"layout has the key 1 \(int\); it is recorded as JSON, whose"),
        ({"mesh": {"dp": [object]}}, ValueError, r"layout\['mesh'\]\['dp'\]\[0\] is <class"),
        ("tp=2", TypeError, "layout must be a dict, got str"),
    ],
    ids=["numpy-int", "int-key", "nested", "str"],
)
def test_a_layout_json_cannot_record_is_refused_at_construction(tmp_path, layout, error, message):
    with pytest.raises(error, match=message):
        Checkpointer(tmp_path, layout=layout)


def test_a_layout_is_recorded_in_the_manifest_as_json(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False, layout={"mesh": torch.Size([2, 2]), "pp": None})
    ck.save(1, {"model": torch.nn.Linear(4, 4)})
    manifest = json.loads((tmp_path / "step_0000000001" / MANIFEST_NAME).read_text())
    assert manifest["layout"] == {"mesh": [2, 2], "pp": None, "meshes": []}


def test_a_root_that_is_a_file_or_a_checkpoint_is_refused(root):
    url, options = root
    ck = checkpointer(root, async_save=False)
    ck.save(1, {"model": torch.nn.Linear(4, 4)})
    state = {"model": torch.nn.Linear(4, 4)}
    inner = Checkpointer(f"{url}/step_0000000001", storage_options=options, async_save=False)
    mistake = rf"{re.escape(url)}/step_0000000001 is a checkpoint \(it holds {MANIFEST_NAME}\)"
    mistake += rf", not a directory of checkpoints; pass its parent \({re.escape(url)}\)"
    for call in (
        lambda: inner.load_latest(state),
        lambda: inner.load(1, state),
        lambda: inner.save(2, state),
    ):
        with pytest.raises(CheckpointError, match=mistake):
            call()
    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    fs.pipe_file(f"{path}/notes.txt", b"x")
    in_file = Checkpointer(f"{url}/notes.txt", storage_options=options, async_save=False)
    with pytest.raises(CheckpointError, match=r"notes.txt is a file, not a directory of"):
        in_file.load_latest(state)
    with pytest.raises(CheckpointError, match=r"notes.txt is a file, not a directory of"):
        in_file.save(1, state)
    assert [c.step for c in ck.list()] == [1]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) == [
        "notes.txt",
        "step_0000000001",
    ]
    inside = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{path}/step_0000000001", detail=False)]
    assert not [n for n in inside if n.startswith("step_")]  # the refused save wrote nothing


def test_the_model_alone_loads_from_a_training_checkpoint(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    a = make_state(0)
    ck.save(1, a)
    model = make_state(1)["model"]
    ck.load(1, {"model": model})
    assert torch.equal(model[3].bias, a["model"][3].bias)


def test_loading_an_entry_the_checkpoint_lacks_names_what_it_has(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    ck.save(1, {"model": make_state(0)["model"]})
    with pytest.raises(CheckpointError, match=r"no entry 'loader' \(it has \['model', 'rng'\]\)"):
        ck.load(1, {"loader": {}})


def test_consolidate_returns_full_model_and_optimizer_state(root):
    ck = checkpointer(root, async_save=False)
    a = make_state(0)
    train_step(a)
    ck.save(1, a)
    url, options = root
    full = consolidate(url, storage_options=options)
    assert set(full) == {"model", "optimizer"}
    for name, tensor in a["model"].state_dict().items():
        assert torch.equal(full["model"][name], tensor)
    assert full["optimizer"]["param_groups"][0]["lr"] == a["optimizer"].param_groups[0]["lr"]
    assert torch.equal(
        full["optimizer"]["state"]["0.weight"]["exp_avg"],
        a["optimizer"].state[a["model"][0].weight]["exp_avg"],
    )
    assert consolidate(f"{url}/step_0000000001", storage_options=options).keys() == full.keys()


def test_consolidate_checks_a_copy_under_another_name_too(tmp_path):
    root = (str(tmp_path / "ckpt"), None)
    a = make_state(0)
    with torch.no_grad():
        a["model"][0].weight[3, 5] = MARK
    checkpointer(root, async_save=False).save(1, a)
    best = tmp_path / "best"  # a copy kept apart from the run, named by what it is
    shutil.copytree(tmp_path / "ckpt" / "step_0000000001", best)
    assert torch.equal(consolidate(best)["model"]["0.weight"], a["model"][0].weight)

    _flip_a_weight_byte(root, 1)
    shutil.copyfile(tmp_path / "ckpt" / "step_0000000001" / "__0_0.distcp", best / "__0_0.distcp")
    for url in (best, tmp_path / "ckpt" / "step_0000000001"):
        with pytest.raises(
            ValueError, match=r"cannot consolidate: .*: file __0_0\.distcp has checksum"
        ):
            consolidate(url)


# Note: with two writing threads the error happens in a thread DCP starts, which DCP does
# not pass on (torch 2.13): hlat-ckpt's file system records it and the commit fails.
@pytest.mark.parametrize("io_threads", [1, 2], ids=["one-thread", "two-threads"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_write_error_is_reported_and_earlier_checkpoints_stay_intact(
    tmp_path, async_save, io_threads
):
    results = multiprocessing.get_context("spawn").Queue()
    args = (str(tmp_path), async_save, io_threads, results)
    with ForkParent(save_past_a_file_size_limit, *args) as parent:
        parent.fork()
        message = results.get(timeout=60)
        assert parent.exitcode() == 0
    assert "step 2" in message and "earlier checkpoints are untouched" in message
    ck = Checkpointer(tmp_path)
    assert [c.step for c in ck.list()] == [1]
    assert ck.load_latest({"model": torch.nn.Linear(256, 256)}) == 1
    assert sorted(os.listdir(tmp_path)) == ["step_0000000001"]
    assert (tmp_path / "step_0000000001" / MANIFEST_NAME).exists()


def test_async_save_of_a_step_already_saved_is_refused_at_once(tmp_path):
    ck = Checkpointer(tmp_path / "ckpt", async_save=True)
    a = make_state(0)
    ck.save(5, a)
    with pytest.raises(CheckpointError, match="step 5 already exists"):
        ck.save(5, make_state(1))
    ck.close()


def test_async_save_over_a_step_on_storage_fails_in_the_background_and_keeps_the_first(tmp_path):
    first = Checkpointer(tmp_path / "ckpt", async_save=False)
    a = make_state(0)
    first.save(5, a)
    ck = Checkpointer(tmp_path / "ckpt", async_save=True)
    ck.save(5, make_state(1))  # the storage check runs with the write, in the background
    with pytest.raises(CheckpointError, match="step 5 already exists"):
        ck.wait()
    b = make_state(2)
    ck.load(5, b)
    assert torch.equal(b["model"][0].weight, a["model"][0].weight)


def test_a_background_failure_raised_by_the_next_save_says_its_step_was_not_saved(tmp_path):
    """The next save raises the previous one's failure and saves nothing (on several ranks,
    some of them may still be in that save's collectives), saying so; called again, it saves.
    A NumPy integer step saves as its int."""
    Checkpointer(tmp_path / "ckpt", async_save=False).save(5, make_state(0))
    ck = Checkpointer(tmp_path / "ckpt", async_save=True)
    ck.save(5, make_state(1))  # fails in the background: step 5 is there
    b = make_state(2)
    with pytest.raises(
        CheckpointError,
        match=r"step 5 already exists.*; step 6 was not saved \(call save again to save it\)",
    ):
        ck.save(np.int64(6), b)
    assert [info.step for info in ck.list()] == [5]
    ck.save(np.int64(6), b)
    ck.wait()
    assert [info.step for info in ck.list()] == [5, 6]
    c = make_state(3)
    assert ck.load_latest(c) == 6
    assert torch.equal(c["model"][0].weight, b["model"][0].weight)
    ck.close()


def test_a_with_block_s_own_error_is_not_replaced_by_a_failed_background_save(tmp_path):
    """Leaving a ``with`` block on an exception raises that exception, whatever the last
    save did; the save's failure comes as a warning. Without an exception the failure is
    raised as before."""
    Checkpointer(tmp_path / "ckpt", async_save=False).save(1, make_state(0))
    with (
        pytest.raises(KeyError, match="the loop's own error"),
        pytest.warns(UserWarning, match="on KeyError: CheckpointError: .*step 1 already exists"),
        Checkpointer(tmp_path / "ckpt", async_save=True) as ck,
    ):
        ck.save(1, make_state(1))  # fails in the background: step 1 is there
        raise KeyError("the loop's own error")
    with (
        pytest.raises(CheckpointError, match="step 1 already exists"),
        Checkpointer(tmp_path / "ckpt", async_save=True) as ck,
    ):
        ck.save(1, make_state(1))


@pytest.mark.parametrize("step", ["3", None, 3.5, -1, True], ids=repr)
def test_load_refuses_a_step_that_is_not_a_non_negative_int(tmp_path, step):
    ck = Checkpointer(tmp_path, async_save=False)
    ck.save(3, make_state(0))
    with pytest.raises(ValueError, match=r"step must be a non-negative int, got "):
        ck.load(step, make_state(1))
    ck.load(np.int64(3), make_state(1))


@pytest.mark.parametrize("keep_last", [2, None], ids=["keep_last=2", "keep_last=None"])
def test_a_checkpoint_of_a_newer_format_is_neither_resumed_past_nor_replaced_nor_deleted(
    tmp_path, keep_last
):
    """A manifest with a newer ``format_version`` (written by a newer release) stops
    resume, saves and consolidation with the advice to upgrade, and is left as it is: it
    is not skipped as an interrupted save, which would resume the older checkpoint and then
    delete or replace the newer one."""
    root = tmp_path / "ckpt"
    with Checkpointer(root, keep_last=keep_last, async_save=False) as ck:
        for step in (1, 2):
            ck.save(step, make_state(step))
    manifest = root / "step_0000000002" / MANIFEST_NAME
    record = json.loads(manifest.read_text())
    record["format_version"] = 2
    manifest.write_text(json.dumps(record))
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    newer = (
        r"step_0000000002/hlat-checkpoint.json: format_version 2, written by a newer "
        "hlat-ckpt; this one reads version 1: upgrade hlat-ckpt"
    )

    ck = Checkpointer(root, keep_last=keep_last, async_save=False)
    with pytest.raises(CheckpointError, match=newer):
        ck.load_latest(make_state(0))
    with pytest.raises(CheckpointError, match=newer):
        ck.load(1, make_state(0))
    for step in (3, 2):
        with pytest.raises(CheckpointError, match=f"step {step} not saved: .*{newer}"):
            ck.save(step, make_state(0))
    with pytest.raises(UnsupportedFormatError, match=newer):
        ck.list()
    with pytest.raises(UnsupportedFormatError, match=newer):
        consolidate(root)
    after = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert after == before


class NestedOptimizerCheckpointer(Checkpointer):
    """Writes the optimizer state nested by parameter group, as hlat-ckpt < 0.4 did."""

    @staticmethod
    def _get_state_dict(kind, obj, flat=True):
        return Checkpointer._get_state_dict(kind, obj, flat=False)


def test_a_checkpoint_with_the_nested_optimizer_state_of_earlier_versions_loads(tmp_path):
    a = make_state(0)
    for _ in range(2):
        train_step(a)
    NestedOptimizerCheckpointer(str(tmp_path), async_save=False).save(2, a)
    expected, lr = snapshot(a), a["optimizer"].param_groups[0]["lr"]
    expected_loss = train_step(a)

    b = make_state(1)
    assert Checkpointer(str(tmp_path)).load_latest(b) == 2
    for name, tensor in snapshot(b).items():
        assert torch.equal(tensor, expected[name]), name
    assert b["optimizer"].param_groups[0]["lr"] == lr
    assert train_step(b) == expected_loss


def test_a_tensor_whose_shape_changed_is_refused_naming_it(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    saved = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(saved.parameters())
    saved(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    ck.save(1, {"model": saved, "optimizer": optimizer})
    wider = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))
    fresh = torch.optim.AdamW(wider.parameters())
    # DCP raises its CheckpointException, a BaseException whose text is a traceback
    with pytest.raises(
        CheckpointError,
        match=r"reading .*step_0000000001 failed: rank 0: ValueError: Size mismatch between "
        r"saved torch\.Size\(\[8.*\]\) and current.*torch\.Size\(\[16.*\]\) for model/0\.",
    ):
        ck.load(1, {"model": wider, "optimizer": fresh})
    # the optimizer was given state to read into; the failed read leaves it fresh
    assert not fresh.state


@pytest.mark.parametrize("kind", ["torch", "hlat_optim"])
def test_a_checkpoint_of_a_larger_model_is_refused_unless_not_strict(tmp_path, kind):
    # hlat-optim's AdamW too: a refused load leaves it without state, so the retry with
    # strict=False gives it state to read into (a state of empty entries read none)
    adamw = torch.optim.AdamW if kind == "torch" else pytest.importorskip("hlat_optim").AdamW
    ck = Checkpointer(tmp_path, async_save=False)
    a = make_state(0)
    a["optimizer"] = adamw(a["model"].parameters(), lr=1e-2)
    a["scheduler"] = torch.optim.lr_scheduler.LambdaLR(a["optimizer"], lambda s: 1.0)
    train_step(a)
    ck.save(1, a)
    fewer = torch.nn.Sequential(torch.nn.Linear(8, 32))  # the first layer only
    initial = fewer[0].weight.detach().clone()
    optimizer = adamw(fewer.parameters())
    for state in ({"model": fewer}, {"model": fewer, "optimizer": optimizer}):
        with pytest.raises(
            CheckpointError,
            match=r"entry 'model' holds 2 tensors that the current module has on no rank, "
            r"e\.g\. \['model/3\.bias', 'model/3\.weight'\]; was it saved from a different "
            r"model\? \(load with strict=False",
        ):
            ck.load(1, state)
        assert torch.equal(fewer[0].weight, initial)  # refused before anything was loaded
        assert not optimizer.state  # and the optimizer is as fresh as it was
    whole = make_state(1)["model"]
    last_frozen = adamw(whole[0].parameters())
    with pytest.raises(
        CheckpointError,
        match=r"entry 'optimizer' holds 6 tensors that the current optimizer has on no rank, "
        r"e\.g\. \['optimizer/state\.3\.bias\.exp_avg'.*different model",
    ):
        ck.load(1, {"model": whole, "optimizer": last_frozen})
    ck.load(1, {"model": fewer, "optimizer": optimizer}, strict=False)
    assert torch.equal(fewer[0].weight, a["model"][0].weight)
    exp_avg = a["optimizer"].state[a["model"][0].weight]["exp_avg"]
    assert torch.equal(optimizer.state[fewer[0].weight]["exp_avg"], exp_avg)


class _MasterAdamW(torch.optim.AdamW):
    """AdamW that also keeps an fp32 copy of each parameter as state ``master``, as an
    optimizer with master weights does."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["master"] = p.to(torch.float32, copy=True)
        return loss


_OTHER_CLASS = "another optimizer class, or other settings of it"
_PRECISION = "a changed precision mode, master weights or Kahan compensation"
_LACKS = "lacks 2 tensors of the current optimizer"
_HOLDS = "holds 2 tensors that the current optimizer has on no rank"


@pytest.mark.parametrize(
    ("saved", "loaded", "mismatch", "reason"),
    [
        ("adamw", "sgd", _LACKS, _OTHER_CLASS),
        ("sgd", "sgd_plain", _HOLDS, _OTHER_CLASS),
        ("adamw", "master", _LACKS, _PRECISION),
        ("master", "adamw", _HOLDS, _PRECISION),
    ],
    ids=["adamw-sgd", "sgd-plain_sgd", "adamw-master", "master-adamw"],
)
def test_optimizer_state_of_another_kind_is_refused_as_such(
    tmp_path, saved, loaded, mismatch, reason
):
    # the same parameters, other state: not "was it saved from a different model?"
    optimizers = {
        "adamw": torch.optim.AdamW,
        "master": _MasterAdamW,
        "sgd": lambda params: torch.optim.SGD(params, momentum=0.9),
        "sgd_plain": torch.optim.SGD,  # no momentum: no state
    }
    model = torch.nn.Linear(4, 2)
    optimizer = optimizers[saved](model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    ck = Checkpointer(tmp_path, async_save=False)
    ck.save(1, {"model": model, "optimizer": optimizer})
    other = torch.nn.Linear(4, 2)
    with pytest.raises(CheckpointError) as refused:
        ck.load(1, {"model": other, "optimizer": optimizers[loaded](other.parameters())})
    message = str(refused.value)
    assert re.search(rf"entry 'optimizer' {mismatch}, e\.g\. \['optimizer/state\.", message)
    assert f"keeps other state than the checkpoint's ({reason}" in message, message
    assert "load the model entry alone and start the optimizer fresh" in message, message
    assert "different model" not in message, message
    ck.load(1, {"model": other})
    assert torch.equal(other.weight, model.weight)


def _fresh(seed: int, optimizer: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    if optimizer == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_save_before_the_first_step_leaves_the_optimizer_as_it_was(tmp_path, optimizer):
    model, opt = _fresh(0, optimizer)
    _train(model, opt, 3)
    expected = model.weight.detach().clone()

    model, opt = _fresh(0, optimizer)
    ck = Checkpointer(tmp_path, async_save=False, save_rng=False)
    ck.save(0, {"model": model, "optimizer": opt})
    assert not opt.state and all(p.grad is None for p in model.parameters())
    _train(model, opt, 3)
    assert torch.equal(model.weight, expected)  # as a run without the save

    # resumed from it, with the grads of a warm-up pass set
    model, opt = _fresh(1, optimizer)
    model(torch.randn(2, 4)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert ck.load_latest({"model": model, "optimizer": opt}) == 0
    assert not any(opt.state.values())
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    opt.zero_grad()
    _train(model, opt, 3)
    assert torch.equal(model.weight, expected)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("grads", ["none", "set"])
def test_a_fresh_optimizer_loads_the_state_whatever_its_grads_and_keeps_them(
    tmp_path, grads, strict
):
    a = make_state(0)
    for _ in range(3):
        train_step(a)
    ck = Checkpointer(tmp_path, async_save=False)
    ck.save(3, a)
    saved = snapshot(a)
    expected_loss = train_step(a)

    b = make_state(1)
    if grads == "set":  # a warm-up forward and backward before the resume
        b["model"](torch.randn(2, 8)).sum().backward()
    before = [p.grad for p in b["model"].parameters()]
    ck.load(3, b, strict=strict)
    loaded = snapshot(b)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(t, saved[n]) for n, t in loaded.items())
    assert all(p.grad is g for p, g in zip(b["model"].parameters(), before, strict=True))
    b["optimizer"].zero_grad()
    assert train_step(b) == expected_loss


def test_parameters_the_optimizer_never_updated_resume_without_state(tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "idle": torch.nn.Linear(4, 4)})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, opt, steps, layers):
        for i in range(steps):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
            sum(model[n](x).square().mean() for n in layers).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build(0)
    train(model, opt, 2, ["used"])  # "idle" gets no grads: AdamW keeps no state of it
    Checkpointer(tmp_path, async_save=False).save(2, {"model": model, "optimizer": opt})
    train(model, opt, 2, ["used", "idle"])

    resumed, opt2 = build(1)
    assert Checkpointer(tmp_path).load_latest({"model": resumed, "optimizer": opt2}) == 2
    assert not opt2.state[resumed["idle"].weight] and opt2.state[resumed["used"].weight]
    train(resumed, opt2, 2, ["used", "idle"])
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


# ZeRO-1 (hlat-parallel) in a process of its own: a fresh Zero1Optimizer, whose state is a
# read-only view, loads a checkpoint saved before the first step and stays fresh; one saved
# with state of some parameters only is refused, and the optimizer is not stepped by it.
_ZERO1_BEFORE_THE_FIRST_STEP = """
import sys, torch
from hlat_ckpt import Checkpointer, CheckpointError
from hlat_parallel import init_parallel, parallelize, zero1_optimizer
dims = init_parallel(device="cpu")
def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    parallelize(model, dims, {}, dp_shard="zero1")
    return model, zero1_optimizer(torch.optim.AdamW, model.parameters(), dims, lr=1e-2)
def train(model, opt, layers):
    for i in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        sum(model[n](x).square().mean() for n in layers).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]
model, opt = build(0)
Checkpointer(sys.argv[1] + "/fresh", async_save=False).save(0, {"model": model, "optimizer": opt})
expected = train(model, opt, [0, 1])
model, opt = build(1)
assert Checkpointer(sys.argv[1] + "/fresh").load_latest({"model": model, "optimizer": opt}) == 0
assert not opt.state
assert all(torch.equal(a, b) for a, b in zip(train(model, opt, [0, 1]), expected, strict=True))
model, opt = build(0)
train(model, opt, [0])  # the second layer gets no grads: AdamW keeps no state of it
Checkpointer(sys.argv[1] + "/part", async_save=False).save(2, {"model": model, "optimizer": opt})
model, opt = build(1)
try:
    Checkpointer(sys.argv[1] + "/part").load_latest({"model": model, "optimizer": opt})
except CheckpointError as e:
    assert "cannot drop the state" in str(e), e
else:
    raise AssertionError("loaded")
assert not opt.state
# a weight shared by two modules (tied embeddings) has its state under its first name only
def build_tied(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8, bias=False) for _ in range(2)))
    model[1].weight = model[0].weight
    parallelize(model, dims, {}, dp_shard="zero1")
    return model, zero1_optimizer(torch.optim.AdamW, model.parameters(), dims, lr=1e-2)
model, opt = build_tied(0)
train(model, opt, [0, 1])
Checkpointer(sys.argv[1] + "/tied", async_save=False).save(2, {"model": model, "optimizer": opt})
expected = train(model, opt, [0, 1])
model, opt = build_tied(1)
assert Checkpointer(sys.argv[1] + "/tied").load_latest({"model": model, "optimizer": opt}) == 2
assert all(torch.equal(a, b) for a, b in zip(train(model, opt, [0, 1]), expected, strict=True))
print("ok")
"""


def test_a_fresh_zero1_optimizer_loads_a_checkpoint_saved_before_the_first_step(tmp_path):
    pytest.importorskip("hlat_parallel")
    done = subprocess.run(
        [sys.executable, "-c", _ZERO1_BEFORE_THE_FIRST_STEP, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    # Note: the last line; older torch's gloo prints its connections to stdout before it
    assert done.returncode == 0 and done.stdout.splitlines()[-1:] == ["ok"], (
        done.stdout + done.stderr
    )


def _without_metadata(path, how: str) -> None:
    """Take DCP's ``.metadata`` from the committed checkpoint ``path``: removed (and left out
    of the manifest, as a commit of a write that left ``.metadata.tmp`` recorded it), or
    garbled at its size; ``"garbled unchecked"`` also drops its checksum from the manifest
    (verification reads no file without one), ``"garbled checked"`` records the garbled
    file's."""
    metadata = path / ".metadata"
    record = json.loads((path / MANIFEST_NAME).read_text())
    if how == "missing":
        metadata.unlink()
        del record["files"][".metadata"], record["checksums"][".metadata"]
    else:
        metadata.write_bytes(b"\0" * metadata.stat().st_size)
        if how == "garbled unchecked":
            del record["checksums"][".metadata"]
        elif how == "garbled checked":
            storage = Storage(path)
            record["checksums"][".metadata"] = file_checksum(storage, "", ".metadata")
    (path / MANIFEST_NAME).write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("how", "verify"),
    [("missing", True), ("missing", False), ("garbled", False), ("garbled unchecked", True)],
)
def test_a_checkpoint_whose_dcp_metadata_cannot_be_read_is_skipped_as_damaged(
    tmp_path, how, verify
):
    # with verification, a garbled .metadata whose checksum the manifest holds fails it
    # first; read unverified, a file pickle cannot read (UnpicklingError) is damaged
    ck = Checkpointer(tmp_path, async_save=False, verify_checksums=verify)
    a = make_state(0)
    ck.save(1, a)
    train_step(a)
    ck.save(2, a)
    _without_metadata(tmp_path / "step_0000000002", how)
    with pytest.raises(CheckpointError, match=r"cannot load step 2: .*step_0000000002.*\.metadata"):
        ck.load(2, make_state(1))
    b = make_state(1)
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoint: .*\.metadata"):
        assert ck.load_latest(b) == 1
    assert b["counters"].steps == 0
    ck.save(2, b)  # the resumed run replaces it
    assert ck.load_latest(make_state(2)) == 2


def test_a_dcp_metadata_this_torch_cannot_read_is_an_error_not_damage(tmp_path, monkeypatch):
    # taken as damage, both steps would be skipped, and deleted once the run saved those
    # steps again
    ck = Checkpointer(tmp_path, async_save=False)
    a = make_state(0)
    ck.save(1, a)
    train_step(a)
    ck.save(2, a)
    dirs = sorted(tmp_path.iterdir())
    # an older torch reading a newer one's .metadata: a class it pickled is missing here
    monkeypatch.delattr("torch.distributed.checkpoint.metadata.StorageMeta")
    for verify in (True, False):
        ck = Checkpointer(tmp_path, async_save=False, verify_checksums=verify)
        with pytest.raises(
            CheckpointError,
            match=r"checking .*step_0000000002 failed: rank 0: CheckpointError: .*\.metadata "
            r"cannot be read by this process \(AttributeError: .*StorageMeta.*not taken as damage",
        ):
            ck.load_latest(make_state(1))
    monkeypatch.undo()
    assert sorted(tmp_path.iterdir()) == dirs
    # a garbled file whose checksum matches the manifest's is as it was written: no damage
    _without_metadata(tmp_path / "step_0000000002", "garbled checked")
    ck = Checkpointer(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match=r"UnpicklingError.*checksum matches"):
        ck.load_latest(make_state(1))
    ck.load(1, make_state(1))


@pytest.mark.parametrize("name", ["run?v=1", "run[7b]", "run*"])
def test_an_object_store_root_with_pattern_characters_is_refused_before_any_write(s3_bucket, name):
    # fsspec (and DCP's fsspec writer, which renames and cleans up through it) expands *, ?
    # and [ on object stores: "run[7b]" matches "run7", whose files a failed write deleted
    url, options = s3_bucket
    other = Checkpointer(f"{url}/run7", storage_options=options, async_save=False)
    other.save(1, {"model": torch.nn.Linear(2, 2)})
    fs, path = fsspec.core.url_to_fs(url, **options)
    kept = sorted(fs.find(path))
    with pytest.raises(ValueError, match=r"object-store checkpoint root cannot contain"):
        Checkpointer(f"{url}/{name}", storage_options=options, async_save=False)
    with pytest.raises(ValueError, match=r"object-store checkpoint root cannot contain"):
        consolidate(f"{url}/{name}", storage_options=options)
    fs.invalidate_cache()
    assert sorted(fs.find(path)) == kept
    assert other.load_latest({"model": torch.nn.Linear(2, 2)}) == 1


def test_a_write_without_dcp_metadata_or_with_unfinished_files_is_not_committed(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    ck._check_written({".metadata": 10, "__0_0.distcp": 20}, "here")
    with pytest.raises(CheckpointError, match=r"here: DCP's write did not complete \(no "):
        ck._check_written({".metadata.tmp": 10, "__0_0.distcp": 20}, "here")
    with pytest.raises(CheckpointError, match=r"unfinished files \['__0_0.distcp.tmp'\]"):
        ck._check_written({".metadata": 10, "__0_0.distcp.tmp": 20}, "here")


def test_a_failed_save_under_a_root_with_glob_characters_removes_its_own_files_only(tmp_path):
    other = Checkpointer(tmp_path / "run7", async_save=False)
    other.save(1, {"model": torch.nn.Linear(2, 2)})
    (tmp_path / "run7" / "step_0000000002.tmp").mkdir()  # a save of that run in progress
    kept = sorted(tmp_path.rglob("*"))
    ck = Checkpointer(tmp_path / "run[7b]", async_save=False, io_threads=1)
    model = torch.nn.Linear(2, 2)
    model.register_buffer("lazy", torch.empty(4, device="meta"))  # DCP cannot write it
    for step in (1, 2):
        with pytest.raises(CheckpointError, match=rf"writing step {step} to .*run\[7b\]/step_"):
            ck.save(step, {"model": model})
        assert sorted(tmp_path.rglob("*")) == [*kept, tmp_path / "run[7b]"]
    assert other.load_latest({"model": torch.nn.Linear(2, 2)}) == 1


def test_importing_and_listing_leave_dcp_dtensor_and_the_neuron_module_unimported(tmp_path):
    """The README's "Imports": the heavy modules load with the first save or load."""
    heavy = ["torch.distributed.checkpoint", "torch.distributed.tensor", "hlat_ckpt.neuron"]
    code = f"""
import sys
import torch
from hlat_ckpt import Checkpointer
ckpt = Checkpointer({str(tmp_path)!r})
assert ckpt.list() == [] and ckpt.load_latest({{"model": torch.nn.Linear(2, 2)}}) is None
before = [m for m in {heavy!r} if m in sys.modules]
ckpt.save(1, {{"model": torch.nn.Linear(2, 2)}})
ckpt.close()
after = [m for m in {heavy!r} if m in sys.modules]
print(before, after)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    # before any checkpoint exists nothing heavy; the first save brings DCP (and DTensor)
    assert out.split() == ["[]", *str(heavy[:2]).split()], out
