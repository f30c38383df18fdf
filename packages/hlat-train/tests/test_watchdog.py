"""The hang watchdog (``train.hang_timeout``): the timeout rule, a watchdog that fires in a
real process, a 2-process gloo job whose rank 1 is SIGSTOPped (rank 0's watchdog ends the
job with a message naming rank, step and region), and a normal run that ends cleanly."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from train_helpers import tiny_config, torchrun, wait_for_step, write_config

from hlat_train import ConfigError, Trainer
from hlat_train.validation import validate
from hlat_train.watchdog import (
    FACTOR,
    FLOOR_S,
    HANG_EXIT_CODE,
    MIN_STEPS,
    PG_MARGIN_S,
    STARTUP_S,
    HangWatchdog,
    auto_timeout,
    process_group_timeout,
    region_timeout,
)

# --- the rule ------------------------------------------------------------------------------


def test_auto_timeout_is_the_startup_allowance_until_steps_are_timed():
    for timed in range(MIN_STEPS):
        assert auto_timeout(0.05, timed) == STARTUP_S
    assert auto_timeout(0.05, MIN_STEPS, startup_s=600) == FLOOR_S
    assert auto_timeout(math.nan, 10) == STARTUP_S


def test_auto_timeout_is_ten_times_the_slowest_step_at_least_the_floor():
    assert auto_timeout(1.0, 5) == FLOOR_S  # 10 s < 300 s
    assert auto_timeout(45.0, 5) == pytest.approx(FACTOR * 45.0)  # 450 s
    assert auto_timeout(400.0, 50) == pytest.approx(4000.0)  # no cap: a slow step is a slow step


def test_region_timeout_by_mode_and_region():
    # off
    assert region_timeout(-1, "step") == math.inf
    assert region_timeout(-0.5, "startup") == math.inf
    # fixed: everywhere, but set-up, loads and the first step get the start-up allowance
    assert region_timeout(3.0, "step", 10.0, 10) == 3.0
    assert region_timeout(3.0, "long", 10.0, 10) == 3.0
    assert region_timeout(3.0, "startup") == STARTUP_S
    assert region_timeout(7200.0, "startup") == 7200.0
    # auto: the step rule for steps, at least the allowance for saves and validation
    assert region_timeout(0, "step", 0.2, 10) == FLOOR_S
    assert region_timeout(0, "step", 0.2, 1) == STARTUP_S
    assert region_timeout(0, "long", 0.2, 10) == STARTUP_S
    assert region_timeout(0, "long", 400.0, 10) == pytest.approx(4000.0)
    assert region_timeout(0, "startup", 0.2, 10, startup_s=100.0) == FLOOR_S


def test_process_group_outlasts_every_fixed_limit_and_is_finite():
    assert process_group_timeout(-1) is None  # torch's default without a watchdog
    assert process_group_timeout(0) == STARTUP_S + PG_MARGIN_S
    assert process_group_timeout(3.0) == STARTUP_S + PG_MARGIN_S
    assert process_group_timeout(7200.0) == 7200.0 + PG_MARGIN_S
    for fixed in (1.0, 60.0, 1800.0, 5000.0):
        pg = process_group_timeout(fixed)
        assert pg is not None and math.isfinite(pg)
        for region in ("step", "long", "startup"):
            assert region_timeout(fixed, region) < pg  # type: ignore[arg-type]
    auto_pg = process_group_timeout(0)
    assert auto_pg is not None
    assert region_timeout(0, "long", 1.0, 10) < auto_pg
    assert region_timeout(0, "startup") < auto_pg


def test_step_timing_skips_the_first_step_and_saves():
    dog = HangWatchdog(0, rank=0)  # not started: the bookkeeping alone
    dog.beat(1)  # the first step compiles: not timed, start-up allowance
    assert dog.limit == STARTUP_S
    time.sleep(0.02)
    dog.beat(2)
    time.sleep(0.05)
    dog.activity("optimizer step")
    dog.beat(3)  # step 2 timed (>= 0.05 s)
    dog.activity("checkpoint save", region="long")  # step 3 timed up to here
    assert dog.limit == STARTUP_S and dog.where == "checkpoint save"
    time.sleep(0.2)  # the save does not count as step time
    dog.beat(4)
    assert dog.steps_timed == 2 and 0.05 <= dog.slowest_step_s < 0.2
    assert dog.limit == STARTUP_S  # still fewer than MIN_STEPS steps timed
    dog.beat(5)
    assert dog.steps_timed == 3
    assert dog.limit == FLOOR_S and dog.where == "forward/backward"
    dog.activity("validation", region="long")
    assert dog.limit == STARTUP_S


def test_a_disabled_watchdog_starts_no_thread():
    dog = HangWatchdog(-1, rank=0).start()
    dog.beat(1)
    dog.activity("checkpoint save", region="long")
    assert not dog.running and dog.limit == math.inf
    dog.close()


# --- the config key ------------------------------------------------------------------------


def test_hang_timeout_is_validated_before_any_work(corpus, tmp_path):
    for bad, words in (
        ("0.5", "at least 1 s"),
        ("inf", "finite"),
        ("nan", "finite"),
    ):
        config = tiny_config(corpus, tmp_path, f"--train.hang_timeout={bad}")
        with pytest.raises(ConfigError, match=r"train\.hang_timeout") as error:
            validate(config, check_files=False)
        assert words in str(error.value)
    for good in ("0", "-1", "3", "7200.5"):
        validate(tiny_config(corpus, tmp_path, f"--train.hang_timeout={good}"), check_files=False)
    with pytest.raises(ConfigError, match="inject_nan_at"):
        validate(tiny_config(corpus, tmp_path, "--spike.inject_nan_at=[0]"), check_files=False)


def test_hang_timeout_is_documented_in_the_help():
    from hlat_train.config import RunConfig
    from hlat_train.confighelp import field_docs

    doc = field_docs(RunConfig)["hang_timeout"]
    for words in ("torchrun", "auto", "Negative", "300 s", "10 x the slowest step"):
        assert words in doc


# --- a real process ------------------------------------------------------------------------

FIRING = textwrap.dedent(
    """
    import time
    from hlat_train.watchdog import HangWatchdog

    dog = HangWatchdog(1.0, rank=3).start()
    for step in range(1, 6):
        dog.beat(step)
    dog.activity("stop-flag all-reduce")
    time.sleep(60)  # a rank stuck in a collective
    print("not reached")
    """
)


def test_the_watchdog_ends_a_stuck_process_with_message_and_stacks():
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", FIRING], capture_output=True, text=True, timeout=50
    )
    elapsed = time.monotonic() - start
    assert done.returncode == HANG_EXIT_CODE, done.stderr
    assert "not reached" not in done.stdout
    assert elapsed < 30
    err = done.stderr
    assert "hang watchdog: rank 3 made no progress for" in err
    assert "at step 5; last activity: stop-flag all-reduce (timeout 1 s" in err
    assert "exiting with code 124" in err
    # every thread's stack, the stuck main thread at its sleep
    assert "most recent call first" in err and "Current thread" in err
    assert re.search(r'File "<string>", line 9', err), err


HOLDING_THE_GIL = textwrap.dedent(
    """
    import re, time
    from hlat_train.watchdog import HangWatchdog

    dog = HangWatchdog(2.0, rank=0).start()
    for step in range(1, 6):
        dog.beat(step)
    time.sleep(1.2)  # the thread arms faulthandler's timer for this region
    re.match(r"(a+)+$", "a" * 40 + "b")  # backtracks for minutes without releasing the GIL
    print("not reached")
    """
)


@pytest.mark.slow
@pytest.mark.faults
def test_faulthandler_ends_a_process_whose_main_thread_holds_the_gil():
    # the watchdog thread cannot run; faulthandler's C timer, a grace period (10 s) after
    # the limit, dumps the stacks and exits with status 1
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HOLDING_THE_GIL], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 1, done.stderr
    assert 10 < time.monotonic() - start < 60
    assert "Timeout (" in done.stderr and 'File "<string>", line 9' in done.stderr
    assert "not reached" not in done.stdout


# --- a 2-process job with a stopped rank ---------------------------------------------------


STEP_REGIONS = (
    "forward/backward",
    "loss all-reduce",
    "optimizer step",
    "stop-flag all-reduce",
    "metrics (device read, all-reduces)",
)


def _workers(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (from their environment)."""
    with open(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children") as f:
        pids = [int(pid) for pid in f.read().split()]
    ranks = {}
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        ranks[int(env[b"RANK"])] = pid
    return ranks


def _wait_for_reaped(pid: int, timeout: float) -> None:
    """Block until process ``pid`` is gone from ``/proc``: its parent has collected its exit
    status, so torchrun has seen it end.

    Note: a zombie is not enough. With ``os._exit`` from a side thread, the main thread shows
    state ``Z`` while the other threads are still exiting, and the parent cannot collect the
    status yet; a failure that torchrun observes in that window is reported first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not os.path.exists(f"/proc/{pid}"):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} not reaped by torchrun after {timeout} s")


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> float:
    """Block until ``path`` contains ``text``; return when (monotonic)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in path.read_text(errors="replace"):
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"{text!r} not printed within {timeout} s:\n{path.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.faults
def test_a_sigstopped_rank_is_ended_by_the_other_ranks_watchdog(corpus, tmp_path):
    out = tmp_path / "hang"
    config = tiny_config(
        corpus,
        out,
        "--train.hang_timeout=3",
        "--checkpoint.every=100000",  # no save (a long region) while the rank is stopped
        "--optim.decay_steps=100",
        "--model.compile=false",  # a long horizon cut short: no compilation under "auto"
        steps=100000,
    )
    path = write_config(config, out.with_suffix(".toml"))
    log = tmp_path / "torchrun.log"
    with open(log, "w") as sink:
        proc = torchrun(2, path, stdout=sink, stderr=subprocess.STDOUT)
    victim = None
    try:
        wait_for_step(out / "metrics.jsonl", 5, proc)
        workers = _workers(proc.pid)
        victim = workers[1]
        os.kill(victim, signal.SIGSTOP)  # rank 1 stops mid-run: rank 0 waits in a collective
        stopped = time.monotonic()
        detected = _wait_for_text(log, "hang watchdog: rank 0", proc, timeout=40)
        # rank 0 ends itself (exit code 124), and torchrun sees it, before the stopped rank is
        # killed: killed first, rank 1 would be torchrun's first observed failure, and
        # torchrun would end rank 0 with SIGTERM before it reached its own exit
        _wait_for_reaped(workers[0], timeout=20)
        # Note: torchrun would SIGTERM the stopped worker (pending until it continues) and
        # SIGKILL it only after 30 s; the test does not wait for that
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=30)
        finished = time.monotonic()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
    output = log.read_text(errors="replace")
    assert proc.returncode != 0, output[-3000:]
    # about the timeout after the stop (rank 0 was at most one step ahead), not 35 min
    assert 2.5 < detected - stopped < 20, output[-3000:]
    assert finished - stopped < 45
    message = next(line for line in output.splitlines() if "hang watchdog: rank 0" in line)
    found = re.search(
        r"rank 0 made no progress for (\d+\.\d) s at step (\d+); last activity: (.+?) "
        r"\(timeout 3 s: train\.hang_timeout\)",
        message,
    )
    assert found, message
    waited, step, where = float(found[1]), int(found[2]), found[3]
    assert 3.0 <= waited < 10 and step > 5
    assert where in STEP_REGIONS
    assert "most recent call first" in output  # the stacks
    assert f"exitcode: {HANG_EXIT_CODE}" in output  # torchrun saw the watchdog's exit
    assert not os.path.exists(f"/proc/{victim}")  # the stopped worker does not linger


# --- a normal run --------------------------------------------------------------------------


def _watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hlat-hang-watchdog"]


def test_a_normal_run_with_the_watchdog_ends_and_stops_it(corpus, tmp_path):
    trainer = Trainer(tiny_config(corpus, tmp_path, "--train.hang_timeout=30", steps=6))
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary["step"] == 6 and summary["last_loss"] < summary["first_loss"]
    dog = trainer._watchdog
    assert dog.enabled and not dog.running and not _watchdog_threads()
    assert dog.steps_timed == 5  # every step but the first (it compiles)
    assert dog.where.startswith("end of the run")


def test_the_watchdog_stops_when_fit_raises(corpus, tmp_path):
    # a NaN loss at step 1 under policy rollback, with no checkpoint to roll back to: fit
    # raises, and the watchdog thread must not outlive it
    trainer = Trainer(
        tiny_config(
            corpus,
            tmp_path,
            "--spike.policy=rollback",
            "--spike.inject_nan_at=[1]",
            "--checkpoint.every=100",
            steps=6,
        )
    )
    try:
        with pytest.raises(RuntimeError, match="no checkpoint exists yet"):
            trainer.fit()
    finally:
        trainer.close()
    assert not trainer._watchdog.running and not _watchdog_threads()
