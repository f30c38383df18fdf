"""Hang watchdog (``train.hang_timeout``): a rank that stops making progress ends itself, so
torchrun sees a failed worker and restarts the job.

A stopped or wedged rank makes every other rank wait in its next collective, and torchrun
only restarts workers that have exited: without a watchdog such a job waits until torch's
process-group timeout, or forever. The training loop reports progress to
:class:`HangWatchdog`: :meth:`HangWatchdog.beat` once per step and
:meth:`HangWatchdog.activity` when it enters another region of the step (forward/backward,
optimizer step, stop-flag all-reduce, checkpoint save, ...). A daemon thread checks that
the current region has not lasted longer than its limit. When it has, the thread prints
the rank, the step, the region (the collective the rank is waiting in, on the ranks that
are still alive), how long it waited and the limit, dumps the Python stacks of all threads
and ends the process with ``os._exit``.

Note: ``os._exit`` and not ``sys.exit``: ``SystemExit`` raised in a side thread ends that
thread only, and the main thread, stuck in C++ inside a collective, would never see it.
``os._exit`` ends the process at once (no ``atexit``, no ``finally``), so the message and
the stacks are flushed first.

The limit of a region (:func:`region_timeout`):

- ``hang_timeout > 0``: that many seconds;
- ``hang_timeout == 0`` (auto): :func:`auto_timeout`, ``max(300 s, 10 x the slowest step
  timed so far)``, or the start-up allowance (1800 s) until a few steps have been timed;
  regions that are not part of a step (checkpoint save, validation) get at least the
  start-up allowance;
- in both modes, set-up, checkpoint loads and the whole first step of the process (which
  compiles) get at least the start-up allowance;
- ``hang_timeout < 0``: no watchdog.

A step's time is measured from its :meth:`~HangWatchdog.beat` to the next beat, or to the
first region of another kind (a save, validation) if that comes first, so saves do not
inflate it; the first step of a process is not timed (it compiles).
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import sys
import threading
import time
from typing import Literal, TextIO

STARTUP_S = 1800.0
"""Start-up allowance: the limit for set-up, checkpoint loads and the first step of a process
(compilation: minutes with a cold Neuron or Inductor cache), and in auto mode until
``MIN_STEPS`` steps have been timed."""
FLOOR_S = 300.0
"""Auto mode: never a shorter limit than this (a step can wait for a slow file system, a
straggler or a collective's retries)."""
FACTOR = 10.0
"""Auto mode: the limit is this many times the slowest step timed so far."""
MIN_STEPS = 3
"""Auto mode: steps timed (after the first, which compiles) before the step-based limit
applies."""
PG_MARGIN_S = 300.0
"""How much longer than the watchdog the process group waits (:func:`process_group_timeout`)."""
HANG_EXIT_CODE = 124
"""Exit status of a rank the watchdog ended (124, as ``timeout(1)`` uses for a timed-out
command); any non-zero status makes torchrun restart the workers."""

Region = Literal["step", "long", "startup"]
"""``step``: part of a training step. ``long``: outside a step's own work (checkpoint save,
validation). ``startup``: set-up, checkpoint loads (also the first step of a process)."""


def auto_timeout(slowest_step_s: float, steps_timed: int, *, startup_s: float = STARTUP_S) -> float:
    """The limit of ``train.hang_timeout = 0`` for the regions of a step: ``startup_s`` until
    ``MIN_STEPS`` steps have been timed, then ``max(FLOOR_S, FACTOR x slowest_step_s)``.

    Note: the slowest step and not the mean: a job whose steps vary (logged steps read the
    device, data loading stalls) must not be killed by its own ordinary variation.
    """
    if steps_timed < MIN_STEPS or not math.isfinite(slowest_step_s):
        return startup_s
    return max(FLOOR_S, FACTOR * slowest_step_s)


def region_timeout(
    hang_timeout: float,
    region: Region,
    slowest_step_s: float = 0.0,
    steps_timed: int = 0,
    *,
    startup_s: float = STARTUP_S,
) -> float:
    """Seconds a region may last before the watchdog ends the process (``inf``: never)."""
    if hang_timeout < 0:
        return math.inf
    if hang_timeout > 0:
        limit = hang_timeout
    else:
        limit = auto_timeout(slowest_step_s, steps_timed, startup_s=startup_s)
    if region == "startup" or (region == "long" and hang_timeout == 0):
        return max(limit, startup_s)
    return limit


def process_group_timeout(hang_timeout: float, *, startup_s: float = STARTUP_S) -> float | None:
    """The timeout (seconds) to create the process group with: longer than any limit of the
    watchdog, so a hung collective is reported by the watchdog (rank, step, region, stacks)
    rather than by torch's own timeout; ``None`` (torch's default) without a watchdog.

    Note: auto mode's limit exceeds ``startup_s`` only when steps take longer than
    ``startup_s / FACTOR``; a single collective is then still far shorter than the step.
    """
    if hang_timeout < 0:
        return None
    return max(startup_s, hang_timeout) + PG_MARGIN_S


def describe(hang_timeout: float, *, startup_s: float = STARTUP_S) -> str:
    """One line for the log: what the watchdog will do."""
    if hang_timeout < 0:
        return "hang watchdog off (train.hang_timeout < 0)"
    if hang_timeout > 0:
        return (
            f"hang watchdog: {hang_timeout:g} s without progress ends a rank (set-up, "
            f"checkpoint loads and the first step: at least {startup_s:g} s)"
        )
    return (
        f"hang watchdog: auto, {startup_s:g} s until {MIN_STEPS} steps are timed, then "
        f"max({FLOOR_S:g} s, {FACTOR:g} x the slowest step) without progress ends a rank "
        f"(saves, validation, loads: at least {startup_s:g} s)"
    )


class HangWatchdog:
    """Ends this process when the training loop makes no progress for too long (see the
    module docstring). Cheap to feed: a beat stores one tuple, the thread reads it.

    ``hang_timeout`` is ``train.hang_timeout``; ``rank`` is named in the message;
    ``stream`` (default: ``sys.stderr``) gets the message and the stacks.
    """

    def __init__(
        self,
        hang_timeout: float,
        rank: int,
        *,
        startup_s: float = STARTUP_S,
        stream: TextIO | None = None,
        exit_code: int = HANG_EXIT_CODE,
    ) -> None:
        self.hang_timeout = hang_timeout
        self.rank = rank
        self.startup_s = startup_s
        self.exit_code = exit_code
        self._stream = stream
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._step: int | None = None  # the step being worked on
        self._first_step: int | None = None  # this process's first step (it compiles)
        self._step_started: float | None = None  # its beat; None once a long region began
        self.slowest_step_s = 0.0
        self.steps_timed = 0
        # Note: the thread reads only this tuple, which the loop replaces whole (an atomic
        # assignment): (step, where, since, limit, why)
        self._state: tuple[int | None, str, float, float, str] = (
            None,
            "start",
            time.monotonic(),
            math.inf,
            "",
        )
        self._backstop_armed_for: tuple[float, float] | None = None

    @property
    def enabled(self) -> bool:
        """Whether a timeout applies (``hang_timeout >= 0``)."""
        return self.hang_timeout >= 0

    @property
    def running(self) -> bool:
        """Whether the watchdog thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def where(self) -> str:
        """The region the loop is in now."""
        return self._state[1]

    @property
    def limit(self) -> float:
        """Seconds the current region may last (``inf`` when disabled)."""
        return self._state[3]

    def start(self) -> HangWatchdog:
        """Start the thread (nothing when disabled); the clock of the first region starts now."""
        if self.enabled and self._thread is None:
            self.activity("start", region="startup")
            self._thread = threading.Thread(
                target=self._watch, name="hlat-hang-watchdog", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and cancel the backstop (at the end of ``fit``, also on errors)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._backstop_armed_for is not None:
            faulthandler.cancel_dump_traceback_later()
            self._backstop_armed_for = None

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- fed by the training loop ---------------------------------------------------------

    def beat(self, step: int, where: str = "forward/backward") -> None:
        """Step ``step`` begins (in region ``where``): the previous step is timed."""
        if not self.enabled:
            return
        now = time.monotonic()
        self._close_step(now)
        if self._first_step is None:
            self._first_step = step
        self._step, self._step_started = step, now
        self._publish(where, "step", now)

    def activity(self, where: str, *, region: Region = "step") -> None:
        """The loop enters region ``where`` (label it by the collective it may wait in); its
        clock starts now. A ``long`` or ``startup`` region ends the current step's timing."""
        if not self.enabled:
            return
        now = time.monotonic()
        if region != "step":
            self._close_step(now)
            self._step_started = None
        self._publish(where, region, now)

    def _close_step(self, now: float) -> None:
        if self._step_started is not None and self._step != self._first_step:
            self.slowest_step_s = max(self.slowest_step_s, now - self._step_started)
            self.steps_timed += 1
        self._step_started = None

    def _publish(self, where: str, region: Region, now: float) -> None:
        if self._step is None or self._step == self._first_step:
            region = "startup"
        limit = region_timeout(
            self.hang_timeout,
            region,
            self.slowest_step_s,
            self.steps_timed,
            startup_s=self.startup_s,
        )
        self._state = (self._step, where, now, limit, self._why(region, limit))

    def _why(self, region: Region, limit: float) -> str:
        if self.hang_timeout > 0 and limit == self.hang_timeout:
            return "train.hang_timeout"
        if region != "step" and limit == self.startup_s:
            return "start-up allowance for set-up, loads, the first step, saves, validation"
        if self.steps_timed < MIN_STEPS:
            return f"auto: start-up allowance until {MIN_STEPS} steps are timed"
        return (
            f"auto: max({FLOOR_S:g} s, {FACTOR:g} x the slowest step, {self.slowest_step_s:.3g} s)"
        )

    # --- the thread -----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.is_set():
            step, where, since, limit, why = self._state
            now = time.monotonic()
            if now - since > limit:
                self._fire(step, where, now - since, limit, why)
            self._arm_backstop(since, limit, now)
            self._stop.wait(min(1.0, max(0.01, since + limit - now + 0.01)))

    def _arm_backstop(self, since: float, limit: float, now: float) -> None:
        """Re-arm faulthandler's timer for the current region, a grace period after this
        thread's own limit.

        Note: this thread needs the GIL. A main thread stuck in C++ code that holds it
        would starve it; faulthandler's timer runs in C without the GIL and still dumps the
        stacks and exits (status 1, its own message). Re-armed only when the region changes
        and at most once per poll, so it costs nothing per step.
        """
        if (since, limit) == self._backstop_armed_for or not math.isfinite(limit):
            return
        file = self._fault_file()
        if file is None:
            return
        grace = max(10.0, 0.1 * limit)
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            faulthandler.dump_traceback_later(
                max(0.001, since + limit + grace - now), repeat=False, file=file, exit=True
            )
            self._backstop_armed_for = (since, limit)

    def _fault_file(self) -> TextIO | None:
        """A stream faulthandler can write to (it needs a file descriptor)."""
        for stream in (self._stream or sys.stderr, sys.__stderr__):
            if stream is None:
                continue
            try:
                stream.fileno()
            except (OSError, ValueError, AttributeError):
                continue
            return stream
        return None

    def _fire(self, step: int | None, where: str, waited: float, limit: float, why: str) -> None:
        at = f"at step {step}" if step is not None else "before the first step"
        message = (
            f"hlat-train: hang watchdog: rank {self.rank} made no progress for {waited:.1f} s "
            f"{at}; last activity: {where} (timeout {limit:g} s: {why}). Dumping the Python "
            f"stacks of all threads and exiting with code {self.exit_code} so that torchrun "
            "restarts the job."
        )
        try:
            stream = self._stream or sys.stderr
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            print(message, file=stream, flush=True)
            file = self._fault_file()
            if file is not None:
                faulthandler.dump_traceback(file=file, all_threads=True)
                file.flush()
        finally:
            os._exit(self.exit_code)
