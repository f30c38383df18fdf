"""docs/reuse/torchtitan_hlat_optim_data.py: hlat-optim's AdamW and schedule and hlat-data's
PackedLoader inside torchtitan's Trainer, on CPU with gloo, killed and restarted from
torchtitan's own (DCP) checkpoint.

The example runs in subprocesses: it patches torchtitan at import, and torchtitan's trainer
starts a process group and turns Python's garbage collector off in the process it runs in.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="the example needs torchtitan (pip install torchtitan)")
pytest.importorskip("hlat_data", reason="the example needs hlat-data[torch]")
if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "torchtitan 0.3 imports triton, which torch's CPU wheels do not bring (pip install triton)",
        allow_module_level=True,
    )
if tuple(int(x) for x in importlib.metadata.version("torchtitan").split(".")[:2]) < (0, 3):
    pytest.skip(
        "the example is written for torchtitan 0.3's Configurable API", allow_module_level=True
    )

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "reuse" / "torchtitan_hlat_optim_data.py"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "two-processes-fsdp"])
def test_torchtitan_trains_with_hlat_optim_and_data_and_restarts_exactly(tmp_path, nproc):
    from torch.distributed.checkpoint import FileSystemReader

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path), "--nproc", str(nproc)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["restarted_at_step"] == 5
    assert report["batches_equal_after_restart"] and report["losses_equal_after_restart"]

    # The records themselves: the killed run drew batches 1-7, the restarted one 5-12, each
    # rank its own share, equal token for token to the uninterrupted run's.
    for rank in range(nproc):
        whole = _records(tmp_path / "whole" / f"record-rank{rank}.jsonl")
        resumed = _records(tmp_path / "resumed" / f"record-rank{rank}.jsonl")
        assert [r["batch"] for r in whole] == list(range(1, 13))
        assert [r["batch"] for r in resumed] == [*range(1, 8), *range(5, 13)]
        by_index = {r["batch"]: r["input_ids"] for r in whole}
        for r in resumed:
            assert r["input_ids"] == by_index[r["batch"]], (rank, r["batch"])
        assert len({json.dumps(ids) for ids in by_index.values()}) == 12
    if nproc == 2:
        shares = [_records(tmp_path / "whole" / f"record-rank{r}.jsonl") for r in range(2)]
        assert all(a["input_ids"] != b["input_ids"] for a, b in zip(*shares, strict=True))

    whole_losses = {r["step"]: r for r in _records(tmp_path / "whole" / "losses.jsonl")}
    resumed_log = _records(tmp_path / "resumed" / "losses.jsonl")
    assert [r["step"] for r in resumed_log] == [*range(1, 8), *range(5, 13)]
    for r in resumed_log:  # steps 5-7 ran twice: before the kill and after the restart
        assert r["loss"] == whole_losses[r["step"]]["loss"], r["step"]
        assert r["lr"] == whole_losses[r["step"]]["lr"], r["step"]
    losses = [whole_losses[s]["loss"] for s in range(1, 13)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.8, losses  # it learns (about 6.6 to 5.3)
    # hlat-optim's schedule: linear warmup from 0 over 2 steps, cosine down to 0.1 x 3e-3
    lrs = [whole_losses[s]["lr"] for s in range(1, 13)]
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(3e-3) and lrs[-1] < lrs[3]

    # torchtitan's checkpoint holds hlat-optim's state (bf16 moments, its rounding seed) and
    # every rank's hlat-data cursor
    meta = FileSystemReader(str(tmp_path / "resumed" / "checkpoint" / "step-4")).read_metadata()
    keys = meta.state_dict_metadata
    moments = [k for k in keys if k.startswith("optimizer.state.") and k.endswith(".exp_avg")]
    assert moments and all(str(keys[k].properties.dtype) == "torch.bfloat16" for k in moments)
    assert any(k.startswith("optimizer.param_groups.") and k.endswith(".seed") for k in keys)
    assert {f"dataloader.dp_rank_{r}" for r in range(nproc)} <= keys.keys()
    assert "lr_scheduler.last_epoch" in keys
