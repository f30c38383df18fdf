"""The loss-spike guard: judged on the device, so a training step never waits for the host."""

from __future__ import annotations

from typing import Any

import torch


class SpikeGuard:
    """Flags a step whose loss is above ``mean + k * std`` of the last ``window`` accepted
    losses (after ``min_history`` of them), or whose loss or gradient norm is not finite.

    Everything stays on the device: the window is a ring buffer tensor, :meth:`check`
    returns a 0-d bool tensor and :meth:`accept` records a loss only where its ``keep``
    flag is true. The trainer hands the verdict to the optimizer as a device-side skip
    (``hlat_optim.AdamW.step(skip=...)``), so judging costs no host synchronisation; the
    verdict is read on the host only when a step is logged.

    Spiking losses are not added to the window, so one spike does not widen the band that
    judges the next step. A run of ``new_level_after`` steps in a row whose finite losses
    (with finite gradient norms) lie above the band is no spike but a new loss level (harder
    data, a changed mixture): from then on those losses enter the window, so the band follows
    the level within a few steps instead of flagging every later step (and, under ``skip``,
    freezing the weights); 0 never takes a new level in. The window is
    part of the training state (``state_dict``), so a resumed run judges exactly as the
    uninterrupted one would.

    Note:
        HLAT watched loss curves by eye and restarted by hand. A rule on the loss alone
        (rather than on the gradient norm, which legitimately falls and rises with the
        learning-rate schedule) catches the events that matter with one threshold. The
        device-side window follows OLMo-core's ``SkipStepAdamW``.
    """

    def __init__(
        self,
        window: int = 50,
        k: float = 6.0,
        min_history: int = 10,
        device: torch.device | str | None = None,
        new_level_after: int = 10,
    ) -> None:
        self.window, self.k, self.min_history = window, k, min_history
        self.new_level_after = new_level_after
        self._losses = torch.zeros(window, dtype=torch.float32, device=device)
        self._slots = torch.arange(window, device=device)
        self._count = torch.zeros((), dtype=torch.long, device=device)  # at most `window`
        self._next = torch.zeros((), dtype=torch.long, device=device)  # slot of the next loss
        self._streak = torch.zeros((), dtype=torch.long, device=device)  # steps above, in a row
        self._above = torch.zeros((), dtype=torch.bool, device=device)  # the last check's

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Whether this step spikes, as a 0-d bool tensor (does not record the loss: call
        :meth:`accept`)."""
        loss = loss.detach().float().to(self._losses.device)
        grad_norm = grad_norm.detach().float().to(self._losses.device)
        bad = ~(loss.isfinite() & grad_norm.isfinite())
        valid = self._slots < self._count
        n = self._count.float()
        mean = torch.where(valid, self._losses, 0.0).sum() / n.clamp(min=1.0)
        var = torch.where(valid, (self._losses - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1.0)
        high = (self._count >= self.min_history) & (loss > mean + self.k * var.sqrt())
        self._above.copy_(high & ~bad)
        return bad | high

    def limit(self) -> float:
        """``mean + k * std`` of the window now (reads the device: for messages only)."""
        n = int(self._count)
        if n < 2:
            return float("inf")
        window = self._ordered()
        return float(window.mean() + self.k * window.std())

    def accept(self, loss: torch.Tensor, keep: torch.Tensor | bool = True) -> None:
        """Add ``loss`` to the window where ``keep`` is true (a 0-d bool tensor or a bool),
        or where the last :meth:`check` found it above the band for the ``new_level_after``-th
        step in a row (a new level, see the class)."""
        keep_t = torch.as_tensor(keep, device=self._losses.device)
        loss = loss.detach().float().to(self._losses.device)
        above = ~keep_t & self._above
        self._streak.copy_(
            torch.where(above, self._streak + 1, torch.where(keep_t, 0, self._streak))
        )
        if self.new_level_after:
            keep_t = keep_t | (above & (self._streak >= self.new_level_after))
        self._above.fill_(False)
        write = keep_t & (self._slots == self._next)
        self._losses.copy_(torch.where(write, loss, self._losses))
        self._next.copy_(torch.where(keep_t, (self._next + 1) % self.window, self._next))
        self._count.copy_(
            torch.where(keep_t, (self._count + 1).clamp(max=self.window), self._count)
        )

    def _ordered(self) -> torch.Tensor:
        """The accepted losses, oldest first."""
        n = int(self._count)
        start = (int(self._next) - n) % self.window
        order = [(start + i) % self.window for i in range(n)]
        return self._losses[order]

    def state_dict(self) -> dict[str, Any]:
        """The window, oldest first, and the run of flagged steps, for checkpoints (reads
        the device)."""
        return {"losses": self._ordered().cpu().tolist(), "streak": int(self._streak)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the window."""
        self._streak.fill_(int(state.get("streak", 0)))
        losses = [float(x) for x in state["losses"]][-self.window :]
        self._losses.zero_()
        self._losses[: len(losses)] = torch.tensor(losses, dtype=torch.float32)
        self._count.fill_(len(losses))
        self._next.fill_(len(losses) % self.window)


GUARD_FILE = "spike-guard.json"
"""Next to the checkpoints: the rollback state, written the moment a rollback changes it."""


def write_guard_file(
    checkpoint_dir: str, bad_micro_batches: list[int], rollbacks: int, spike_step: int
) -> None:
    """Persist the rollback state at once, atomically (a complete file or the previous one).

    A rollback changes what the run must skip and how many rollbacks it has left, but the
    next checkpoint may be many steps away; a crash in between would otherwise replay the
    spiking micro-batches and reset the ``spike.max_rollbacks`` budget.
    """
    import json
    import time

    from hlat_ckpt.storage import Storage

    record = {
        "format": "hlat-spike-guard",
        "bad_micro_batches": sorted(set(bad_micro_batches)),
        "rollbacks": rollbacks,
        "last_spike_step": spike_step,
        "time": time.time(),
    }
    storage = Storage(checkpoint_dir)
    storage.makedirs()
    storage.write_bytes_durable(json.dumps(record, indent=1).encode(), GUARD_FILE)


def read_guard_file(checkpoint_dir: str) -> dict[str, Any] | None:
    """The rollback state of :func:`write_guard_file`, or ``None`` when there is none.
    A file that does not parse is an error naming it (it is never silently ignored)."""
    import json

    from hlat_ckpt.storage import Storage

    storage = Storage(checkpoint_dir)
    if not storage.exists(GUARD_FILE):
        return None
    where = storage.url_of(GUARD_FILE)
    try:
        record = json.loads(storage.read_bytes(GUARD_FILE))
        bad = [int(x) for x in record["bad_micro_batches"]]
        rollbacks = int(record["rollbacks"])
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(
            f"{where} is not a spike-guard file ({type(e).__name__}: {e}); delete it to "
            "resume without it"
        ) from None
    return {"bad_micro_batches": bad, "rollbacks": rollbacks}


def remove_guard_file(checkpoint_dir: str) -> None:
    """Delete the rollback state of :func:`write_guard_file`, if any (a run that starts over
    owes nothing to an older run's)."""
    from hlat_ckpt.storage import Storage

    Storage(checkpoint_dir).remove_file(GUARD_FILE)
