"""Fault campaign: measured goodput of a real `hlat-train train` job under injected faults.

Runs ``torchrun --nproc-per-node 2 --max-restarts N -m hlat_train train`` on a tiny Llama
(fp32, CPU, gloo) and, from a seeded schedule, injects:

- ``kill-rank``: SIGKILL of one worker (a crashed node); torchrun restarts the workers.
- ``kill-during-save``: SIGKILL of one worker while a checkpoint directory is being written
  (``step_<N>.tmp`` exists); torchrun restarts them, the partial checkpoint is ignored.
- ``sigterm``: SIGTERM to the whole job (a preemption, as Slurm or Kubernetes send it); the
  trainer saves and exits 143, and the campaign relaunches torchrun, as a scheduler would.
- ``corrupt-newest``: the job is SIGKILLed, a file of its newest checkpoint is truncated (a
  torn write on shared storage: a DCP shard by default, the manifest with ``--corrupt
  manifest``), and the campaign relaunches torchrun; resume must skip the damaged checkpoint
  and take the one before.
- ``hang-rank``: SIGSTOP of one worker (a wedged node, a hung collective): the other rank
  waits in a collective until its hang watchdog (``train.hang_timeout``, ``--hang-timeout``
  here) prints where it was and exits, and torchrun restarts the workers; the stopped
  process, which cannot act on torchrun's SIGTERM, is then SIGKILLed so it does not linger.
  Its *detection latency* is the time from the SIGSTOP to the watchdog's message.
- ``nan``: a non-finite loss at a step (``spike.inject_nan_at``, a drill key set to the same
  step in both runs, since it is configuration, not a signal): the trainer must drop that
  update (``action: skip``) and go on without a restart; the final state still equals the
  uninterrupted run's, which drops the same update.

``--kinds`` picks the kinds (all by default).

It measures wall time, productive time, effective utilisation, restart latency, lost work
per fault and checkpoint stall per save, checks that the final model and optimizer equal an
uninterrupted run with the same seed bit for bit, and writes ``summary.json``,
``timeline.png`` and (``--doc``) ``docs/reliability.md``.

    python tools/fault_campaign.py --faults 8 --seed 0 --out runs/faults --doc docs/reliability.md
    python tools/fault_campaign.py --quick --faults 2 --out /tmp/faults      # about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("kill-rank", "kill-during-save", "sigterm", "corrupt-newest", "hang-rank", "nan")
HANG_TIMEOUT_S = 5.0  # train.hang_timeout of both runs: the watchdog's limit per region
TORCHRUN_2 = (
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--nproc-per-node",
    "2",
    "--standalone",
)
HOUR = 3600.0

# The hlat-7b checkpoint state, for the projection: 6.74 G parameters, bf16 weights and
# bf16 AdamW moments (precision "bf16-sr", hlat_optim's default state dtype): 6 bytes each.
HLAT_7B_PARAMS = 6.74e9
HLAT_7B_BYTES_PER_PARAM = 6
HLAT_NODES = 64  # HLAT's 7B run: the state is sharded over every node's host memory
HLAT_MTBF_S = 6 * HOUR


@dataclass
class Fault:
    """One injected fault and what it cost."""

    kind: str
    after_steps: int  # scheduled: steps of progress after the previous recovery
    at: float = math.nan  # wall time of the injection, from the campaign start
    step_at_fault: int = 0  # newest step logged before the injection
    resumed_from: int = 0  # the step the next attempt continued from
    first_step_at: float = math.nan  # arrival of the first new step's record
    restart_latency_s: float = math.nan  # injection -> first new step begins
    to_resumed_s: float = math.nan  # injection -> "resumed from step" (start, imports, load)
    lost_work_s: float = math.nan  # wall time of work after `resumed_from` that was redone
    lost_steps: int = 0
    checkpoint_write_in_progress: bool | None = None
    detection_latency_s: float = math.nan  # hang-rank: SIGSTOP -> the watchdog's message
    at_step: int = 0  # nan: the step whose loss is made NaN (configured in both runs)
    detail: str = ""


@dataclass
class Attempt:
    """One torchrun launch: its process and a timestamped view of its output."""

    proc: subprocess.Popen[str]
    started: float
    lines: list[tuple[float, str]] = field(default_factory=list)


# --- setup -----------------------------------------------------------------------------------


def build_corpus(root: Path) -> dict[str, str]:
    """Train/valid Arrow files of standard-library modules and a 384-piece BPE model."""
    import pyarrow as pa

    from hlat_data import train_tokenizer
    from hlat_train.demo import stdlib_files

    root.mkdir(parents=True, exist_ok=True)
    texts: list[str] = []
    for path in stdlib_files()[:600]:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if len(text) > 200:
            texts.append(text[:4000])
        if len(texts) == 96:
            break

    def write(name: str, rows: list[str]) -> str:
        table = pa.table({"text": pa.array(rows, pa.string())})
        with pa.OSFile(str(root / name), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        return str(root / name)

    train = write("train.arrow", texts[:88])
    valid = write("valid.arrow", texts[88:])
    tokenizer = train_tokenizer(train, str(root / "bpe.model"), vocab_size=384)
    return {"train": train, "valid": valid, "tokenizer": tokenizer}


def model_overrides(quick: bool) -> list[str]:
    """The model and batch: 2 x 64 tokens on a 2-layer 64-wide Llama with ``--quick``,
    else 4 x 128 tokens on a 4-layer 128-wide one (steps of a few tens of ms here)."""
    if quick:
        return [
            "--model.dim=64",
            "--model.n_layers=2",
            "--model.n_heads=4",
            "--model.ffn_dim=128",
            "--model.max_seq_len=64",
            "--data.seq_len=64",
            "--data.micro_batch_size=2",
        ]
    return [
        "--model.dim=128",
        "--model.n_layers=4",
        "--model.n_heads=4",
        "--model.ffn_dim=352",
        "--model.max_seq_len=128",
        "--data.seq_len=128",
        "--data.micro_batch_size=4",
    ]


def write_config(
    corpus: dict[str, str],
    run_dir: Path,
    steps: int,
    every: int,
    quick: bool,
    async_save: bool,
    hang_timeout: float = HANG_TIMEOUT_S,
    nan_steps: list[int] | None = None,
) -> Path:
    """A TOML config for one run (validated by hlat-train as it is built)."""
    from hlat_train import TrainConfig

    overrides = [
        f'--data.paths=["{corpus["train"]}"]',
        f'--data.tokenizer="{corpus["tokenizer"]}"',
        f'--train.out_dir="{run_dir}"',
        f"--train.steps={steps}",
        "--train.eval_every=0",
        "--train.sample_prompt=''",
        "--train.time_limit=0",
        "--data.block_size=8",
        "--optim.warmup_steps=2",
        "--optim.lr=3e-3",
        "--optim.impl=reference",
        "--optim.precision=fp32",  # the preset's auto would follow the CPU
        f"--checkpoint.every={every}",
        "--checkpoint.keep_last=3",
        f"--checkpoint.async_save={'true' if async_save else 'false'}",
        "--logging.progress=false",
        "--logging.plot=false",
        f"--train.hang_timeout={hang_timeout}",
        f"--spike.inject_nan_at=[{', '.join(map(str, nan_steps or []))}]",
        *model_overrides(quick),
    ]
    config = TrainConfig.preset("tiny-demo", overrides)
    path = run_dir.with_suffix(".toml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_toml())
    return path


def launch(config: Path, max_restarts: int, t0: float) -> Attempt:
    """``torchrun --nproc-per-node 2 --max-restarts N -m hlat_train train``, in its own
    session (so a whole-job signal reaches the launcher and the workers, as a scheduler's
    does), with every output line timestamped as it arrives."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        *TORCHRUN_2,
        "--max-restarts",
        str(max_restarts),
        # Note: torchrun notices a dead worker only when it polls; its default of 0.1 s in
        # torch 2.13 is kept explicit because older releases polled every 5 s
        "--monitor-interval",
        "0.1",
        "-m",
        "hlat_train",
        "train",
        "--config",
        str(config),
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    attempt = Attempt(proc, time.monotonic() - t0)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            attempt.lines.append((time.monotonic() - t0, line.rstrip()))

    threading.Thread(target=pump, daemon=True).start()
    return attempt


class MetricsTail:
    """Follows ``metrics.jsonl`` and stamps each record with the wall time it appeared.

    Note: the trainer's records carry the step's own duration (``step_s``) but no clock
    time; the file is flushed after every step, so polling it every few milliseconds gives
    each step's completion time to within the poll interval.
    """

    def __init__(self, path: Path, t0: float) -> None:
        self.path, self.t0 = path, t0
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = ""

    def poll(self) -> None:
        """Read what was appended since the last poll."""
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self._offset)
            data = f.read()
            self._offset = f.tell()
        now = time.monotonic() - self.t0
        data = self._partial + data
        lines = data.split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                record = json.loads(line)
                if record.get("kind", "train") == "train":
                    record["_t"] = now
                    self.records.append(record)

    def last_step(self) -> int:
        """The newest step logged, 0 before the first."""
        return self.records[-1]["step"] if self.records else 0


def _workers(torchrun_pid: int) -> list[int]:
    try:
        with open(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:
        return []


def _writing(ckpt_dir: Path) -> set[str]:
    """Names of checkpoint directories being written (``step_<N>.tmp``) now."""
    try:
        return {p.name for p in ckpt_dir.iterdir() if p.name.endswith(".tmp")}
    except OSError:
        return set()


def _complete_steps(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.exists():
        return []
    return sorted(
        (p for p in ckpt_dir.iterdir() if p.is_dir() and not p.name.endswith(".tmp")),
        key=lambda p: p.name,
    )


def _signal_job(attempt: Attempt, sig: int) -> list[int]:
    """Send ``sig`` to the launcher and to every worker, as a scheduler signals all of a
    job's processes; returns the worker pids.

    Note: torchrun starts each worker in a session of its own, so signalling the launcher's
    process group alone would leave the workers running.
    """
    workers = _workers(attempt.proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(attempt.proc.pid, sig)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return workers


def _wait_gone(pids: list[int], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < end:
        time.sleep(0.01)


def _wait_exit(attempt: Attempt, tail: MetricsTail, timeout: float = 120) -> int:
    end = time.monotonic() + timeout
    while attempt.proc.poll() is None:
        if time.monotonic() > end:
            os.killpg(attempt.proc.pid, signal.SIGKILL)
            raise RuntimeError(f"torchrun did not exit within {timeout:.0f} s")
        tail.poll()
        time.sleep(0.01)
    tail.poll()
    return attempt.proc.returncode


# --- the campaign ----------------------------------------------------------------------------


def schedule(
    n: int, seed: int, span_steps: int, min_gap: int, kinds: tuple[str, ...] = KINDS
) -> list[Fault]:
    """``n`` faults of mixed kinds (every kind once before any repeats, in a seeded order),
    spread over ``span_steps`` steps of progress: exponentially distributed gaps of at least
    ``min_gap`` steps (so every attempt trains and checkpoints), scaled to fill the span.

    Note: the gaps count steps, not seconds, so the faults land at the same points of the
    run whatever the speed of the machine, and never after the run has finished.
    """
    rng = random.Random(seed)
    drawn: list[str] = []
    while len(drawn) < n:
        block = list(kinds)
        rng.shuffle(block)
        drawn += block
    draws = [rng.expovariate(1.0) for _ in range(n)]
    scale = span_steps / sum(draws)
    return [
        Fault(kind, max(min_gap, round(d * scale)))
        for kind, d in zip(drawn[:n], draws, strict=True)
    ]


def plan_nan_steps(faults: list[Fault], every: int, steps: int) -> list[int]:
    """The step of each ``nan`` fault, fixed before launch (``spike.inject_nan_at`` is
    configuration, set the same in both runs): where the schedule would put it if every
    earlier fault resumed from the checkpoint before its step. Only roughly where it lands
    among the other faults; it always lands inside the run."""
    base = every + 1  # the driver injects the first fault once a checkpoint exists
    for fault in faults:
        target = base + fault.after_steps
        if fault.kind == "nan":
            fault.at_step = max(every + 2, min(target, steps - 2))
            base = target
        else:
            base = max(every + 1, target - target % every + 1)
    return sorted({f.at_step for f in faults if f.kind == "nan"})


def run_reference(config: Path, run_dir: Path) -> dict[str, Any]:
    """The uninterrupted run: wall time and its records."""
    t0 = time.monotonic()
    tail = MetricsTail(run_dir / "metrics.jsonl", t0)
    attempt = launch(config, 0, t0)
    try:
        code = _wait_exit(attempt, tail, timeout=900)
    finally:
        if attempt.proc.poll() is None:
            _signal_job(attempt, signal.SIGKILL)
    if code != 0:
        tail_text = "\n".join(line for _, line in attempt.lines[-40:])
        raise RuntimeError(f"the reference run failed (exit {code}):\n{tail_text}")
    return {"wall_s": time.monotonic() - t0, "records": tail.records, "lines": attempt.lines}


def run_campaign(
    config: Path,
    run_dir: Path,
    faults: list[Fault],
    steps: int,
    every: int,
    corrupt: str = "shard",
    hang_timeout: float = HANG_TIMEOUT_S,
) -> tuple[float, list[dict[str, Any]], list[Attempt]]:
    """Run the job to completion while injecting ``faults``; return (wall, records, attempts)."""
    t0 = time.monotonic()
    tail = MetricsTail(run_dir / "metrics.jsonl", t0)
    restarts = len(faults) + 2
    attempts = [launch(config, restarts, t0)]
    try:
        return _drive(
            attempts,
            config,
            run_dir,
            faults,
            steps,
            every,
            corrupt,
            t0,
            tail,
            restarts,
            hang_timeout,
        )
    finally:
        for attempt in attempts:
            if attempt.proc.poll() is None:  # an error above: leave no job running
                _signal_job(attempt, signal.SIGKILL)
        save_logs(attempts, run_dir)


def _drive(
    attempts: list[Attempt],
    config: Path,
    run_dir: Path,
    faults: list[Fault],
    steps: int,
    every: int,
    corrupt: str,
    t0: float,
    tail: MetricsTail,
    restarts: int,
    hang_timeout: float = HANG_TIMEOUT_S,
) -> tuple[float, list[dict[str, Any]], list[Attempt]]:
    ckpt_dir = run_dir / "checkpoints"

    def first_new_step(after: int, since: float) -> tuple[dict[str, Any], int, float]:
        """The first record of the recovered job and the step it resumed from.

        Note: the surviving worker may still log a step after the other one died, so a
        record counts as new only once rank 0 of a new attempt has printed "resumed from
        step N" (after ``since``), or when it is step 1 of a fresh start.
        """
        end = time.monotonic() + 300
        while True:
            tail.poll()
            resumed_at, resumed = math.inf, 0
            for t, line in attempts[-1].lines:
                if t > since and "resumed from step" in line:
                    resumed_at, resumed = t, int(line.split("resumed from step")[1].split()[0])
                    break
            for r in tail.records[after:]:
                if r["_t"] > resumed_at or (r["step"] == 1 and r["_t"] > since):
                    return r, resumed if r["step"] > 1 else 0, resumed_at
            if attempts[-1].proc.poll() is not None:
                time.sleep(0.2)
                tail.poll()
                if all(r["_t"] <= resumed_at for r in tail.records[after:]):
                    text = "\n".join(line for _, line in attempts[-1].lines[-40:])
                    raise RuntimeError(f"the job ended before recovering:\n{text}")
            if time.monotonic() > end:
                raise RuntimeError("no step within 300 s of a fault")
            time.sleep(0.005)

    def watchdog_line(since: float, timeout: float) -> tuple[float, str]:
        """The first hang-watchdog message of the current attempt printed after ``since``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for t, line in attempts[-1].lines:
                if t > since and "hang watchdog: rank" in line:
                    return t, line
            if attempts[-1].proc.poll() is not None:
                break
            tail.poll()
            time.sleep(0.005)
        text = "\n".join(line for _, line in attempts[-1].lines[-40:])
        raise RuntimeError(f"no hang-watchdog message within {timeout:.0f} s of a SIGSTOP:\n{text}")

    # the first fault only once a checkpoint exists, as in any real run past its start
    while tail.last_step() <= every and attempts[0].proc.poll() is None:
        tail.poll()
        time.sleep(0.01)
    base = tail.last_step()  # where the progress that the next gap counts starts
    for fault in faults:
        if fault.kind == "nan":
            _check_nan(fault, tail, attempts[-1])
            base = max(base, fault.at_step)
            continue
        target = base + fault.after_steps
        while tail.last_step() < target and attempts[-1].proc.poll() is None:
            tail.poll()
            time.sleep(0.002)
        attempt = attempts[-1]
        if attempt.proc.poll() is not None or tail.last_step() >= steps - 1:
            fault.detail = "not injected: the job had finished"
            break
        writing: set[str] = set()
        if fault.kind == "kill-during-save":
            # Note: a directory left by an earlier kill is not a save in progress
            stale = _writing(ckpt_dir)
            end = time.monotonic() + 120
            while not (writing := _writing(ckpt_dir) - stale) and time.monotonic() < end:
                tail.poll()
                time.sleep(0.001)
        tail.poll()
        index = len(tail.records)
        fault.step_at_fault = tail.last_step()
        fault.at = time.monotonic() - t0
        if fault.kind in ("kill-rank", "kill-during-save"):
            workers = _workers(attempt.proc.pid)
            if not workers:
                raise RuntimeError("no worker processes found under torchrun")
            victim = workers[len(workers) // 2 if fault.kind == "kill-rank" else -1]
            os.kill(victim, signal.SIGKILL)
            if fault.kind == "kill-during-save":
                fault.checkpoint_write_in_progress = bool(writing & _writing(ckpt_dir))
            fault.detail = f"SIGKILL worker pid {victim}"
        elif fault.kind == "hang-rank":
            workers = _workers(attempt.proc.pid)
            if not workers:
                raise RuntimeError("no worker processes found under torchrun")
            victim = workers[len(workers) // 2]
            os.kill(victim, signal.SIGSTOP)
            seen_at, line = watchdog_line(fault.at, timeout=hang_timeout + 120)
            fault.detection_latency_s = seen_at - fault.at
            # Note: torchrun SIGTERMs the stopped worker, which cannot act on it while
            # stopped, and SIGKILLs it only 30 s later; a node agent would kill it now
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
            _wait_gone([victim])
            fault.detail = (
                f"SIGSTOP worker pid {victim}; after {fault.detection_latency_s:.2f} s: "
                f"{line.split('hang watchdog: ')[-1].split('. Dumping')[0]}; "
                "the stopped worker SIGKILLed"
            )
        elif fault.kind == "sigterm":
            workers = _signal_job(attempt, signal.SIGTERM)
            code = _wait_exit(attempt, tail)
            _wait_gone(workers)
            fault.detail = f"SIGTERM to the job; exit {code}"
            attempts.append(launch(config, restarts, t0))
        else:  # corrupt-newest
            workers = _signal_job(attempt, signal.SIGKILL)
            _wait_exit(attempt, tail)
            _wait_gone(workers)
            complete = _complete_steps(ckpt_dir)
            if not complete:
                fault.detail = "SIGKILL to the job; no checkpoint to corrupt"
            else:
                victim_file = (
                    complete[-1] / "hlat-checkpoint.json"
                    if corrupt == "manifest"
                    else sorted(complete[-1].glob("*.distcp"))[0]
                )
                size = victim_file.stat().st_size
                with open(victim_file, "r+b") as f:
                    f.truncate(size // 2)
                fault.detail = (
                    f"SIGKILL to the job; truncated {complete[-1].name}/{victim_file.name} "
                    f"from {size} to {size // 2} bytes"
                )
            attempts.append(launch(config, restarts, t0))
        first, fault.resumed_from, resumed_at = first_new_step(index, fault.at)
        fault.to_resumed_s = resumed_at - fault.at
        fault.first_step_at = first["_t"]
        base = first["step"]
        fault.restart_latency_s = first["_t"] - first["step_s"] - fault.at
        fault.lost_steps = max(0, fault.step_at_fault - fault.resumed_from)
        if fault.lost_steps == 0:  # a preemption saves the step it was on: nothing redone
            fault.lost_work_s = 0.0
        else:
            # the work after the checkpoint resumed from: from that step's record in the
            # attempt that died to the injection
            saved = [r["_t"] for r in tail.records[:index] if r["step"] == fault.resumed_from]
            since = saved[-1] if saved else attempts[0].started
            fault.lost_work_s = max(0.0, fault.at - since)
    code = _wait_exit(attempts[-1], tail, timeout=900)
    if code != 0:
        raise RuntimeError(f"the campaign job failed (exit {code}); see {run_dir}/launch-*.log")
    return time.monotonic() - t0, tail.records, attempts


def _check_nan(fault: Fault, tail: MetricsTail, attempt: Attempt, timeout: float = 600) -> None:
    """A ``nan`` fault: wait for the record of its step and check that the trainer caught
    the non-finite loss (logged loss NaN, update dropped) without stopping the job.

    Note: the loss is read on the host at logged steps (every step here), so detection is
    that step's own record; ``at`` is the step's start (its record minus its ``step_s``).
    """
    end = time.monotonic() + timeout
    while True:
        tail.poll()
        mine = [r for r in tail.records if r["step"] == fault.at_step]
        if mine:
            break
        if attempt.proc.poll() is not None or time.monotonic() > end:
            fault.detail = f"not reached: no record of step {fault.at_step}"
            return
        time.sleep(0.005)
    record = mine[-1]
    fault.at = record["_t"] - record["step_s"]
    fault.step_at_fault = fault.at_step
    fault.detection_latency_s = record["_t"] - fault.at
    fault.lost_work_s, fault.lost_steps = 0.0, 0
    caught = math.isnan(record["loss"]) and record.get("action") == "skip"
    fault.detail = (
        f"NaN loss at step {fault.at_step} (spike.inject_nan_at in both runs): logged loss "
        f"{record['loss']}, action {record.get('action')}, no restart"
    )
    if not caught:
        raise RuntimeError(f"the NaN loss at step {fault.at_step} was not caught: {record}")


def save_logs(attempts: list[Attempt], run_dir: Path) -> None:
    """Each launch's output, timestamped from the campaign start, as ``launch-<i>.log``."""
    for i, attempt in enumerate(attempts):
        text = "".join(f"{t:9.3f} {line}\n" for t, line in attempt.lines)
        (run_dir / f"launch-{i}.log").write_text(text)


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


def _measure_save_worker(out: str, sizes: list[int], repeats: int) -> None:
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
        __file__,
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


# --- outputs ---------------------------------------------------------------------------------


def plot_timeline(
    records: list[dict[str, Any]], faults: list[Fault], ref: dict[str, Any], path: Path
) -> bool:
    """Steps against wall time, faults marked, the uninterrupted run for comparison."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.plot(
        [r["_t"] for r in ref["records"]],
        [r["step"] for r in ref["records"]],
        color="0.6",
        lw=1,
        label="uninterrupted run",
    )
    ax.plot(
        [r["_t"] for r in records],
        [r["step"] for r in records],
        ".",
        ms=2,
        color="tab:blue",
        label="campaign: logged steps",
    )
    colors = {
        "kill-rank": "tab:red",
        "kill-during-save": "tab:purple",
        "sigterm": "tab:orange",
        "corrupt-newest": "tab:brown",
        "hang-rank": "tab:green",
        "nan": "tab:olive",
    }
    seen: set[str] = set()
    for f in faults:
        if math.isnan(f.at):
            continue
        ax.axvline(
            f.at,
            color=colors[f.kind],
            ls="--",
            lw=1,
            label=None if f.kind in seen else f.kind,
        )
        seen.add(f.kind)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("step")
    ax.set_title("fault campaign: steps against wall time")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _median_of(faults: list[dict[str, Any]], kinds: tuple[str, ...]) -> float:
    values = [
        f["restart_latency_s"]
        for f in faults
        if f["kind"] in kinds and not math.isnan(f["restart_latency_s"])
    ]
    return statistics.median(values) if values else math.nan


def _before_after(after: dict[str, Any], before: dict[str, Any]) -> str:
    """A Markdown table of the measured terms of an earlier run (``before``) and this one."""

    def rows(s: dict[str, Any]) -> list[str]:
        c, st, p = s["campaign"], s["stall"], s["projection_hlat_7b"]
        small, large = st["rows"][0], st["rows"][-1]
        return [
            f"{c['restart_latency_median_s']:.2f} s ({c['restart_latency_max_s']:.2f} s)",
            f"{c['lost_work_mean_s']:.2f} s",
            f"{s['startup'].get('import hlat-train and its packages', math.nan):.2f} s",
            f"{s['startup'].get('import torch', math.nan):.2f} s",
            f"{small['async_s'] * 1e3:.1f} ms = {small['async_s'] / small['sync_s']:.1%}",
            f"{large['async_s'] * 1e3:.1f} ms = {large['async_s'] / large['sync_s']:.1%}",
            f"{st['async_fixed_s'] * 1e3:.1f} ms",
            f"{c['utilisation']:.1%}",
            f"{p['utilisation']:.2%}",
        ]

    names = [
        "restart latency, median (max)",
        "lost work per fault, mean",
        "imports of a fresh worker",
        "of which `import torch` alone (the machine's baseline)",
        f"async stall, {after['stall']['rows'][0]['state_bytes_per_rank'] / 1e6:.1f} MB per rank (of sync)",
        f"async stall, {after['stall']['rows'][-1]['state_bytes_per_rank'] / 1e6:.1f} MB per rank (of sync)",
        "fixed part of the async stall",
        "campaign utilisation",
        "projected `hlat-7b` utilisation",
    ]
    table = "\n".join(
        f"| {n} | {b} | {a} |" for n, b, a in zip(names, rows(before), rows(after), strict=True)
    )
    return f"""
**Before and after.** The same campaign (`{before["command"]}`) on the earlier version of the
packages ({before.get("versions", "hlat 0.1")}), against this run:

| term | before | after |
| --- | ---: | ---: |
{table}

What changed in between: an async save checks the storage and agrees on the step in the
background instead of blocking for it, and saves the Python RNG state as bytes instead of
a 625-number list; `hlat-train` imports its export, metrics and Neuron helpers lazily and
measures the CPU's peak FLOP/s once per run instead of once per start; the process group
of a restarted attempt is created on a fresh store namespace by `hlat_parallel`. The two
runs were made at different times: compare `import torch`, which no change here touches, to
judge how much of a difference is the machine.
"""


def _hang_and_nan_text(s: dict[str, Any]) -> str:
    """A paragraph on the ``hang-rank`` and ``nan`` faults of a summary (empty without)."""
    c = s["campaign"]
    text = ""
    hang = c.get("hang_detection_latency_median_s", math.nan)
    if not math.isnan(hang):
        text += (
            f"\n**Hangs.** A `hang-rank` fault SIGSTOPs one worker: the other waits in a "
            f"collective until its hang watchdog (`train.hang_timeout = "
            f"{c['hang_timeout_s']:g}`) prints its rank, step and last activity, dumps its "
            f"stacks and exits with status 124, and torchrun restarts the workers (the "
            f"stopped one is SIGKILLed by the campaign). Detection latency, from the SIGSTOP "
            f"to the watchdog's message: median {hang:.2f} s, max "
            f"{c['hang_detection_latency_max_s']:.2f} s; the restart latency above includes "
            "it.\n"
        )
    if c.get("nan_caught"):
        text += (
            f"\n**Non-finite losses.** `nan` faults make the loss of step(s) "
            f"{', '.join(map(str, c['nan_steps']))} NaN (`spike.inject_nan_at`, in both runs); "
            f"each was logged with `action: skip` (the update dropped) and the job went on "
            f"without a restart ({c['nan_caught']} caught). They are left out of the restart "
            "and lost-work figures.\n"
        )
    return text


def write_doc(
    summary: dict[str, Any], path: Path, command: str, before: dict[str, Any] | None = None
) -> None:
    """docs/reliability.md with the measured table and the projection; with ``before`` (the
    summary of an earlier run) also a table of the measured terms before and after."""
    s = summary
    c = s["campaign"]
    st = s["stall"]
    p = s["projection_hlat_7b"]
    rows = "\n".join(
        f"| {i + 1} | {f['kind']} | {f['at']:.1f} | {f['step_at_fault']} | {f['resumed_from']} | "
        f"{f['to_resumed_s']:.2f} | {f['restart_latency_s']:.2f} | "
        f"{f['lost_work_s']:.2f} ({f['lost_steps']} steps) |"
        for i, f in enumerate(s["faults"])
        if not math.isnan(f["at"])
    )
    stall_rows = "\n".join(
        f"| {r['state_bytes_per_rank'] / 1e6:.1f} MB | {r['sync_s'] * 1e3:.1f} | "
        f"{r['async_s'] * 1e3:.1f} | {r['async_s'] / r['sync_s']:.1%} |"
        for r in st["rows"]
    )
    startup_rows = "\n".join(f"| {k} | {v:.2f} |" for k, v in s["startup"].items())
    before_after = _before_after(s, before) if before else ""
    robustness = _hang_and_nan_text(s)
    cs = c["checkpoint_saves"]
    in_run = (
        f"In the campaign run itself (its `checkpoint` metrics records, {cs['saves']} committed "
        f"async saves of {cs['bytes'] / 1e6:.1f} MB in all ranks): median stall "
        f"{cs['stall_median_s'] * 1e3:.1f} ms, median background write "
        f"{cs['write_median_s'] * 1e3:.1f} ms."
        if cs["saves"]
        else "The campaign run recorded no committed saves."
    )
    text = f"""# Reliability: measured goodput under faults

HLAT reports 98.81 % effective hardware utilisation with automatic fault recovery (77.83 %
with manual recovery) on 128 trn1 nodes. This page measures the same quantities for
`hlat-train` on a 2-core CPU machine with a real job under injected faults, and projects
them to the `hlat-7b` state size at a cluster's fault rate. Everything below was produced by

```bash
{command}
```

(`tools/fault_campaign.py`; raw figures in `docs/reliability/summary.json`, timeline in
`docs/reliability/timeline.png`).

![timeline](reliability/timeline.png)

## The campaign (measured)

A `torchrun --nproc-per-node 2 --max-restarts {len(s["faults"]) + 2} -m hlat_train train` job
({s["setup"]["steps"]} steps of a {s["setup"]["model"]} Llama, fp32, gloo, async checkpoints
every {s["setup"]["checkpoint_every"]} steps, keep 3) with {c["faults_injected"]} faults from
seed {s["setup"]["seed"]}, each after an exponentially distributed number of steps of progress since the previous
recovery (mean {s["setup"]["mean_gap_steps"]:.0f} steps). SIGKILLs of a worker are recovered by torchrun; after
a SIGTERM or a whole-job kill the campaign relaunches torchrun, as a scheduler would.

| | campaign | uninterrupted run |
| --- | ---: | ---: |
| wall time | {c["wall_s"]:.1f} s | {s["reference"]["wall_s"]:.1f} s |
| productive time (surviving steps' `step_s`) | {c["productive_s"]:.1f} s | {s["reference"]["productive_s"]:.1f} s |
| effective utilisation = productive / wall | **{c["utilisation"]:.1%}** | {s["reference"]["utilisation"]:.1%} |
| faults (kinds) | {c["faults_injected"]} ({", ".join(f"{k} {v}" for k, v in c["kinds"].items())}) | 0 |
| mean time between faults | {c["mtbf_s"]:.1f} s | - |
| restart latency, median (max) | {c["restart_latency_median_s"]:.2f} s ({c["restart_latency_max_s"]:.2f} s) | - |
| lost work per fault, mean | {c["lost_work_mean_s"]:.2f} s | - |
| final state bit-identical | **{"yes" if s["final"]["bit_identical"] else "NO"}** ({s["final"]["tensors_compared"]} tensors of model and optimizer; loss trajectory identical: {"yes" if s["final"]["loss_trajectory_identical"] else "no"}) | |

The campaign's utilisation is low by design: a fault every {c["mtbf_s"]:.0f} s against a
restart of seconds. The uninterrupted run's figure is the fixed cost of this tiny job
(process start, imports, process group, first checkpoint load) against a run of
{s["reference"]["wall_s"]:.0f} s; neither is a cluster figure (that is the projection below).

Per fault (times from the campaign start):

| # | kind | at (s) | last step logged | resumed from | to "resumed" (s) | restart latency (s) | lost work (s) |
| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |
{rows}
{robustness}
**How each term is measured.** The campaign follows `metrics.jsonl` (flushed each step)
every 5 ms and stamps each record with its arrival time. *Restart latency* = arrival of the
first record after the fault minus that step's own `step_s` minus the injection time: the
time from the fault until the recovered job begins a step (torchrun noticing the death,
stopping the other worker, new processes, imports, process group, checkpoint load; for
SIGTERM and the whole-job kills it includes the relaunch). *Lost work* = injection time
minus the arrival of the record of the step the job resumed from, in the attempt that died:
the work that had to be redone. *To "resumed"*: from the injection to rank 0's
`resumed from step N` line (new processes, imports, process group, model build, checkpoint
load), the rest of the restart latency is data-loader start and the first forward pass.
*Productive time* = the sum of `step_s` of the steps in the
final trajectory (the last record of each step).

**Where a restart goes** (fresh interpreters on this machine, median):

| start-up piece | seconds |
| --- | ---: |
{startup_rows}

Restart latency cannot go below start-up + imports + the first step; the rest is torchrun
noticing the death (polling every 0.1 s here), the process group, building the model and
loading the checkpoint.

## Checkpoint stall (measured)

The time `hlat_ckpt.Checkpointer.save()` blocks the training thread, median of repeated
saves in a 2-process gloo job (model + AdamW state, per rank):

| state per rank | synchronous save (ms) | async save, blocking part (ms) | async / sync |
| --- | ---: | ---: | ---: |
{stall_rows}

{in_run}

A line through the two async points: fixed cost {st["async_fixed_s"] * 1e3:.1f} ms plus
staging at {st["staging_bandwidth_gb_s"]:.2f} GB/s. Target: stall under 10 % of a synchronous
save; measured {", ".join(f"{x:.1%}" for x in st["async_over_sync"])}
({"met" if max(st["async_over_sync"]) < 0.10 else "NOT met"}).

## Projection to a cluster (a projection, not a measurement)

```
utilisation = 1 - (restart latency + lost work) / MTBF - stall / checkpoint interval
checkpoint interval = sqrt(2 x stall x MTBF)      (Young/Daly)
lost work = checkpoint interval / 2               (a fault lands, on average, mid-interval)
```

Inputs, each measured here and scaled as stated:

- MTBF: 6 h (1 fault per 6 hours, the fault rate this projection is made for).
- Restart latency: {p["restart_latency_s"]:.2f} s, the campaign's median (this machine; a trn1
  cluster adds Neuron runtime start and graph loading from the compile cache, not measured here).
- Stall: the `hlat-7b` state (6.74 G parameters x 6 bytes, bf16 weights and bf16 AdamW
  moments = {HLAT_7B_PARAMS * HLAT_7B_BYTES_PER_PARAM / 1e9:.1f} GB) sharded over {HLAT_NODES}
  nodes = {p["state_bytes_per_node"] / 1e9:.2f} GB per node, staged at the measured
  {st["staging_bandwidth_gb_s"]:.2f} GB/s plus the measured fixed cost:
  {p["stall_s"]:.2f} s.

| | value |
| --- | ---: |
| checkpoint interval (Young/Daly) | {p["interval_s"]:.0f} s |
| expected lost work per fault | {p["expected_lost_work_s"]:.0f} s |
| stall / interval | {p["stall_s"] / p["interval_s"]:.3%} |
| (restart + lost work) / MTBF | {(p["restart_latency_s"] + p["expected_lost_work_s"]) / p["mtbf_s"]:.3%} |
| **projected utilisation** | **{p["utilisation"]:.2%}** (HLAT: 98.81 %) |
| the same with the whole 7B state staged by one node | {s["projection_hlat_7b_one_node"]["utilisation"]:.2%} |

The projection also needs each background write to finish within the interval: at the
synchronous rate measured above ({st["rows"][-1]["state_bytes_per_rank"] / st["rows"][-1]["sync_s"] / 1e9:.2f} GB/s per rank on this disk) a
node's {p["state_bytes_per_node"] / 1e9:.2f} GB takes about
{p["state_bytes_per_node"] / (st["rows"][-1]["state_bytes_per_rank"] / st["rows"][-1]["sync_s"]):.1f} s,
well inside {p["interval_s"]:.0f} s; on shared storage (FSx, S3) measure that rate with
`tools/preflight.py` before choosing the interval.

## Levers: where the time goes

- **Checkpoint stall.** The blocking part of an async save is a fixed
  {st["async_fixed_s"] * 1e3:.1f} ms (state dicts of model and optimizer, the JSON of the
  non-tensor state) plus a copy into host buffers reused from save to save at
  {st["staging_bandwidth_gb_s"]:.1f} GB/s; the checks against the storage, the step
  agreement between ranks, planning, writing, checksums and the commit all run in the
  background thread. The ratio to a synchronous save tends to (synchronous write rate /
  staging rate) as the state grows.
- **Restart latency.** Of a worker-crash restart (torchrun restarting the workers) of
  {_median_of(s["faults"], ("kill-rank", "kill-during-save")):.1f} s median here, the imports alone are
  {s["startup"].get("import hlat-train and its packages", math.nan):.1f} s per fresh process
  ({s["startup"].get("import torch", math.nan):.1f} s of it torch; most of the rest is
  `torch.distributed.tensor` and `torch._dynamo`, which training needs). Whole-job
  relaunches (SIGTERM, corrupt checkpoint) pay the launcher's start as well; keeping the
  launcher alive across preemptions is the lever left.
{before_after}
## Findings

- Corruption of the newest checkpoint is handled automatically (this campaign truncates
  its {s["setup"].get("corrupt", "manifest")}): `load_latest` skips a checkpoint whose
  manifest is unreadable or whose files do not match the sizes and CRC-32 checksums the
  manifest records, resumes from the previous one, and the damaged directory is replaced
  when the resumed run reaches that step again.
- On SIGTERM the workers save and exit 143 and torchrun itself exits 1; a scheduler that
  requeues on any non-zero exit relaunches it correctly.

## Limits of these figures

- CPU and gloo on a 2-core machine: absolute times drift with other load; rerun for fresh
  numbers. A before/after comparison is two single runs.
- Neuron start-up (runtime, graph loading) and EFA collectives are not part of the measured
  restart latency; they need a trn1 cluster to measure.
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=8, help="faults to inject (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="schedule and training seed")
    parser.add_argument("--out", default="runs/fault-campaign", help="output directory")
    parser.add_argument("--quick", action="store_true", help="smaller model, shorter run")
    parser.add_argument("--steps", type=int, default=0, help="training steps (0: by size)")
    parser.add_argument(
        "--corrupt",
        choices=("manifest", "shard"),
        default="shard",
        help="which file of the newest checkpoint corrupt-newest truncates",
    )
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"comma-separated fault kinds to draw from (default: all, {','.join(KINDS)})",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=HANG_TIMEOUT_S,
        help=f"train.hang_timeout of both runs, seconds (default {HANG_TIMEOUT_S:g})",
    )
    parser.add_argument("--doc", default="", help="also write this Markdown report")
    parser.add_argument(
        "--from-summary", default="", help="only rewrite --doc from this summary.json"
    )
    parser.add_argument(
        "--before",
        default="",
        help="summary.json of an earlier run: --doc gets a before/after table of the terms",
    )
    parser.add_argument("--_measure-save", dest="measure_save", help=argparse.SUPPRESS)
    parser.add_argument("--_sizes", dest="sizes", default="", help=argparse.SUPPRESS)
    parser.add_argument("--_repeats", dest="repeats", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_save:
        _measure_save_worker(
            args.measure_save, [int(x) for x in args.sizes.split(",")], args.repeats
        )
        return 0
    before = json.loads(Path(args.before).read_text()) if args.before else None
    if args.from_summary:
        if not args.doc:
            parser.error("--from-summary needs --doc")
        summary = json.loads(Path(args.from_summary).read_text())
        write_doc(summary, Path(args.doc), summary["command"], before)
        return 0
    if args.faults < 1:
        parser.error(f"--faults must be at least 1, got {args.faults}")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        parser.error(f"--kinds: unknown {unknown or 'none given'}; choose from {', '.join(KINDS)}")
    if not args.hang_timeout >= 1:
        parser.error(f"--hang-timeout must be at least 1 s, got {args.hang_timeout}")

    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out} is not empty; choose a new directory (runs are not resumed)")
    out.mkdir(parents=True, exist_ok=True)
    every = 4 if args.quick else 5
    steps = args.steps or (150 if args.quick else 100 * args.faults + 200)
    print(f"fault campaign: {args.faults} faults, seed {args.seed}, {steps} steps -> {out}")

    corpus = build_corpus(out / "corpus")
    span = int(0.7 * (steps - every - 1))
    faults = schedule(args.faults, args.seed, span, min_gap=every + 1, kinds=kinds)
    nan_steps = plan_nan_steps(faults, every, steps)
    ref_dir, run_dir = out / "reference", out / "campaign"
    configs = [
        write_config(
            corpus, d, steps, every, args.quick, True, args.hang_timeout, nan_steps=nan_steps
        )
        for d in (ref_dir, run_dir)
    ]

    ref = run_reference(configs[0], ref_dir)
    print(f"uninterrupted run: {ref['wall_s']:.1f} s")
    wall, records, attempts = run_campaign(
        configs[1], run_dir, faults, steps, every, args.corrupt, args.hang_timeout
    )
    injected = [f for f in faults if not math.isnan(f.at)]
    # a NaN is handled inside the job: no restart, nothing lost, not a stop of the job
    stopping = [f for f in injected if f.kind != "nan"]
    hangs = [f.detection_latency_s for f in injected if f.kind == "hang-rank"]
    print(f"campaign: {wall:.1f} s, {len(injected)} faults, {len(attempts)} launches")
    final = compare_final(run_dir, ref_dir)
    stall = measure_stall(out, args.quick)
    startup = measure_startup(1 if args.quick else 3)

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
    summary = {
        "setup": {
            "steps": steps,
            "seed": args.seed,
            "checkpoint_every": every,
            "mean_gap_steps": span / args.faults,
            "model": "2-layer 64-wide" if args.quick else "4-layer 128-wide",
            "quick": args.quick,
            "corrupt": args.corrupt,
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
            "hang_timeout_s": args.hang_timeout,
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
    summary["command"] = "python tools/fault_campaign.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_timeline(records, faults, ref, out / "timeline.png")
    if args.doc:
        write_doc(summary, Path(args.doc), summary["command"], before)
    c = summary["campaign"]
    print(
        f"effective utilisation {c['utilisation']:.1%} (uninterrupted "
        f"{summary['reference']['utilisation']:.1%}); restart latency median "
        f"{restart_median:.2f} s; lost work per fault {c['lost_work_mean_s']:.2f} s; "
        f"async stall / sync {max(stall['async_over_sync']):.1%}; projected hlat-7b "
        f"{projection['utilisation']:.2%}"
    )
    if hangs:
        print(
            f"hang-rank: detection latency (SIGSTOP -> watchdog message) median "
            f"{c['hang_detection_latency_median_s']:.2f} s, max "
            f"{c['hang_detection_latency_max_s']:.2f} s at train.hang_timeout "
            f"{args.hang_timeout:g} s"
        )
    for f in injected:
        print(f"  {f.kind}: {f.detail}")
    print(f"final state bit-identical: {'yes' if final['bit_identical'] else 'NO'}")
    return 0 if final["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
