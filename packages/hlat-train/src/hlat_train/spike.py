"""The loss-spike guard: detection over a running window, and the policy to apply."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass
class SpikeVerdict:
    """What the guard saw at one step."""

    spike: bool
    reason: str = ""


class SpikeGuard:
    """Flags a step whose loss is above ``mean + k * std`` of the last ``window`` accepted
    losses (after ``min_history`` of them), or whose gradient norm is not finite.

    Spiking losses are not added to the window, so one spike does not widen the band that
    judges the next step. The window is part of the training state (``state_dict``), so a
    resumed run judges exactly as the uninterrupted one would.

    Note:
        HLAT watched loss curves by eye and restarted by hand. A rule on the loss alone
        (rather than on the gradient norm, which legitimately falls and rises with the
        learning-rate schedule) catches the events that matter with one threshold.
    """

    def __init__(self, window: int = 50, k: float = 6.0, min_history: int = 10) -> None:
        self.window, self.k, self.min_history = window, k, min_history
        self._losses: deque[float] = deque(maxlen=window)

    def check(self, loss: float, grad_norm: float) -> SpikeVerdict:
        """Judge one step (does not record it: call :meth:`accept` for steps kept)."""
        if not math.isfinite(grad_norm) or not math.isfinite(loss):
            return SpikeVerdict(True, f"non-finite loss {loss} or grad norm {grad_norm}")
        if len(self._losses) >= self.min_history:
            mean = sum(self._losses) / len(self._losses)
            var = sum((x - mean) ** 2 for x in self._losses) / (len(self._losses) - 1)
            limit = mean + self.k * math.sqrt(var)
            if loss > limit:
                return SpikeVerdict(
                    True,
                    f"loss {loss:.4f} above mean {mean:.4f} + {self.k} std ({limit:.4f}) of "
                    f"the last {len(self._losses)} steps",
                )
        return SpikeVerdict(False)

    def accept(self, loss: float) -> None:
        """Add a kept step's loss to the window."""
        self._losses.append(float(loss))

    def state_dict(self) -> dict[str, Any]:
        """The window, for checkpoints."""
        return {"losses": list(self._losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the window."""
        self._losses = deque((float(x) for x in state["losses"]), maxlen=self.window)
