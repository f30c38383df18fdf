"""The examples of docs/reuse run for real: each package inside a trainer it was not written
for, on CPU, on tiny shapes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
REUSE = ROOT / "docs" / "reuse"

pytestmark = pytest.mark.slow


def _torchrun(script: Path, *args: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [*cmd, str(script), *args],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def _worker_pids(launcher: int) -> list[int]:
    """The worker processes torchrun started (its children)."""
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(launcher)], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]


def test_ddp_loop_resumes_after_a_sigkill_and_ends_where_an_uninterrupted_run_does(tmp_path):
    from hlat_ckpt import Checkpointer, consolidate

    script = REUSE / "ddp_auto_resume.py"
    whole = _torchrun(script, str(tmp_path / "whole"), "40")
    output, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, output[-3000:]

    out = tmp_path / "killed"
    first = _torchrun(script, str(out), "40")
    deadline = time.monotonic() + 120
    while not any(c.step >= 10 for c in Checkpointer(str(out / "checkpoints")).list()):
        assert first.poll() is None and time.monotonic() < deadline, "no checkpoint at step 10"
        time.sleep(0.2)
    os.kill(_worker_pids(first.pid)[0], signal.SIGKILL)
    killed, _ = first.communicate(timeout=120)
    assert first.returncode != 0, killed[-2000:]
    kept = [c.step for c in Checkpointer(str(out / "checkpoints")).list()]
    assert kept and max(kept) < 40

    again = _torchrun(script, str(out), "40")
    resumed, _ = again.communicate(timeout=300)
    assert again.returncode == 0, resumed[-3000:]
    # it started after the newest checkpoint, not from step 1
    assert f"step {max(kept) + 1} loss" in resumed and "step 1 loss" not in resumed
    a = consolidate(str(tmp_path / "whole" / "checkpoints"))
    b = consolidate(str(out / "checkpoints"))
    for part in ("model", "optimizer"):
        flat_a, flat_b = _tensors(a[part]), _tensors(b[part])
        assert flat_a.keys() == flat_b.keys() and flat_a
        assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), part


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by its path."""
    if torch.is_tensor(tree):
        return {prefix: tree}
    if isinstance(tree, dict):
        found = {}
        for key, value in tree.items():
            found.update(_tensors(value, f"{prefix}/{key}"))
        return found
    if isinstance(tree, (list, tuple)):
        return _tensors(dict(enumerate(tree)), prefix)
    return {}
