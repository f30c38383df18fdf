"""The campaign's measurements: turning what the runs left (metrics records, checkpoints)
into figures: productive time of the surviving steps, the bit-for-bit comparison of the
final state with the uninterrupted run's, the campaign run's own checkpoint saves, the
checkpoint stall of ``Checkpointer.save`` (sync vs async, in a 2-process gloo job), the
start-up cost of a fresh worker, the utilisation projection to the ``hlat-7b`` state at a
cluster's fault rate, and the summary that gathers them (``summary.json``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .harness import TORCHRUN_2, Attempt, Fault

# the script whose hidden ``--_measure-save`` option runs ``measure_save_worker`` under torchrun
ENTRY_POINT = Path(__file__).resolve().parents[1] / "fault_campaign.py"
HOUR = 3600.0

# The hlat-7b checkpoint state, for the projection: 6.74 G parameters, bf16 weights and
# bf16 AdamW moments (precision "bf16-sr", hlat_optim's default state dtype): 6 bytes each.
HLAT_7B_PARAMS = 6.74e9
HLAT_7B_BYTES_PER_PARAM = 6
HLAT_NODES = 64  # HLAT's 7B run: the state is sharded over every node's host memory
HLAT_MTBF_S = 6 * HOUR


def surviving(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the final trajectory: for a step logged more than once, the last."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def productive_s(records: list[dict[str, Any]]) -> float:
    """Time of the steps that survive in the final trajectory (the trainer's ``step_s``:
    data, forward, backward, clip, optimizer; not start-up, checkpoints or redone steps)."""
    return sum(r["step_s"] for r in surviving(records))


def compare_final(run_dir: Path, ref_dir: Path) -> dict[str, Any]:
    """Consolidate both final checkpoints and compare every tensor and value exactly."""
    import torch

    from hlat_ckpt import consolidate

    mine = consolidate(str(run_dir / "checkpoints"))
    ref = consolidate(str(ref_dir / "checkpoints"))
    mismatches: list[str] = []
    count = 0

    def walk(a: Any, b: Any, where: str) -> None:
        nonlocal count
        if isinstance(b, dict):
            if not isinstance(a, dict) or set(a) != set(b):
                mismatches.append(f"{where}: keys differ")
                return
            for key in b:
                walk(a[key], b[key], f"{where}.{key}")
        elif torch.is_tensor(b):
            count += 1
            if not (torch.is_tensor(a) and a.dtype == b.dtype and torch.equal(a, b)):
                mismatches.append(where)
        elif a != b:
            mismatches.append(where)

    walk(mine.get("model"), ref.get("model"), "model")
    walk(mine.get("optimizer"), ref.get("optimizer"), "optimizer")
    mine_losses = [r["loss"] for r in surviving(_read(run_dir))]
    ref_losses = [r["loss"] for r in surviving(_read(ref_dir))]
    # a NaN drill logs NaN in both runs; NaN != NaN, so compare it as a value
    losses_equal = len(mine_losses) == len(ref_losses) and all(
        a == b or (math.isnan(a) and math.isnan(b))
        for a, b in zip(mine_losses, ref_losses, strict=True)
    )
    return {
        "bit_identical": not mismatches and count > 0,
        "tensors_compared": count,
        "mismatches": mismatches[:20],
        "loss_trajectory_identical": losses_equal,
    }


def _read(run_dir: Path, kind: str = "train") -> list[dict[str, Any]]:
    """The records of one ``kind`` in a run's ``metrics.jsonl`` (records without a kind are
    training steps)."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("kind", "train") == kind:
                out.append(record)
    return out


def checkpoint_saves(run_dir: Path) -> dict[str, Any]:
    """The campaign run's own saves, from the ``checkpoint`` records hlat-train writes for
    every committed save: how many, and the median stall (the training loop blocked), write
    time (in the background) and size."""
    saves = _read(run_dir, "checkpoint")
    if not saves:
        return {"saves": 0}
    return {
        "saves": len(saves),
        "stall_median_s": statistics.median(r["stall_s"] for r in saves),
        "write_median_s": statistics.median(r["write_s"] for r in saves),
        "save_median_s": statistics.median(r["save_s"] for r in saves),
        "bytes": statistics.median(r["bytes"] for r in saves),
    }


# --- checkpoint stall: timed around Checkpointer.save in a 2-process gloo job ----------------


def measure_save_worker(out: str, sizes: list[int], repeats: int) -> None:
    """Runs under torchrun: for each model width, a model + AdamW state saved by
    ``hlat_ckpt.Checkpointer`` synchronously and asynchronously; the time ``save()`` blocks."""
    import tempfile

    import torch
    import torch.distributed as dist

    from hlat_ckpt import Checkpointer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    for width in sizes:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
        row: dict[str, Any] = {"width": width, "state_bytes_per_rank": state_bytes}
        for mode in ("sync", "async"):
            root = tempfile.mkdtemp(prefix=f"stall-{mode}-", dir=os.environ["STALL_DIR"])
            ckpt = Checkpointer(root, keep_last=2, async_save=mode == "async")
            times = []
            for step in range(1, repeats + 2):
                dist.barrier()
                start = time.perf_counter()
                ckpt.save(step, {"model": model, "optimizer": opt})
                elapsed = time.perf_counter() - start
                if step > 1:  # the first save pays one-time set-up (groups, buffers)
                    times.append(elapsed)
                ckpt.wait()  # a step of real training would run here
            ckpt.close()
            row[f"{mode}_s"] = statistics.median(times)
        results.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_stall(out_dir: Path, quick: bool) -> dict[str, Any]:
    """Median time ``Checkpointer.save`` blocks the caller, sync vs async, at two state sizes;
    a line through them gives the fixed cost and the staging bandwidth."""
    sizes = [128, 512] if quick else [256, 1536]
    repeats = 3 if quick else 5
    result = out_dir / "stall.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STALL_DIR": str(out_dir)}
    cmd = [
        *TORCHRUN_2,
        str(ENTRY_POINT),
        "--_measure-save",
        str(result),
        "--_sizes",
        ",".join(map(str, sizes)),
        "--_repeats",
        str(repeats),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the checkpoint stall measurement failed:\n{done.stdout}{done.stderr}")
    rows = json.loads(result.read_text())
    small, large = rows[0], rows[-1]
    d_bytes = large["state_bytes_per_rank"] - small["state_bytes_per_rank"]
    d_async = max(large["async_s"] - small["async_s"], 1e-9)
    bandwidth = d_bytes / d_async
    fixed = max(0.0, small["async_s"] - small["state_bytes_per_rank"] / bandwidth)
    return {
        "rows": rows,
        "staging_bandwidth_gb_s": bandwidth / 1e9,
        "async_fixed_s": fixed,
        "async_over_sync": [r["async_s"] / r["sync_s"] for r in rows],
    }


def measure_startup(repeats: int = 3) -> dict[str, float]:
    """Median seconds for a fresh interpreter to start, to import torch, and to import what a
    hlat-train worker imports before its first step: the floor of any restart."""
    snippets = {
        "python": "pass",
        "import torch": "import torch, torch.distributed",
        "import hlat-train and its packages": (
            "import hlat_train.trainer, hlat_ckpt, hlat_data, hlat_model, hlat_optim, hlat_parallel"
        ),
    }
    out = {}
    for name, code in snippets.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


# --- the projection --------------------------------------------------------------------------


def project(restart_s: float, stall_s: float, mtbf_s: float) -> dict[str, float]:
    """utilisation = 1 - (restart latency + lost work) / MTBF - stall / interval, with the
    interval by Young/Daly, sqrt(2 x stall x MTBF), and the expected lost work half of it."""
    interval = math.sqrt(2 * stall_s * mtbf_s)
    lost = interval / 2
    utilisation = 1 - (restart_s + lost) / mtbf_s - stall_s / interval
    return {
        "mtbf_s": mtbf_s,
        "restart_latency_s": restart_s,
        "stall_s": stall_s,
        "interval_s": interval,
        "expected_lost_work_s": lost,
        "utilisation": utilisation,
    }


def median_restart_latency(faults: list[dict[str, Any]], kinds: tuple[str, ...]) -> float:
    """The median restart latency of the injected faults of ``kinds`` in a summary's
    ``faults`` (NaN without any)."""
    values = [
        f["restart_latency_s"]
        for f in faults
        if f["kind"] in kinds and not math.isnan(f["restart_latency_s"])
    ]
    return statistics.median(values) if values else math.nan


def summarise(
    *,
    steps: int,
    seed: int,
    every: int,
    span: int,
    quick: bool,
    corrupt: str,
    kinds: tuple[str, ...],
    hang_timeout: float,
    nan_steps: list[int],
    faults: list[Fault],
    ref: dict[str, Any],
    wall: float,
    records: list[dict[str, Any]],
    attempts: list[Attempt],
    run_dir: Path,
    final: dict[str, Any],
    stall: dict[str, Any],
    startup: dict[str, float],
) -> dict[str, Any]:
    """The campaign's figures, as ``summary.json`` holds them (without ``command``): the
    set-up, the campaign and reference runs' terms, each fault, the final comparison, the
    stall and start-up measurements and the projections to ``hlat-7b``."""
    injected = [f for f in faults if not math.isnan(f.at)]
    # a NaN is handled inside the job: no restart, nothing lost, not a stop of the job
    stopping = [f for f in injected if f.kind != "nan"]
    hangs = [f.detection_latency_s for f in injected if f.kind == "hang-rank"]
    restarts = [f.restart_latency_s for f in stopping]
    counts: dict[str, int] = {}
    for f in injected:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    productive = productive_s(records)
    ref_productive = productive_s(ref["records"])
    restart_median = statistics.median(restarts) if restarts else math.nan
    fixed, bw = stall["async_fixed_s"], stall["staging_bandwidth_gb_s"] * 1e9
    per_node = HLAT_7B_PARAMS * HLAT_7B_BYTES_PER_PARAM / HLAT_NODES
    projection = project(restart_median, fixed + per_node / bw, HLAT_MTBF_S)
    projection["state_bytes_per_node"] = per_node
    one_node = project(
        restart_median, fixed + HLAT_7B_PARAMS * HLAT_7B_BYTES_PER_PARAM / bw, HLAT_MTBF_S
    )
    return {
        "setup": {
            "steps": steps,
            "seed": seed,
            "checkpoint_every": every,
            "mean_gap_steps": span / len(faults),
            "model": "2-layer 64-wide" if quick else "4-layer 128-wide",
            "quick": quick,
            "corrupt": corrupt,
            "kinds": list(kinds),
        },
        "campaign": {
            "wall_s": wall,
            "productive_s": productive,
            "utilisation": productive / wall,
            "faults_injected": len(injected),
            "kinds": counts,
            "launches": len(attempts),
            "mtbf_s": wall / max(len(stopping), 1),
            "restart_latency_median_s": restart_median,
            "restart_latency_max_s": max(restarts) if restarts else math.nan,
            "lost_work_mean_s": statistics.mean(f.lost_work_s for f in stopping)
            if stopping
            else math.nan,
            "hang_timeout_s": hang_timeout,
            "hang_detection_latency_median_s": statistics.median(hangs) if hangs else math.nan,
            "hang_detection_latency_max_s": max(hangs) if hangs else math.nan,
            "nan_steps": nan_steps,
            "nan_caught": sum(1 for f in injected if f.kind == "nan"),
            "steps_logged": len(records),
            "steps_final": len(surviving(records)),
            "checkpoint_saves": checkpoint_saves(run_dir),
        },
        "reference": {
            "wall_s": ref["wall_s"],
            "productive_s": ref_productive,
            "utilisation": ref_productive / ref["wall_s"],
        },
        "faults": [asdict(f) for f in faults],
        "final": final,
        "stall": stall,
        "startup": startup,
        "projection_hlat_7b": projection,
        "projection_hlat_7b_one_node": one_node,
    }
