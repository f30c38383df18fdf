"""The campaign's harness: the fault kinds and their seeded schedule, the corpus and configs
of the two runs, launching ``torchrun`` jobs of ``hlat-train train``, following their
``metrics.jsonl`` and output, injecting each fault (signals to the launcher or a worker,
truncating a checkpoint file, a NaN loss by configuration), waiting for the recovered job,
and collecting what each fault cost as it happened (``Fault``) and each launch's log.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
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
    precision: str = "fp32",
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
        f"--optim.precision={precision}",  # the preset's auto would follow the CPU
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
