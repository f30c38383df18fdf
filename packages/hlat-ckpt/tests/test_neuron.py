"""NeuronCheckpointer: the NxD argument mapping, the per-rank state, and hlat-ckpt's
bookkeeping (commit, manifest and checksums, resume, retention, failures) on real files,
with NxD's two checkpoint calls played by tests/nxd_standin.py (a reimplementation of
their single-rank file layout). The NxD calls themselves need a trn1 instance to verify."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_helpers import Counters, make_state, snapshot, train_step
from nxd_standin import RANK_FILE, NxdStandIn, zero1_optimizer_class

from hlat_ckpt import MANIFEST_NAME, CheckpointError, CheckpointInfo
from hlat_ckpt.neuron import (
    NeuronCheckpointer,
    checksum_share,
    load_checkpoint_kwargs,
    manifest_entries,
    nxd_optimizer,
    rank_file,
    rank_state_bytes,
    restore_rank_state,
    save_checkpoint_kwargs,
)


def checkpointer(root, **kwargs) -> NeuronCheckpointer:
    kwargs.setdefault("async_save", False)
    return NeuronCheckpointer(root, use_xser=False, nxd=NxdStandIn(), **kwargs)


def step_dir(root, step: int) -> str:
    return os.path.join(root, f"step_{step:010d}")


# --- mapping -------------------------------------------------------------------------------


def test_save_hands_model_optimizer_scheduler_to_nxd_and_keeps_retention_here():
    state = make_state(0)
    kwargs = save_checkpoint_kwargs("s3://b/run", 1000, state, async_save=True)
    assert kwargs["checkpoint_dir_str"] == "s3://b/run"
    assert kwargs["tag"] == "step_0000001000"
    assert kwargs["model"] is state["model"] and kwargs["optimizer"] is state["optimizer"]
    assert kwargs["scheduler"] is state["scheduler"]
    assert kwargs["num_kept_ckpts"] is None  # NxD must never delete a checkpoint itself
    assert (kwargs["async_save"], kwargs["use_xser"]) == (True, True)
    assert kwargs["user_content"] == {"hlat_step": 1000}  # per-rank state goes elsewhere


def test_load_always_names_the_tag_hlat_ckpt_chose():
    state = make_state(0)
    kwargs = load_checkpoint_kwargs("/ckpt", 20, state, num_workers=4)
    assert (kwargs["path"], kwargs["tag"], kwargs["num_workers"]) == ("/ckpt", "step_0000000020", 4)
    assert kwargs["model"] is state["model"] and kwargs["strict"] is True
    assert load_checkpoint_kwargs("/ckpt", 20, state, strict=False)["strict"] is False


def test_load_gives_nxd_its_own_optimizer_and_any_other_as_a_dict_to_fill():
    # NxD's load_checkpoint raises on an optimizer that is neither its own nor a dict
    state = make_state(0)
    kwargs = load_checkpoint_kwargs("/ckpt", 20, state)
    assert not nxd_optimizer(state["optimizer"])
    assert kwargs["optimizer"] == {} and kwargs["optimizer"] is not state["optimizer"]
    zero1 = zero1_optimizer_class(torch.optim.AdamW)(state["model"].parameters())
    assert nxd_optimizer(zero1)
    assert load_checkpoint_kwargs("/ckpt", 20, {**state, "optimizer": zero1})["optimizer"] is zero1
    assert load_checkpoint_kwargs("/ckpt", 20, {"model": state["model"]})["optimizer"] is None
    # NxD's isinstance test, by the real classes' modules and names: their subclasses are
    # its own, its other optimizers (AdamW_FP32OptimParams, a plain torch optimizer) are not
    ep_zero1 = type(
        "NeuronEPZero1Optimizer", (type(zero1),), {"__module__": type(zero1).__module__}
    )
    nxd_config = type(
        "NxDOptimizer",
        (torch.optim.AdamW,),
        {"__module__": "neuronx_distributed.trainer.optimizer"},
    )
    assert nxd_optimizer(ep_zero1(state["model"].parameters()))
    assert nxd_optimizer(nxd_config(state["model"].parameters()))
    assert not nxd_optimizer(nxd_plain_optimizer(state["model"].parameters()))


def nxd_plain_optimizer(params) -> torch.optim.Optimizer:
    """An optimizer of a class from the ``neuronx_distributed`` package that is not one of
    the optimizer classes its ``load_checkpoint`` takes (as ``AdamW_FP32OptimParams``)."""
    cls = type(
        "AdamW_FP32OptimParams",
        (torch.optim.AdamW,),
        {"__module__": "neuronx_distributed.utils.adamw_fp32_optim_params"},
    )
    return cls(params, lr=1e-2, weight_decay=0.1)


def test_an_optimizer_of_nxd_s_package_that_nxd_does_not_load_round_trips(tmp_path):
    a = make_state(0)
    a["optimizer"] = nxd_plain_optimizer(a["model"].parameters())
    train_step(a)
    checkpointer(tmp_path).save(1, a)
    b = make_state(1)
    b["optimizer"] = nxd_plain_optimizer(b["model"].parameters())
    assert checkpointer(tmp_path).load_latest(b) == 1
    for name, tensor in snapshot(b).items():
        assert torch.equal(tensor, snapshot(a)[name]), name


def test_manifest_entries_say_who_saved_what():
    assert manifest_entries(make_state(0)) == {
        "model": "nxd-model",
        "optimizer": "nxd-optimizer",
        "scheduler": "nxd-scheduler",
        "counters": "rank",
        "loader": "dict",
        "rng": "rank",
    }


def test_two_models_and_odd_entries_are_refused():
    state = make_state(0)
    with pytest.raises(ValueError, match=r"exactly one nn\.Module"):
        save_checkpoint_kwargs("/ckpt", 1, state | {"ema": torch.nn.Linear(4, 4)})
    with pytest.raises(TypeError, match=r"state\['lr'\] is a float"):
        save_checkpoint_kwargs("/ckpt", 1, state | {"lr": 0.1})


def test_checksum_reading_is_shared_by_the_ranks_and_covers_every_file():
    names = [f"f{i}" for i in range(7)]
    shares = [checksum_share(names, rank, 3) for rank in range(3)]
    assert sorted(n for share in shares for n in share) == names
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


# --- per-rank state --------------------------------------------------------------------------


def test_per_rank_state_round_trips_with_rng_and_loads_without_pickle():
    state = make_state(0)
    state["counters"].steps, state["loader"]["position"] = 7, 112
    data = rank_state_bytes({"counters": state["counters"], "loader": state["loader"]})
    expected = random.random(), torch.rand(2)
    counters, loader = Counters(), {"position": 0}
    restore_rank_state(data, {"counters": counters, "loader": loader})
    assert (counters.steps, loader) == (7, {"position": 112, "epoch": 0})
    assert (random.random(), torch.rand(2).tolist()) == (expected[0], expected[1].tolist())
    record = torch.load(__import__("io").BytesIO(data), weights_only=True)
    assert json.loads(record["json"])  # plain JSON and tensors


def test_per_rank_state_names_a_missing_entry():
    data = rank_state_bytes({"loader": {"position": 1}}, save_rng=False)
    with pytest.raises(CheckpointError, match=r"has no entry 'counters' \(it has \['loader'\]\)"):
        restore_rank_state(data, {"counters": Counters()})


# --- bookkeeping on real files ---------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_round_trip_restores_everything_and_the_next_step_is_identical(tmp_path, async_save):
    """A NumPy integer step saves as its int, as with :class:`~hlat_ckpt.Checkpointer`."""
    ck = checkpointer(tmp_path, async_save=async_save)
    a = make_state(0)
    for _ in range(3):
        train_step(a)
    ck.save(np.int64(3), a)
    saved = snapshot(a)
    saved_scheduler = a["scheduler"].state_dict()
    ck.wait()
    expected_loss = train_step(a)

    b = make_state(1)
    assert checkpointer(tmp_path).load_latest(b) == 3
    for name, tensor in snapshot(b).items():
        assert torch.equal(tensor, saved[name]), name
    assert b["scheduler"].state_dict() == saved_scheduler
    assert (b["counters"].steps, b["loader"]) == (3, {"position": 48, "epoch": 0})
    assert train_step(b) == expected_loss


def test_the_manifest_commits_nxd_files_and_every_ranks_state_with_checksums(tmp_path):
    ck = checkpointer(tmp_path, layout={"tp": 1, "dp": 1})
    ck.save(5, make_state(0))
    with open(os.path.join(step_dir(tmp_path, 5), MANIFEST_NAME)) as f:
        manifest = json.load(f)
    expected = {
        "checkpoint", "done", "scheduler.pt", "user_content.pt",
        f"model/{RANK_FILE}", f"optim/{RANK_FILE}", rank_file(0),
    }  # fmt: skip
    assert set(manifest["files"]) == expected == set(manifest["checksums"])
    assert manifest["step"] == 5 and manifest["layout"] == {"backend": "nxd", "tp": 1, "dp": 1}
    assert manifest["entries"]["model"] == "nxd-model"
    [info] = ck.list()
    assert isinstance(info, CheckpointInfo) and (info.step, info.world_size) == (5, 1)
    [stats] = ck.pop_save_stats()
    assert (stats.step, stats.async_save, stats.files) == (5, False, len(expected))
    assert stats.bytes == sum(manifest["files"].values()) and stats.stall_s >= stats.write_s
    assert ck.pop_save_stats() == []


def test_an_async_save_is_committed_when_the_next_save_begins_or_at_wait(tmp_path):
    nxd = NxdStandIn()
    ck = NeuronCheckpointer(tmp_path, async_save=True, use_xser=False, nxd=nxd)
    a = make_state(0)
    ck.save(1, a)
    assert not os.path.exists(os.path.join(step_dir(tmp_path, 1), MANIFEST_NAME))
    assert ck.list() == [] and ck.pop_save_stats() == []
    train_step(a)
    ck.save(2, a)  # finishes NxD's writes of step 1, then commits it
    assert [i.step for i in ck.list()] == [1]
    ck.wait()
    assert [i.step for i in ck.list()] == [1, 2]
    assert [s.step for s in ck.pop_save_stats()] == [1, 2]
    assert nxd.calls == ["save step_0000000001", "finalize", "save step_0000000002", "finalize"]


def test_retention_keeps_the_last_k_and_every_mth(tmp_path):
    ck = checkpointer(tmp_path, keep_last=2, keep_every=2)
    a = make_state(0)
    for step in range(1, 6):
        train_step(a)
        ck.save(step, a)
    assert [i.step for i in ck.list()] == [2, 4, 5]
    assert sorted(os.listdir(tmp_path)) == [f"step_{s:010d}" for s in (2, 4, 5)]


def _flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before_then_replaced(tmp_path):
    ck = checkpointer(tmp_path)
    a = make_state(0)
    ck.save(1, a)
    at_one = snapshot(a)
    train_step(a)
    ck.save(2, a)
    _flip_a_byte(os.path.join(step_dir(tmp_path, 2), "model", RANK_FILE))

    resumed = checkpointer(tmp_path)
    b = make_state(1)
    with pytest.warns(UserWarning, match=rf"skipping damaged checkpoint.*model/{RANK_FILE} has"):
        assert resumed.load_latest(b) == 1
    assert all(torch.equal(t, at_one[n]) for n, t in snapshot(b).items())
    with pytest.raises(CheckpointError, match="cannot load step 2"):
        resumed.load(2, make_state(2))
    train_step(b)
    resumed.save(2, b)  # the resumed run reaches step 2 again and replaces the damaged one
    c = make_state(3)
    assert checkpointer(tmp_path).load_latest(c) == 2
    assert torch.equal(snapshot(c)["model.0.weight"], snapshot(b)["model.0.weight"])


def test_nxd_done_without_a_manifest_is_not_a_checkpoint(tmp_path):
    ck = checkpointer(tmp_path)
    a = make_state(0)
    ck.save(1, a)
    train_step(a)
    ck.save(2, a)
    os.remove(os.path.join(step_dir(tmp_path, 2), MANIFEST_NAME))  # died before the commit
    assert os.path.exists(os.path.join(step_dir(tmp_path, 2), "done"))
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint"):
        assert checkpointer(tmp_path).load_latest(make_state(1)) == 1


def test_a_failing_save_keeps_every_earlier_checkpoint_and_leaves_nothing_committed(tmp_path):
    nxd = NxdStandIn()
    ck = NeuronCheckpointer(tmp_path, keep_last=1, async_save=False, use_xser=False, nxd=nxd)
    a = make_state(0)
    ck.save(1, a)
    nxd.fail_on = "step_0000000002"
    train_step(a)
    with pytest.raises(CheckpointError, match=r"saving step 2 .* no space left.*untouched"):
        ck.save(2, a)
    assert [i.step for i in ck.list()] == [1]
    assert os.path.isdir(step_dir(tmp_path, 2))  # the torn save, never committed
    with pytest.warns(UserWarning, match="step_0000000002.* does not exist .never committed"):
        assert checkpointer(tmp_path).load_latest(make_state(1)) == 1
    nxd.fail_on = None
    ck.save(2, a)  # the leftover is cleared and the step saved whole
    assert [i.step for i in ck.list()] == [2]


def test_an_async_save_failing_in_the_background_is_reported_by_the_next_call(tmp_path):
    nxd = NxdStandIn()
    ck = NeuronCheckpointer(tmp_path, async_save=True, use_xser=False, nxd=nxd)
    a = make_state(0)
    ck.save(1, a)
    nxd.fail_on = "step_0000000002"
    ck.save(2, a)  # NxD only copies to host memory here; its writes come later
    with pytest.raises(CheckpointError, match=r"saving step 2 .* failed in the background"):
        ck.wait()
    assert [i.step for i in ck.list()] == [1]


def test_unsaveable_per_rank_state_fails_before_nxd_writes_anything(tmp_path):
    nxd = NxdStandIn()
    ck = NeuronCheckpointer(tmp_path, async_save=False, use_xser=False, nxd=nxd)
    state = make_state(0) | {"loader": {"sampler": object()}}
    with pytest.raises(CheckpointError, match=r"cannot save a builtins\.object"):
        ck.save(1, state)
    assert nxd.calls == [] and ck.list() == []


def test_a_process_saves_through_nxd_in_the_mode_of_its_first_save_only(tmp_path):
    # NxD's first save_checkpoint fixes synchronous or asynchronous saving for the process
    nxd = NxdStandIn()
    first = NeuronCheckpointer(tmp_path / "a", async_save=True, use_xser=False, nxd=nxd)
    other = NeuronCheckpointer(tmp_path / "b", async_save=False, use_xser=False, nxd=nxd)
    first.save(1, make_state(0))
    first.wait()
    with pytest.raises(ValueError, match="async_save=True"):
        other.save(1, make_state(0))
    assert not os.path.exists(tmp_path / "b" / "step_0000000001")
    assert nxd.calls == ["save step_0000000001", "finalize"]
    assert [i.step for i in first.list()] == [1]


def test_saving_a_step_twice_is_refused_and_keeps_the_first(tmp_path):
    ck = checkpointer(tmp_path)
    a = make_state(0)
    ck.save(4, a)
    first = snapshot(a)
    train_step(a)
    with pytest.raises(CheckpointError, match="step 4 already exists"):
        ck.save(4, a)
    with pytest.raises(CheckpointError, match="step 4 already exists"):
        checkpointer(tmp_path).save(4, a)
    b = make_state(1)
    ck.load(4, b)
    assert all(torch.equal(t, first[n]) for n, t in snapshot(b).items())


def test_a_closed_checkpointer_refuses_to_save_or_load(tmp_path):
    a = make_state(0)
    with checkpointer(tmp_path, async_save=True) as ck:
        ck.save(1, a)
    for call in (lambda: ck.save(2, a), lambda: ck.load_latest(a)):
        with pytest.raises(CheckpointError, match=r"this NeuronCheckpointer of .* is closed"):
            call()
    assert [i.step for i in checkpointer(tmp_path, async_save=True).list()] == [1]


def test_an_empty_root_is_a_fresh_start(tmp_path):
    assert checkpointer(tmp_path / "none").load_latest(make_state(0)) is None


def test_without_the_neuron_sdk_the_checkpointer_says_what_to_install(tmp_path):
    try:
        import neuronx_distributed  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("the Neuron SDK is installed")
    with pytest.raises(RuntimeError, match="Neuron package repository"):
        NeuronCheckpointer(tmp_path)


@pytest.mark.slow
def test_two_ranks_commit_together_share_the_checksums_and_skip_a_rank_local_damage(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = os.environ | {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("nxd_worker.py")), str(tmp_path)],
            env=env | {"RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for rank, proc in enumerate(procs):
        out = proc.communicate(timeout=240)[0]
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            got = json.load(f)
        # rank 1's own optimizer file of step 2 was damaged: both ranks resume from step 1
        assert got["step"] == 1 and got["position"] == 100 + rank, got
        assert got["momentum_matches_own"] and got["steps_listed"] == [1, 2]
        assert got["world_size"] == 2
    with open(tmp_path / "rank0.json") as f:
        assert any("dp_rank_01_tp_rank_00_pp_rank_00.pt has" in w for w in json.load(f)["warnings"])
    manifest = json.loads((tmp_path / "step_0000000001" / MANIFEST_NAME).read_text())
    assert {rank_file(0), rank_file(1)} <= set(manifest["checksums"])
    # one process does not take rank 0's share of a two-rank job's state for the whole
    from nxd_worker import state

    one = state(0)
    before = {k: v.clone() for k, v in one["model"].state_dict().items()}
    with pytest.raises(CheckpointError, match=r"written by 2 ranks, this job has 1"):
        checkpointer(tmp_path).load(1, one)
    assert all(torch.equal(v, before[k]) for k, v in one["model"].state_dict().items())
    assert one["loader"] == {"position": 0}
