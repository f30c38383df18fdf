"""The README's quick-start (tests/readme_worker.py) at TP=2 with sequence parallelism, on a
real gloo group, prints the single-process loss and gradient norm."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from spawn import run_ranks

README_WORKER = Path(__file__).with_name("readme_worker.py")


def _printed_numbers(path: Path) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+", path.read_text())]


def test_the_readme_example_under_tp2_sp_prints_the_single_process_loss_and_norm(tmp_path):
    # TP ranks fed different batches compute a wrong loss without an error
    one, tp2 = tmp_path / "one", tmp_path / "tp2"
    one.mkdir()
    tp2.mkdir()
    run_ranks(README_WORKER, [str(one)], 1)
    run_ranks(README_WORKER, [str(tp2), "2"], 2)
    expected = _printed_numbers(one / "rank0.txt")
    assert len(expected) == 2, (one / "rank0.txt").read_text()  # loss, grad norm
    for rank in range(2):
        found = _printed_numbers(tp2 / f"rank{rank}.txt")
        # printed with 3 decimals: equal up to one unit in the last place
        assert found == pytest.approx(expected, abs=1.01e-3), f"rank {rank}: {found} {expected}"
