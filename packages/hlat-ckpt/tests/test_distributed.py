"""Two-process jobs on real gloo groups: a TP=2 DTensor checkpoint loads at other layouts;
each rank checks the checksums of its own shard files."""

import json
import shutil

import pytest
import torch
from ckpt_helpers import launch
from ckpt_workers import tp_model

from hlat_ckpt import MANIFEST_NAME, Checkpointer

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
