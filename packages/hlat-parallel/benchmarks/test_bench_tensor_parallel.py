"""Tensor parallelism on a CPU: tokens/s at tp 1 and tp 2, and the bytes each collective
moves per step against Megatron-LM's analytic count for TP + SP.

On a 2-core machine TP cannot add compute (tp 2 runs two 1-thread processes where tp 1 runs
one 2-thread process, plus the collectives); the point is to measure what it costs or saves
there and to check that the traffic is what the layout predicts. Each configuration trains the `tiny`
Llama (fp32, batch 4 x 256 tokens, no activation checkpointing) in its own processes; the
timed steps are measured inside them, after warm-up.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("tp_worker.py")
STEPS = 4
CORES = 2  # the machine this suite targets; tp ranks share them


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(out: Path, tp: int, sp: bool, threads: int) -> dict:
    port = _free_port()
    procs = []
    for rank in range(tp):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(tp),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
        }
        cmd = [sys.executable, str(WORKER), str(out), str(tp), "1" if sp else "0", str(STEPS)]
        procs.append(subprocess.Popen(cmd, env=env))
    for proc in procs:
        assert proc.wait(timeout=600) == 0
    return json.loads(out.read_text())


def megatron_sp_bytes(batch: int, seq: int, dim: int, layers: int, tp: int) -> dict:
    """Bytes per rank per training step of Megatron-LM TP + SP (fp32 activations).

    Per layer, forward: an all-gather before attention and before the MLP, a reduce-scatter
    after each; backward: the conjugates (2 reduce-scatters, 2 all-gathers). Outside the
    layers: the embedding's reduce-scatter (forward) and all-gather (backward), the LM
    head's all-gather (forward) and reduce-scatter (backward). Each moves the full
    [batch, seq, dim] activation, of which a ring sends (tp-1)/tp per rank. Loss-parallel
    statistics and norm-weight gradients (a few KB) are left out.
    """
    activation = batch * seq * dim * 4
    per_call = activation * (tp - 1) / tp
    calls = 4 * layers + 2
    return {"all_gather": calls * per_call, "reduce_scatter": calls * per_call}


# tp1 with both cores as intra-op threads, and with one thread (the per-rank share at tp 2:
# on a busy machine, two threads waiting on each other suffer most from preemption).
LAYOUTS = [
    ("tp1", 1, False, CORES),
    ("tp1-1thread", 1, False, 1),
    ("tp2", 2, False, CORES // 2),
    ("tp2-sp", 2, True, CORES // 2),
]


@pytest.mark.parametrize("name, tp, sp, threads", LAYOUTS)
def test_tokens_per_second(benchmark, tmp_path, tp_results, name, tp, sp, threads):
    args = (tmp_path / "out.json", tp, sp, threads)
    result = benchmark.pedantic(run_job, args=args, rounds=1)
    c = result["config"]
    result["analytic"] = megatron_sp_bytes(c["batch"], c["seq"], c["dim"], c["layers"], tp)
    tp_results[name] = result
    benchmark.extra_info.update(
        tokens_per_s=round(result["tokens_per_s"], 1), bytes_per_rank=result["bytes_per_rank"]
    )
