"""Pipeline parallelism on 2 CPU processes: each schedule's measured bubble against its
theoretical one, and tokens/s of PP2 against DP2 and one process on the same model and
global batch.

Measured bubble of a rank = step time / busy time - 1, where busy time is that rank's own
stage forward and backward over the same micro-batches run back to back without
communication (benchmarks/pp_worker.py). The theory is ``hlat_parallel.bubble_fraction``
(the papers' idealised figures: equal stage costs, free communication). Every process runs
one intra-op thread, so PP2 and DP2 use both cores and the single process one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("pp_worker.py")
STEPS = 5


def run_job(out: Path, m: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    subprocess.run([*cmd, str(WORKER), str(out), str(m), str(STEPS)], env=env, check=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("m", [4, 8])
def test_pipeline_bubbles_and_throughput(benchmark, tmp_path, pp_results, cpu, m):
    result = benchmark.pedantic(run_job, args=(tmp_path / "out.json", m), rounds=1, iterations=1)
    tokens = m * result["config"]["micro_batch"] * result["config"]["seq"]
    table = {}
    for name in ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"):
        r = result[name]
        bubbles = [rank["step_s"] / rank["busy_s"] - 1 for rank in r["ranks"]]
        table[name] = {
            "theory": r["theory"],
            "measured": max(bubbles),
            "tokens_per_s": tokens / r["ranks"][0]["step_s"],
        }
        assert all(b > -0.5 for b in bubbles), (name, bubbles)  # busy time is a real lower bound
    for name in ("DP2", "single"):
        table[name] = {"tokens_per_s": tokens / result[name]["step_s"]}
    benchmark.extra_info.update({"cpu": cpu, "m": m, "table": table})
    pp_results[m] = table
