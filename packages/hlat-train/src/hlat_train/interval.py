"""``checkpoint.every = "auto"``: the checkpoint interval from the run's own measurements.

Checkpointing more often costs more stalls; less often loses more work to each failure.
Young (1974) and Daly (2006) give the interval that balances the two from the time one
checkpoint stalls training (``stall_s``) and the mean time between failures (``mtbf_s``).
Daly's higher-order estimate is used:

    tau = sqrt(2 d M) * (1 + sqrt(d / (2 M)) / 3 + d / (18 M)) - d    for d < 2 M, else M

where ``d`` is the stall and ``M`` the MTBF. The restart time (``restart_s``: relaunch,
rendezvous, checkpoint read) does not move the optimum to first order, but it is part of
what every failure costs, so it enters the expected utilisation that is logged with the
interval:

    utilisation = tau / (tau + d) * (1 - (restart_s + (tau + d) / 2) / M)

An async save stalls only for its copy to host memory, but its background write must end
before the next save starts, so the interval is never shorter than the last write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

AUTO = "auto"
FIRST_SAVE_STEPS = 50
"""With ``auto``, the first checkpoint comes after this many steps (or at the end, if
sooner): there is no measured save to plan from before it."""


def daly_interval(stall_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that maximise goodput (Daly's estimate)."""
    if stall_s <= 0:
        raise ValueError(f"stall_s must be > 0, got {stall_s}")
    if mtbf_s <= 0:
        raise ValueError(f"mtbf_s must be > 0, got {mtbf_s}")
    if stall_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = stall_s / (2 * mtbf_s)
    return math.sqrt(2 * stall_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - stall_s


def expected_utilisation(
    interval_s: float, stall_s: float, restart_s: float, mtbf_s: float
) -> float:
    """The fraction of wall time that trains and is kept, at checkpoint interval
    ``interval_s``: the stall of each checkpoint, and per failure the restart plus on
    average half an interval of lost work (first-order model; 0 when failures come faster
    than the run can recover)."""
    period = interval_s + stall_s
    return max(0.0, interval_s / period * (1 - (restart_s + period / 2) / mtbf_s))


@dataclass(frozen=True)
class AutoInterval:
    """One re-estimate of the interval, as logged."""

    every: int
    """Steps until the next checkpoint."""
    interval_s: float
    stall_s: float
    write_s: float
    step_s: float
    restart_s: float
    mtbf_s: float
    utilisation: float


def plan_interval(
    stall_s: float,
    write_s: float,
    step_s: float,
    restart_s: float,
    mtbf_hours: float,
) -> AutoInterval:
    """The next interval in steps from the newest measurements: Daly's interval (at least
    the last background write), divided by the step time, at least one step."""
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    mtbf_s = mtbf_hours * 3600.0
    interval_s = max(daly_interval(max(stall_s, 1e-6), mtbf_s), write_s)
    every = max(1, round(interval_s / step_s))
    return AutoInterval(
        every=every,
        interval_s=interval_s,
        stall_s=stall_s,
        write_s=write_s,
        step_s=step_s,
        restart_s=restart_s,
        mtbf_s=mtbf_s,
        utilisation=expected_utilisation(every * step_s, stall_s, restart_s, mtbf_s),
    )
