"""Two-process jobs on real gloo groups: a TP=2 DTensor checkpoint loads at other layouts;
each rank checks the checksums of its own shard files; the checksums computed while writing
reach the manifest; replicated tensors are written once; a rewound job saves a step again;
pipeline stages load their own layers, and layers no stage holds are refused; data-parallel
replicas load strictly, and refuse what one of them finds amiss; state that one rank cannot
save is refused on every rank; a save before the
optimizer's first step leaves every rank's optimizer as it was, and a checkpoint directory
passed as the root is refused on every rank."""

import json
import re
import shutil

import pytest
import torch
from ckpt_helpers import launch
from ckpt_workers import REPLICATED_NUMEL, SHARDED_NUMEL, tp_model

from hlat_ckpt import MANIFEST_NAME, Checkpointer, CheckpointError
from hlat_ckpt.manifest import file_checksum
from hlat_ckpt.storage import Storage

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    """A checkpoint written by a TP=2 job (each rank also checks its per-rank state reloads)."""
    root = tmp_path_factory.mktemp("tp2")
    launch("tp_save", root)
    return root, torch.load(root / "reference.pt", weights_only=True)


def assert_matches(got: dict, reference: dict) -> None:
    assert set(got) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(got[name], tensor), name


def test_tp2_checkpoint_records_two_ranks_and_its_mesh(tp2_checkpoint):
    root, _ = tp2_checkpoint
    (info,) = Checkpointer(root).list()
    assert (info.step, info.world_size) == (1, 2)
    manifest = (root / "step_0000000001" / "hlat-checkpoint.json").read_text()
    assert '"tp": 2' in manifest and '"dim_names": [\n     "tp"' in manifest


def test_tp2_checkpoint_loads_into_one_process(tp2_checkpoint):
    root, reference = tp2_checkpoint
    model = tp_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert Checkpointer(root).load_latest({"model": model, "optimizer": optimizer}) == 1
    got = {f"model.{k}": v for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for k, v in optimizer.state[p].items():
            got[f"optimizer.{name}.{k}"] = v
    assert_matches(got, reference)


def test_per_rank_state_of_two_ranks_is_not_loaded_by_one_without_rank_state_from(tp2_checkpoint):
    root, reference = tp2_checkpoint
    model = tp_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    loader = {"untouched": True}
    with pytest.raises(
        CheckpointError,
        match=r"written by 2 ranks, this job has 1: .*per-rank state \['loader'\].*"
        r"rank_state_from.*model and optimizer",
    ):
        Checkpointer(root).load_latest({"model": model, "loader": loader})
    # refused before anything was read: neither the model nor rank 0's loader was loaded
    assert loader == {"untouched": True}
    assert all(torch.equal(v, initial[k]) for k, v in model.state_dict().items())

    # named by rank_state_from, the saved rank's entries load
    assert Checkpointer(root, rank_state_from=lambda layout, world: 1).load_latest(
        {"model": model, "loader": loader}
    )
    assert loader == {"rank": 1, "pos": 10}
    assert torch.equal(model.state_dict()["0.weight"], reference["model.0.weight"])

    # the model alone loads; this process's RNG states stay as they are (the checkpoint's
    # are two other ranks')
    model = tp_model()  # seeds torch's generator itself
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    assert Checkpointer(root).load_latest({"model": model}) == 1
    assert torch.equal(torch.get_rng_state(), rng)


def test_tp2_checkpoint_loads_into_two_data_parallel_replicas(tp2_checkpoint):
    root, reference = tp2_checkpoint
    launch("dp_load", root)
    for rank in range(2):
        assert_matches(torch.load(root / f"dp_rank{rank}.pt", weights_only=True), reference)


def test_a_damaged_shard_of_rank_1_is_found_by_rank_1_and_skipped_by_both(tp2_checkpoint, tmp_path):
    root, _ = tp2_checkpoint
    copy = tmp_path / "tp2"
    shutil.copytree(root, copy)
    manifest = json.loads((copy / "step_0000000001" / MANIFEST_NAME).read_text())
    assert set(manifest["checksums"]) == set(manifest["files"]) >= {"__0_0.distcp", "__1_0.distcp"}
    shard = copy / "step_0000000001" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    launch("latest", copy)
    for rank in range(2):
        found = json.loads((copy / f"latest_rank{rank}.json").read_text())
        assert found["step"] is None, found  # the only checkpoint is damaged: a fresh start
    warned = json.loads((copy / "latest_rank0.json").read_text())["warnings"]
    assert len(warned) == 1 and "skipping damaged checkpoint" in warned[0], warned
    assert "file __1_0.distcp has checksum" in warned[0], warned


def test_each_rank_saves_a_step_again_after_loading_an_older_one(tmp_path):
    # every rank's Checkpointer forgets the steps it saved on load: one that remembered
    # step 2 refused it before any collective, while the others went on to save
    launch("rewind", tmp_path)
    for rank in range(2):
        listed = json.loads((tmp_path / f"rewind_rank{rank}.json").read_text())
        assert [step for step, current in listed if current] == [1, 2], listed


def test_pipeline_stages_load_their_own_layers_and_layers_no_stage_holds_are_refused(tmp_path):
    launch("stages", tmp_path)
    got = [json.loads((tmp_path / f"stages_rank{rank}.json").read_text()) for rank in range(2)]
    for rank in range(2):
        assert got[rank]["loaded"], got[rank]  # the union of the stages is the checkpoint
        assert re.search(
            r"entry 'model' holds 4 tensors that the current module has on no rank, "
            r"e\.g\. \['model/b\.bias', 'model/b\.weight', 'model/c\.bias'\].*strict=False",
            got[rank]["refused"],
        ), got[rank]
        assert got[rank]["untouched"], got[rank]  # refused before anything was loaded
        assert got[rank]["a"] == got[0]["saved_a"] != 1.0  # strict=False: layer a, rank 0's


def test_replicas_asking_the_same_keys_load_strictly_and_refuse_on_every_rank_alike(tmp_path):
    launch("replicas_strict", tmp_path)
    got = [json.loads((tmp_path / f"replicas_rank{rank}.json").read_text()) for rank in range(2)]
    for rank in range(2):
        assert got[rank]["loaded"], got[rank]
        # the ranks asked the same keys: no object sent in the load holds them (all
        # gathered before, 16 kB from each rank here)
        assert max(got[rank]["sent"]) < got[rank]["keys_bytes"], got[rank]
        assert re.search(
            r"entry 'model' holds 2 tensors that the current module has on no rank, "
            r"e\.g\. \['model/l63\.bias', 'model/l63\.weight'\]; was it saved from a "
            r"different model\?.*strict=False",
            got[rank]["fewer"],
        ), got[rank]
        # rank 1's optimizer (SGD) lacks state of the checkpoint's (AdamW): both ranks say so
        assert re.search(
            r"entry 'optimizer' lacks 128 tensors of the current optimizer on rank 1, e\.g\. "
            r"\['optimizer/state\.l00\.weight\.momentum_buffer'.*; the optimizer keeps "
            r"other state than the checkpoint's \(another optimizer class",
            got[rank]["other_class"],
        ), got[rank]
        assert got[rank]["untouched"], got[rank]  # refused before anything was loaded


def test_a_save_before_the_first_step_changes_no_rank_and_a_checkpoint_is_no_root(tmp_path):
    launch("before_first_step", tmp_path)
    assert [c.step for c in Checkpointer(tmp_path).list()] == [0]


def test_state_one_rank_cannot_save_is_refused_on_every_rank_before_any_write(tmp_path):
    root = tmp_path / "ckpt"
    launch("unsaveable_on_one_rank", root)
    got = [json.loads((root / f"unsaveable_rank{rank}.json").read_text()) for rank in range(2)]
    for mode in ("False", "True"):
        assert got[1][mode].startswith(
            "TypeError: _rank/00001/loader['seen']: cannot save a builtins.set"
        ), got[1]
        assert got[0][mode].startswith(
            "CheckpointError: rank 1 cannot save its state (TypeError: "
            "_rank/00001/loader['seen']: cannot save a builtins.set"
        ), got[0]
        assert got[0][mode].endswith("no rank wrote anything"), got[0]
        assert got[0][f"{mode} files"] == got[1][f"{mode} files"] == [], got
    assert got[0]["listed"] == got[1]["listed"] == [1], got


@pytest.fixture(scope="module")
def replicated_checkpoints(tmp_path_factory):
    """Steps 1 (sync) and 2 (async) of two ranks holding a plain replicated tensor, a
    Replicate() DTensor and a Shard(0) DTensor; and the save stats of each rank."""
    root = tmp_path_factory.mktemp("replicated")
    launch("replicated", root)
    stats = [json.loads((root / f"replicated_rank{r}.json").read_text()) for r in range(2)]
    return root, stats


@pytest.mark.parametrize("step", [1, 2], ids=["sync", "async"])
def test_two_ranks_record_the_checksums_they_computed_while_writing(replicated_checkpoints, step):
    root, stats = replicated_checkpoints
    dirname = f"step_{step:010d}"
    manifest = json.loads((root / dirname / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    storage = Storage(root)
    fresh = {name: file_checksum(storage, dirname, name) for name in manifest["files"]}
    assert manifest["checksums"] == fresh
    for rank in range(2):
        s = stats[rank][step - 1]
        assert (s["step"], s["async_save"]) == (step, step == 2)
        # every file's checksum, rank 1's shard included, came from the write: none was
        # read back by the commit
        assert s["checksums_in_write"] == s["files"] == 3, s


@pytest.mark.parametrize("step", [1, 2], ids=["sync", "async"])
def test_each_replicated_tensor_is_staged_by_one_rank_only(replicated_checkpoints, step):
    _, stats = replicated_checkpoints
    staged = [stats[rank][step - 1]["rank_bytes"] for rank in range(2)]
    replicated_bytes = REPLICATED_NUMEL * 4
    shard_bytes = SHARDED_NUMEL * 4 // 2
    # each rank its shard; of the two replicated tensors, one each (the owners balance the
    # bytes), not both on both ranks; plus the small per-rank JSON entries
    for rank_bytes in staged:
        assert shard_bytes + replicated_bytes <= rank_bytes < shard_bytes + 1.1 * replicated_bytes
    assert sum(staged) < 2 * shard_bytes + 2.2 * replicated_bytes


def test_a_replicated_tensor_is_written_once_not_once_per_rank(replicated_checkpoints):
    import torch.distributed.checkpoint as dcp

    root, _ = replicated_checkpoints
    step = root / "step_0000000001"
    per_rank = {r: (step / f"__{r}_0.distcp").stat().st_size for r in range(2)}
    replicated_bytes = REPLICATED_NUMEL * 4  # each of the two replicated tensors
    tensor_bytes = 2 * replicated_bytes + SHARDED_NUMEL * 4  # one copy of everything
    # each tensor once, plus torch.save's framing and the small JSON entries; a second copy
    # of a replicated tensor would add 1 MiB
    assert tensor_bytes <= sum(per_rank.values()) < tensor_bytes + replicated_bytes // 8, per_rank
    # and DCP's metadata places each replicated tensor in one rank's file (which one is the
    # planner's choice: it balances the ranks' bytes)
    storage = dcp.FileSystemReader(str(step)).read_metadata().storage_data
    for fqn in ("model/replicated", "model/replicated_dtensor"):
        (info,) = [info for index, info in storage.items() if index.fqn == fqn]
        assert info.relative_path in {"__0_0.distcp", "__1_0.distcp"}
        assert info.length >= replicated_bytes
