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


def measure_save_worker(out: str, sizes: list[str], repeats: int) -> None:
    """Runs under torchrun: for each model shape (``"<dim>x<layers>"``), hlat's own state as
    a run of ``hlat-7b``'s precision holds it (a ``hlat_model.Llama`` in bf16 with
    ``hlat_optim.AdamW``'s stochastic rounding and bf16 moments, FSDP over the ranks through
    ``hlat_parallel``, built on the meta device and initialised per shard as the trainer
    does), saved by ``hlat_ckpt.Checkpointer`` synchronously and asynchronously: the time
    ``save()`` blocks, the background write of the async saves, and a load of the state."""
    import shutil

    import torch
    import torch.distributed as dist

    from hlat_ckpt import Checkpointer
    from hlat_model import Llama, LlamaConfig
    from hlat_optim import AdamW
    from hlat_parallel import init_parallel, parallelize, shard_optimizer

    dims = init_parallel(tp=1)
    results = []
    for spec in sizes:
        dim, layers = (int(x) for x in spec.split("x"))
        config = LlamaConfig.preset(
            "tiny", dim=dim, n_layers=layers, n_heads=dim // 64, n_kv_heads=dim // 64,
            ffn_dim=dim * 8 // 3 // 64 * 64, vocab_size=32000, max_seq_len=256,
        )  # fmt: skip
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Llama(config)
        parallelize(model.to(torch.bfloat16), dims, model.parallel_plan())
        model.to_empty(device="cpu")
        model.init_weights()
        opt = shard_optimizer(AdamW, model.parameters(), dims, lr=1e-4, stochastic_rounding=True)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # creates the moments
        opt.zero_grad()
        local = [t.to_local() if hasattr(t, "to_local") else t for t in model.parameters()]
        moments = [
            v.to_local() if hasattr(v, "to_local") else v
            for state in opt.state.values()
            for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0
        ]
        state_bytes = sum(t.numel() * t.element_size() for t in [*local, *moments])
        row: dict[str, Any] = {
            "shape": spec,
            "params": sum(p.numel() for p in model.parameters()),
            "state_bytes_per_rank": state_bytes,
        }
        state = {"model": model, "optimizer": opt}
        for mode in ("sync", "async"):
            # one root for all ranks (a temporary name per rank would split the checkpoint)
            root = os.path.join(os.environ["STALL_DIR"], f"stall-{mode}-{spec}")
            ckpt = Checkpointer(root, keep_last=1, async_save=mode == "async", save_rng=False)
            times, writes = [], []
            for step in range(1, repeats + 2):
                dist.barrier()
                start = time.perf_counter()
                ckpt.save(step, state)
                elapsed = time.perf_counter() - start
                ckpt.wait()  # a step of real training would run here
                if step > 1:  # the first save pays one-time set-up (groups, buffers)
                    times.append(elapsed)
                    writes.extend(s.write_s for s in ckpt.pop_save_stats())
                else:
                    ckpt.pop_save_stats()
            row[f"{mode}_s"] = statistics.median(times)
            if mode == "async":
                row["async_write_s"] = statistics.median(writes)
                dist.barrier()
                start = time.perf_counter()
                if ckpt.load_latest(state) != repeats + 1:
                    raise RuntimeError(f"the last save of {spec} did not load back")
                row["load_s"] = time.perf_counter() - start
            ckpt.close()
            dist.barrier()
            if dims.rank == 0:  # gigabytes each at the largest size
                shutil.rmtree(root, ignore_errors=True)
        results.append(row)
        del state, opt, model
    if dims.rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_stall(out_dir: Path, quick: bool) -> dict[str, Any]:
    """Median time ``Checkpointer.save`` blocks the caller, sync vs async, the background
    write and a load, at two state sizes of hlat's model and optimizer; lines through them
    give the fixed cost and the rates of staging, writing and loading, per byte."""
    sizes = ["128x2", "256x2"] if quick else ["512x4", "2048x16"]
    repeats = 3 if quick else 5
    result = out_dir / "stall.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STALL_DIR": str(out_dir)}
    cmd = [
        *TORCHRUN_2,
        str(ENTRY_POINT),
        "--_measure-save",
        str(result),
        "--_sizes",
        ",".join(sizes),
        "--_repeats",
        str(repeats),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the checkpoint stall measurement failed:\n{done.stdout}{done.stderr}")
    rows = json.loads(result.read_text())
    small, large = rows[0], rows[-1]
    d_bytes = large["state_bytes_per_rank"] - small["state_bytes_per_rank"]

    def rate(key: str) -> float:
        return d_bytes / max(large[key] - small[key], 1e-9)

    bandwidth = rate("async_s")
    fixed = max(0.0, small["async_s"] - small["state_bytes_per_rank"] / bandwidth)
    return {
        "rows": rows,
        "model": "hlat_model.Llama, bf16, hlat_optim.AdamW (bf16-sr), FSDP over 2 ranks",
        "staging_bandwidth_gb_s": bandwidth / 1e9,
        "async_fixed_s": fixed,
        "async_over_sync": [r["async_s"] / r["sync_s"] for r in rows],
        # the largest state's own rates (a line through two points of a noisy disk can
        # come out steeper than either point)
        "write_gb_s": large["state_bytes_per_rank"] / large["async_write_s"] / 1e9,
        "sync_gb_s": large["state_bytes_per_rank"] / large["sync_s"] / 1e9,
        "load_gb_s": large["state_bytes_per_rank"] / large["load_s"] / 1e9,
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
    interval by Young/Daly, sqrt(2 x stall x MTBF), and the expected lost work half of it
    (the first-order model of earlier reports, kept for their before/after tables)."""
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


# HLAT's trn1 layout at 64 nodes: 32 NeuronCores (ranks) per node, TP 8, so 4 data-parallel
# replicas of the weights per node (ZeRO-1 keeps weights whole over dp).
RANKS_PER_NODE = 32
HLAT_TP = 8
# docs/cluster/cost.md's throughput for hlat-7b on 64 trn1 nodes (MFU 0.35, an assumption):
# 1.48 M tokens/s, global batch 1024 x 4096 tokens
HLAT_7B_STEP_S = 1024 * 4096 / 1.48e6
# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4): 419 unexpected
# interruptions in 54 days of a 16,384-GPU job; scaled to 2,048 accelerators assuming
# interruptions grow with the accelerator count
LLAMA3_MTBF_AT_2048_H = 54 * 24 / 419 * 16384 / 2048
# Restart pieces a cluster adds and this machine cannot measure: (what, seconds, source)
CLUSTER_RESTART_ASSUMED = (
    (
        "Neuron runtime start and graph load from the node-local compile cache",
        60.0,
        "assumed: no public figure for a training restart found; the nearest is AWS's "
        "measurement of about 40 s to load Llama-2-7B onto a trn1.32xlarge at TP 32 from a "
        "pre-populated compile cache, weights included (an inference load: "
        "aws-neuron/transformers-neuronx issue 80, 2024-04-09); 60 s leaves room for the "
        "training graphs. Measure it with a restart on trn1",
    ),
    (
        "rendezvous and process groups at 2,048 ranks",
        30.0,
        "torchrun's c10d rendezvous waits its `last_call` timeout, 30 s by default "
        "(torch.distributed.elastic.rendezvous.dynamic_rendezvous), once the minimum of a "
        "node range (`--nnodes MIN:MAX`) has joined; a fixed node count completes when all "
        "join. Process-group creation at 2,048 ranks: no public figure found, measure it "
        "with `hlat-train preflight` at the job's size",
    ),
)


def project_hlat_7b(
    stall: dict[str, Any],
    restart_s: float,
    mtbf_hours: float,
    every: int | str,
) -> dict[str, Any]:
    """The utilisation of ``hlat-7b`` on 64 trn1 nodes, from this machine's measurements
    on hlat's own model and optimizer, scaled per byte, and the cluster pieces assumed in
    :data:`CLUSTER_RESTART_ASSUMED`; the interval is ``every`` as the preset sets it
    (``"auto"``: :func:`hlat_train.interval.daly_interval`, what the trainer picks), the
    utilisation :func:`hlat_train.interval.expected_utilisation`. Also the sensitivity to
    the MTBF (1 to 24 h) and to the interval, and the bytes each node stages."""
    from hlat_train.interval import daly_interval, expected_utilisation

    total = HLAT_7B_PARAMS * HLAT_7B_BYTES_PER_PARAM
    per_node = total / HLAT_NODES
    weights = HLAT_7B_PARAMS * 2  # bf16
    # ZeRO-1 if every rank staged its whole replica of the weights (hlat-ckpt < 0.7)
    zero1_every_rank = weights * RANKS_PER_NODE / HLAT_TP + (total - weights) / HLAT_NODES
    staging = stall["staging_bandwidth_gb_s"] * 1e9
    write_rate = stall["write_gb_s"] * 1e9
    stall_s = stall["async_fixed_s"] + per_node / staging
    write_s = per_node / write_rate
    load_s = per_node / write_rate
    assumed = sum(seconds for _, seconds, _ in CLUSTER_RESTART_ASSUMED)
    restart_total = restart_s + load_s + assumed
    mtbf_s = mtbf_hours * HOUR

    def interval_for(mtbf: float) -> float:
        if every == "auto":
            return max(daly_interval(stall_s, mtbf), write_s)
        return float(every) * HLAT_7B_STEP_S

    interval = interval_for(mtbf_s)
    utilisation = expected_utilisation(interval, stall_s, restart_total, mtbf_s)
    fixed_1000 = 1000 * HLAT_7B_STEP_S
    mtbf_grid = [float(h) for h in range(1, 25)]
    interval_grid = [60.0 * m for m in (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240)]
    return {
        "state_bytes": total,
        "state_bytes_per_node": per_node,
        "zero1_every_rank_bytes_per_node": zero1_every_rank,
        "stall_s": stall_s,
        "write_s": write_s,
        "restart_measured_s": restart_s,
        "restart_load_s": load_s,
        "restart_assumed": [list(x) for x in CLUSTER_RESTART_ASSUMED],
        "restart_total_s": restart_total,
        "mtbf_hours": mtbf_hours,
        "every": every,
        "interval_s": interval,
        "expected_lost_work_s": (interval + stall_s) / 2,
        "utilisation": utilisation,
        "utilisation_measured_restart_only": expected_utilisation(
            interval, stall_s, restart_s + load_s, mtbf_s
        ),
        "fixed_1000_steps_s": fixed_1000,
        "utilisation_fixed_1000_steps": expected_utilisation(
            fixed_1000, stall_s, restart_total, mtbf_s
        ),
        "llama3_mtbf_at_2048_h": LLAMA3_MTBF_AT_2048_H,
        "sensitivity": {
            "mtbf_hours": mtbf_grid,
            "auto": [
                expected_utilisation(interval_for(h * HOUR), stall_s, restart_total, h * HOUR)
                for h in mtbf_grid
            ],
            "fixed_1000_steps": [
                expected_utilisation(fixed_1000, stall_s, restart_total, h * HOUR)
                for h in mtbf_grid
            ],
            "interval_s": interval_grid,
            "at_interval": [
                expected_utilisation(i, stall_s, restart_total, mtbf_s) for i in interval_grid
            ],
        },
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
    from hlat_train import TrainConfig

    preset = TrainConfig.preset("hlat-7b").checkpoint
    projection = project_hlat_7b(stall, restart_median, preset.mtbf_hours, preset.every)
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
    }
