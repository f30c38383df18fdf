"""Run lineage: a run resumed from an older step starts a new lineage, may save the steps the
abandoned one saved, never resumes the abandoned one, and retention deletes the abandoned
checkpoints only once the new lineage has got past them. The rule (pure) first, then real
checkpoints on disk and S3, two gloo ranks, legacy manifests and the NxD engine."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from ckpt_helpers import launch, make_state, snapshot, train_step
from nxd_standin import NxdStandIn

from hlat_ckpt import MANIFEST_NAME, Checkpointer, CheckpointError
from hlat_ckpt.lineage import (
    Commit,
    Parent,
    abandoned,
    ancestry,
    current_ancestry,
    parents,
    to_delete,
)
from hlat_ckpt.neuron import NeuronCheckpointer

# --- the rule ------------------------------------------------------------------------------

A = [Commit(s, f"a{s}", "a", seq) for seq, s in enumerate((10, 20, 30, 40), start=1)]
FORK = Parent("a", 20, 2)  # the run resumed from a's step 20
B = [Commit(s, f"b{s}", "b", seq, FORK) for s, seq in ((30, 5), (40, 6), (50, 7))]


def names(commits) -> list[str]:
    return [c.dirname for c in commits]


def test_the_ancestry_of_a_fork_is_its_own_lineage_then_the_parent_up_to_the_fork():
    assert names(ancestry(A + B, B[1])) == ["b40", "b30", "a20", "a10"]
    assert names(current_ancestry(A + B)) == ["b50", "b40", "b30", "a20", "a10"]
    assert names(abandoned(A + B, B[2])) == ["a30", "a40"]


def test_a_fork_of_a_fork_reaches_back_through_both_parents():
    c = [Commit(60, "c60", "c", 8, Parent("b", 40, 6))]
    assert names(current_ancestry(A + B + c)) == ["c60", "b40", "b30", "a20", "a10"]


def test_abandoned_checkpoints_go_only_once_the_new_lineage_has_passed_their_step():
    # b commits 30: a's 30 is passed, a's 40 is newer and stays for now
    assert names(to_delete(A + B[:1], B[0], keep_last=10)) == ["a30"]
    # b commits 40: a's 40 goes too
    assert names(to_delete(A + B[:2], B[1], keep_last=10)) == ["a30", "a40"]


def test_keep_last_counts_the_current_ancestry_and_keep_every_keeps_its_multiples():
    assert names(to_delete(A + B, B[2], keep_last=2)) == ["a10", "a20", "a30", "a40", "b30"]
    assert names(to_delete(A + B, B[2], keep_last=2, keep_every=20)) == ["a10", "a30", "a40", "b30"]
    assert to_delete(A + B, B[2], keep_last=None) == []  # keep everything


def test_the_recorded_chain_reaches_back_after_a_lineage_between_is_deleted():
    # c forked from b's 40, b from a's 20; retention then deleted every commit of b
    links = (Parent("b", 40, 6), Parent("a", 20, 2))
    c = Commit(60, "c60", "c", 8, links[0], links[1:])
    assert parents(A + B + [c], c) == links
    assert names(current_ancestry([*A, c])) == ["c60", "a20", "a10"]
    # a manifest recording the parent only (hlat-ckpt before 0.10) lost the link
    legacy = Commit(60, "c60", "c", 8, links[0])
    assert names(current_ancestry([*A, legacy])) == ["c60"]
    # ... and has its chain from the parent lineage's commits while they exist
    assert parents(A + B + [legacy], legacy) == links
    # a's 10 and 20 (multiples of 10) stay kept, whatever number of lineages lie between
    assert names(to_delete([*A, c], c, keep_last=1, keep_every=10)) == ["a30", "a40"]


def test_a_lineage_whose_older_commits_record_the_parent_only_takes_the_fullest_chain():
    # c forked from b's 120 (b from a's 100); c150 was written before chains were recorded,
    # c160 records the whole chain; every commit of b is deleted
    a = [Commit(50, "a50", "a", 1), Commit(100, "a100", "a", 2)]
    links = (Parent("b", 120, 4), Parent("a", 100, 2))
    c150 = Commit(150, "c150", "c", 5, links[0])
    c160 = Commit(160, "c160", "c", 6, links[0], links[1:])
    commits = [*a, c150, c160]
    assert parents(commits, c150) == parents(commits, c160) == links
    # a run resumed from c150 forks with the whole chain: a's 50 and 100 stay kept
    d = Commit(180, "d180", "d", 7, c150.as_parent(), parents(commits, c150))
    assert names(ancestry([*commits, d], d)) == ["d180", "c150", "a100", "a50"]
    assert names(to_delete([*commits, d], d, keep_last=2, keep_every=50)) == ["c160"]


def test_legacy_manifests_order_by_step_before_every_recorded_commit():
    legacy = [Commit(s, f"l{s}", "", 0) for s in (5, 15)]
    new = Commit(25, "n25", "n", 1, Parent("", 15, 0))
    assert names(current_ancestry([*legacy, new])) == ["n25", "l15", "l5"]


# --- real checkpoints ----------------------------------------------------------------------


def weights(state) -> torch.Tensor:
    return state["model"][0].weight.detach().clone()


def dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_run_resumed_from_an_older_step_saves_its_steps_again_and_resumes_its_own(tmp_path):
    root = tmp_path / "ckpt"
    first = Checkpointer(root, keep_last=3, async_save=False)
    a = make_state(0)
    for step in (10, 20, 30, 40):
        train_step(a)
        first.save(step, a)
    first.wait()  # a synchronous save deletes what retention drops in the background
    assert dirs(root) == ["step_0000000020", "step_0000000030", "step_0000000040"]

    second = Checkpointer(root, keep_last=3, async_save=True)
    b = make_state(1)
    second.load(20, b)  # go back: a new lineage whose parent is step 20
    assert second.lineage != first.lineage
    torch.manual_seed(123)  # a different history from here on
    train_step(b)
    second.save(30, b)  # step 30 exists in the abandoned lineage: saved beside it
    second.wait()
    tagged = f"step_0000000030-{second.lineage}"
    # a's 30 is passed and deleted; a's 40 stays until the new lineage gets past it
    assert dirs(root) == ["step_0000000020", tagged, "step_0000000040"]
    listed = [(c.step, c.current) for c in second.list()]
    assert listed == [(20, True), (40, False), (30, True)]
    saved_30 = weights(b)

    # resume picks the new lineage's 30, not the abandoned 40
    c = make_state(2)
    resumed = Checkpointer(root, keep_last=3, async_save=False)
    assert resumed.load_latest(c) == 30
    assert torch.equal(weights(c), saved_30)
    assert resumed.lineage == second.lineage  # resuming the head continues its lineage

    train_step(c)
    resumed.save(40, c)
    resumed.wait()
    assert dirs(root) == [
        "step_0000000020",
        tagged,
        f"step_0000000040-{second.lineage}",
    ]
    with pytest.raises(CheckpointError, match="step 40 already exists"):
        resumed.save(40, c)  # a lineage saves each step once


def test_a_run_cannot_save_a_step_of_its_own_ancestry_again(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    a = make_state(0)
    for step in (1, 2, 3):
        ck.save(step, a)
    again = Checkpointer(tmp_path, async_save=False)
    again.load(2, make_state(1))
    again.save(3, a)  # the abandoned 3: allowed, beside it
    with pytest.raises(CheckpointError, match="step 2 already exists"):
        again.save(2, a)  # its own parent
    with pytest.raises(CheckpointError, match="step 1 already exists"):
        again.save(1, a)  # an ancestor further back


def flip_a_byte(path: Path) -> None:
    """Flip the bits of one byte in the middle of ``path``: the file keeps its size."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def seq_and_parent(root: Path, name: str) -> tuple[int, dict | None]:
    record = json.loads((root / name / MANIFEST_NAME).read_text())["lineage"]
    return record["seq"], record["parent"]


def test_keep_every_survives_two_forks_whose_middle_lineage_retention_deleted(tmp_path):
    state = make_state(0)

    def run(resume_from, steps):
        ck = Checkpointer(tmp_path, keep_last=2, keep_every=100, async_save=False)
        if resume_from is not None:
            ck.load(resume_from, state)
        for step in steps:
            train_step(state)
            ck.save(step, state)
        ck.close()  # a synchronous save deletes what retention drops in the background
        return ck

    run(None, (100, 200, 250))
    run(200, (210, 220, 230))  # a fork from 200
    last = run(220, (240, 260, 270))  # a fork from the fork's 220, deleted by its 260
    kept = {c.step: c.current for c in last.list()}
    assert kept == {100: True, 200: True, 260: True, 270: True}
    manifest = json.loads((tmp_path / "step_0000000200" / MANIFEST_NAME).read_text())
    assert manifest["lineage"]["ancestors"] == []  # the first lineage has no parent
    # the newest manifest records both parents, the deleted lineage's included
    newest = next(p for p in tmp_path.iterdir() if p.name.startswith("step_0000000270"))
    record = json.loads((newest / MANIFEST_NAME).read_text())["lineage"]
    assert record["parent"]["step"] == 220
    assert [a["step"] for a in record["ancestors"]] == [200]


@pytest.mark.parametrize("damage", ["a changed byte", "a file cut short"])
def test_keep_last_none_deletes_no_checkpoint_not_even_a_damaged_one(tmp_path, damage):
    ck = Checkpointer(tmp_path, keep_last=None, async_save=False)
    a = make_state(0)
    ck.save(1, a)
    ck.save(2, a)
    shard = tmp_path / "step_0000000002" / "__0_0.distcp"
    if damage == "a changed byte":
        flip_a_byte(shard)  # found by its checksum
    else:
        shard.write_bytes(shard.read_bytes()[:-10])  # found by its size
    resumed = Checkpointer(tmp_path, keep_last=None, async_save=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert resumed.load_latest(make_state(1)) == 1
    resumed.save(2, a)  # the damaged step again: saved beside it, not in its place
    resumed.save(3, a)
    resumed.close()
    fork = resumed.lineage
    assert dirs(tmp_path) == [
        "step_0000000001",
        "step_0000000002",
        f"step_0000000002-{fork}",
        "step_0000000003",
    ]
    assert (tmp_path / "step_0000000002" / MANIFEST_NAME).exists()


def test_keep_last_none_refuses_to_replace_an_incomplete_step_of_its_own_ancestry(tmp_path):
    saved_run(tmp_path, (1, 2), keep_last=None)
    shard = tmp_path / "step_0000000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    again = Checkpointer(tmp_path, keep_last=None, async_save=False)  # loads nothing
    with pytest.raises(CheckpointError, match=r"step_0000000002 but is incomplete \(.*bytes"):
        again.save(2, make_state(1))
    assert (tmp_path / "step_0000000002" / MANIFEST_NAME).exists()  # nothing deleted


def saved_run(root: Path, steps, **options) -> tuple[Checkpointer, dict]:
    """A run that trained and saved ``steps`` under ``root`` (synchronous saves), closed."""
    ck = Checkpointer(root, async_save=False, **options)
    state = make_state(0)
    for step in steps:
        train_step(state)
        ck.save(step, state)
    ck.close()
    return ck, state


def test_a_run_started_over_in_a_used_root_saves_its_own_steps_and_resumes_them(tmp_path):
    old, _ = saved_run(tmp_path, (2, 4), keep_last=5)
    fresh = Checkpointer(tmp_path, keep_last=5, async_save=False)
    fresh.start_new_lineage()
    b = make_state(1)
    before = weights(b)
    # nothing of its own yet: a rollback's load_latest finds nothing, not the old run's 4
    assert fresh.load_latest(b) is None
    assert torch.equal(weights(b), before)
    train_step(b)
    fresh.save(2, b)  # step 2 of the old run: saved beside it, no refusal
    saved = weights(b)
    d = make_state(3)
    assert fresh.load_latest(d) == 2  # once committed, its own (a rollback's load)
    assert torch.equal(weights(d), saved)
    fresh.close()
    assert fresh.lineage != old.lineage
    # the old run's 2 is passed and deleted, its 4 waits until the new run gets past it
    assert dirs(tmp_path) == [f"step_0000000002-{fresh.lineage}", "step_0000000004"]
    assert [(c.step, c.current) for c in fresh.list()] == [(4, False), (2, True)]
    record = json.loads(
        (tmp_path / f"step_0000000002-{fresh.lineage}" / MANIFEST_NAME).read_text()
    )["lineage"]
    assert record["parent"] is None  # not a fork of the old run
    c = make_state(2)
    assert Checkpointer(tmp_path, async_save=False).load_latest(c) == 2
    assert torch.equal(weights(c), saved)
    # an explicit load undoes a start-over: the run forks from the step it loaded
    again = Checkpointer(tmp_path, keep_last=5, async_save=False)
    again.start_new_lineage()
    again.load(4, make_state(4))
    assert again.load_latest(make_state(5)) == 2  # the newest commit's ancestry, as ever


def test_restarts_past_a_damaged_newest_checkpoint_fork_and_save_its_step_again(tmp_path):
    # each Checkpointer is a restart of the run: a new process knows nothing of the last's
    first = Checkpointer(tmp_path, async_save=False)
    a = make_state(0)
    first.save(1000, a)
    train_step(a)
    first.save(2000, a)
    flip_a_byte(tmp_path / "step_0000002000" / "__0_0.distcp")  # same size: only checksums tell
    assert seq_and_parent(tmp_path, "step_0000002000") == (2, None)

    resumed, skipped, runs = [], [], []
    for seed, step in enumerate((1500, 1700, 2000), start=1):
        run = Checkpointer(tmp_path, async_save=False)
        b = make_state(seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed.append(run.load_latest(b))
        skipped.append([str(w.message) for w in caught if "skipping" in str(w.message)])
        train_step(b)
        run.save(step, b)  # step 2000 too: the damaged one is of the abandoned lineage
        run.close()  # a synchronous save deletes what retention drops in the background
        runs.append(run.lineage)
    assert resumed == [1000, 1500, 1700]
    # only the first restart meets the damaged checkpoint; later ones resume the fork
    assert [len(s) for s in skipped] == [1, 0, 0], skipped
    assert "skipping damaged checkpoint" in skipped[0][0]
    # falling back past the damaged newest checkpoint started a new lineage, continued since
    assert runs[0] != first.lineage and runs == [runs[0]] * 3
    fork = runs[0]
    # numbered after every commit under the root, the damaged one's (seq 2) included
    assert seq_and_parent(tmp_path, "step_0000001500") == (
        3,
        {"id": first.lineage, "step": 1000, "seq": 1},
    )
    assert seq_and_parent(tmp_path, "step_0000001700")[0] == 4
    saved = f"step_0000002000-{fork}"
    assert seq_and_parent(tmp_path, saved)[0] == 5
    # the new lineage got to 2000: retention deleted the abandoned, damaged 2000
    assert dirs(tmp_path) == ["step_0000001000", "step_0000001500", "step_0000001700", saved]
    c = make_state(9)
    assert Checkpointer(tmp_path, async_save=False).load_latest(c) == 2000


def test_lineage_is_recorded_in_the_manifest(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=None, async_save=False)
    a = make_state(0)
    ck.save(1, a)
    ck.save(2, a)
    again = Checkpointer(tmp_path, keep_last=None, async_save=False)
    again.load(1, a)
    again.save(2, a)

    def lineage(name: str) -> dict:
        return json.loads((tmp_path / name / MANIFEST_NAME).read_text())["lineage"]

    assert lineage("step_0000000001") == {
        "id": ck.lineage,
        "seq": 1,
        "parent": None,
        "ancestors": [],
    }
    assert lineage("step_0000000002")["seq"] == 2
    assert lineage(f"step_0000000002-{again.lineage}") == {
        "id": again.lineage,
        "seq": 3,
        "parent": {"id": ck.lineage, "step": 1, "seq": 1},
        "ancestors": [],  # the first lineage has no parent
    }


def test_retention_keeps_the_current_lineage_on_s3(s3_bucket):
    url, options = s3_bucket
    url = f"{url}/lineage"
    ck = Checkpointer(url, keep_last=2, async_save=False, storage_options=options)
    a = make_state(0)
    for step in (1, 2, 3):
        train_step(a)
        ck.save(step, a)
    again = Checkpointer(url, keep_last=2, async_save=False, storage_options=options)
    b = make_state(1)
    again.load(2, b)
    train_step(b)
    again.save(3, b)
    assert [(c.step, c.current) for c in again.list()] == [(2, True), (3, True)]
    assert [c.url.rsplit("/", 1)[-1] for c in again.list()] == [
        "step_0000000002",
        f"step_0000000003-{again.lineage}",
    ]
    c = make_state(2)
    assert Checkpointer(url, storage_options=options).load_latest(c) == 3
    assert all(torch.equal(t, snapshot(b)[n]) for n, t in snapshot(c).items())


def test_checkpoints_without_lineage_resume_and_are_continued(tmp_path):
    saved_run(tmp_path, (1, 2), keep_last=2)
    for step in (1, 2):  # as hlat-ckpt 0.4 wrote them
        path = tmp_path / f"step_{step:010d}" / MANIFEST_NAME
        record = json.loads(path.read_text())
        del record["lineage"]
        path.write_text(json.dumps(record))
    again = Checkpointer(tmp_path, keep_last=2, async_save=False)
    b = make_state(1)
    assert again.load_latest(b) == 2
    train_step(b)
    again.save(3, b)
    assert [(c.step, c.lineage, c.current) for c in again.list()] == [
        (2, "", True),
        (3, again.lineage, True),
    ]


@pytest.mark.slow
def test_two_ranks_fork_and_resume_the_new_lineage(tmp_path):
    launch("fork", tmp_path)
    results = [json.loads((tmp_path / f"fork_rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        assert result["resumed"] == 3 and result["weight"] == 103.0
        assert result["progress"] == {"rank": rank, "step": 3}
    first, second = results[0]["lineages"]
    assert first != second and results[1]["lineages"] == [None, None]  # rank 0 decides
    assert results[0]["listed_after_2"] == [[1, True], [3, False], [2, True]]
    assert dirs(tmp_path) == [
        "fork_rank0.json",
        "fork_rank1.json",
        f"step_0000000002-{second}",
        f"step_0000000003-{second}",
    ]


def test_the_nxd_engine_saves_a_forked_step_under_its_tagged_name(tmp_path):
    nxd = NxdStandIn()

    def neuron() -> NeuronCheckpointer:
        return NeuronCheckpointer(tmp_path, async_save=False, use_xser=False, nxd=nxd)

    first = neuron()
    a = make_state(0)
    first.save(1, a)
    first.save(2, a)
    second = neuron()
    second.load(1, make_state(1))
    b = make_state(2)
    second.save(2, b)
    tagged = f"step_0000000002-{second.lineage}"
    assert os.path.exists(tmp_path / tagged / MANIFEST_NAME)
    c = make_state(3)
    assert neuron().load_latest(c) == 2
    assert all(torch.equal(t, snapshot(b)[n]) for n, t in snapshot(c).items())
