"""``model.compile = "auto"``: compile the transformer blocks where that was measured to pay.

hlat-model's benchmark (``test_compiled_blocks_against_eager``, each block through
``torch.compile`` against the same model eager, in the same rounds) measured on a CPU with
AVX512-BF16, in two runs: bf16 1.07x and 1.06x eager, fp32 1.01x and 1.07x; the first step
compiled for 3.7 s and 4.8 s with inductor's cache of earlier runs, 18.9 s and 10.7 s without
it. So ``auto`` compiles bf16 runs on CPUs that multiply bf16 natively, when the run is long
enough that the compilation (again for each new shape: validation batches, the last partial
batch) is repaid, and leaves everything else eager:

- fp32 on CPUs: the gain is within this machine's run-to-run spread (1.01x to 1.07x);
- bf16 on CPUs without native bf16 runs hlat-model's fp32-accumulating ``Linear``, and
  accelerators (CUDA, TorchNeuron) have not been measured by this project: there
  ``model.compile = true`` is the user's call (torchtitan and TorchNeuron recommend it for
  speed);
- layouts that validation refuses with ``model.compile = true`` stay eager.

Note: ``true`` and ``false`` are taken as they are; ``auto`` is resolved once at start and
logged with its reason, as ``optim.precision = "auto"`` is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hlat_train.precision import native_bf16

__all__ = ["AUTO_MIN_STEPS", "CompileChoice", "resolve_compile"]

AUTO_MIN_STEPS = 10_000
"""Shortest run (``train.steps``) that ``auto`` compiles: at a 6 % gain, 10,000 steps repay
19 s of compilation (the cold-cache figure above) once a step takes 30 ms or more."""


@dataclass(frozen=True)
class CompileChoice:
    """Whether a run compiles its blocks, and why."""

    on: bool
    reason: str

    def describe(self, asked: bool | str) -> str:
        state = "on" if self.on else "off"
        if asked != "auto":
            return f"compile {state}"
        return f"compile auto -> {state} ({self.reason})"


def resolve_compile(
    asked: bool | str,
    config: Any,
    device: torch.device,
    *,
    world_size: int | None = None,
    bf16_reason: Callable[[torch.device], str | None] = native_bf16,
) -> CompileChoice:
    """Whether ``config`` (a validated ``TrainConfig`` whose ``optim.precision`` is resolved)
    compiles its blocks on ``device``. A layout that validation refuses with ``model.compile =
    true`` (at ``world_size`` processes) stays eager, with validation's reason. ``bf16_reason``
    says why a device multiplies bf16 natively, or None (``hlat_train.precision.native_bf16``)."""
    if isinstance(asked, bool):
        return CompileChoice(asked, "set in the config")
    if asked != "auto":
        raise ValueError(f"model.compile must be true, false or 'auto', got {asked!r}")
    from hlat_train.config import ConfigError
    from hlat_train.validation import validate

    compiled = dataclasses.replace(config, model=dataclasses.replace(config.model, compile=True))
    try:
        validate(compiled, world_size, check_files=False)
    except ConfigError as refused:
        return CompileChoice(False, f"refused with true: {refused}")
    if device.type != "cpu":
        return CompileChoice(
            False, f"not measured on {device.type}: set model.compile = true to compile the blocks"
        )
    if config.optim.precision == "fp32":
        return CompileChoice(False, "fp32 on a CPU: compiled blocks measured 1.01x-1.07x eager")
    why = bf16_reason(device)
    if why is None:
        return CompileChoice(False, "bf16 on a CPU without native bf16: not measured")
    steps = config.train.steps
    if steps < AUTO_MIN_STEPS:
        return CompileChoice(
            False,
            f"{steps} steps: auto compiles runs of "
            f"{AUTO_MIN_STEPS} steps or more, which repay the compilation",
        )
    return CompileChoice(
        True, f"bf16 for {steps} steps ({why}): compiled blocks measured 1.06x-1.07x eager"
    )
