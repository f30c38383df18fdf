"""Linear warmup, optional constant phase, cosine decay to a floor."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["CosineWithWarmup", "cosine_with_warmup"]


class CosineWithWarmup:
    """The LR multiplier at step ``s`` (a picklable callable, so ``LambdaLR`` saves it).

    - warmup, ``s < warmup_steps``: ``s / warmup_steps``;
    - constant, next ``constant_steps`` steps: ``1``;
    - cosine, until ``total_steps``: ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * t)) / 2``
      with ``t = (s - warmup_steps - constant_steps) / (total_steps - warmup_steps - constant_steps)``;
    - afterwards: ``min_lr_ratio``.

    The configuration lives in slots, not in the instance's ``__dict__``, which is what
    ``LambdaLR.state_dict()`` saves of a callable and ``load_state_dict`` writes back: a
    scheduler's state dict holds its position only, and a resumed run follows the schedule
    it was built with (a longer ``total_steps`` stretches the cosine from where the run
    is). A configuration saved by an older version is written to ``__dict__`` and ignored.
    """

    __slots__ = ("__dict__", "constant_steps", "min_lr_ratio", "total_steps", "warmup_steps")

    def __init__(
        self, warmup_steps: int, total_steps: int, min_lr_ratio: float, constant_steps: int
    ) -> None:
        if warmup_steps < 0 or constant_steps < 0:
            raise ValueError(
                f"cosine_with_warmup: warmup_steps ({warmup_steps}) and constant_steps "
                f"({constant_steps}) must be >= 0"
            )
        if total_steps < warmup_steps + constant_steps:
            raise ValueError(
                f"cosine_with_warmup: total_steps ({total_steps}) is shorter than warmup_steps "
                f"+ constant_steps ({warmup_steps} + {constant_steps}); raise total_steps or "
                "shorten the warmup"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(
                f"cosine_with_warmup: min_lr_ratio must be in [0, 1], got {min_lr_ratio}"
            )
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self.constant_steps = constant_steps

    def __setstate__(self, state: Any) -> None:
        """Unpickle; a pickle of a version before 0.12 holds the configuration in its
        ``__dict__``, which goes to the slots."""
        attrs, slots = state if isinstance(state, tuple) else (state, None)
        attrs, slots = dict(attrs or {}), dict(slots or {})
        for name in ("constant_steps", "min_lr_ratio", "total_steps", "warmup_steps"):
            if name in attrs:
                slots.setdefault(name, attrs.pop(name))
        self.__dict__.update(attrs)
        for name, value in slots.items():
            setattr(self, name, value)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        decay_start = self.warmup_steps + self.constant_steps
        if step < decay_start:
            return 1.0
        decay_steps = self.total_steps - decay_start
        if step >= self.total_steps or decay_steps == 0:
            return self.min_lr_ratio
        t = (step - decay_start) / decay_steps
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def cosine_with_warmup(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.1,
    constant_steps: int = 0,
    last_epoch: int = -1,
) -> LambdaLR:
    """A ``LambdaLR`` that warms up linearly from 0 to each group's ``lr`` over
    ``warmup_steps``, holds it for ``constant_steps``, decays it along a cosine to
    ``min_lr_ratio * lr`` at ``total_steps`` and stays there (see ``CosineWithWarmup``).

    HLAT: ``cosine_with_warmup(opt, warmup_steps=2000, total_steps=500_000)`` with peak
    ``lr=3e-4`` goes from 0 to 3e-4 in 2000 steps and down to 3e-5.

    Note: the warmup starts at 0 (step 0 takes no step), the convention of Megatron-LM and
    Hugging Face schedules, so the peak is reached exactly at ``warmup_steps``.
    """
    return LambdaLR(
        optimizer,
        CosineWithWarmup(warmup_steps, total_steps, min_lr_ratio, constant_steps),
        last_epoch=last_epoch,
    )
