"""``model.compile = "auto"``: compile the transformer blocks where that was measured to pay.

Measured, each block through ``torch.compile`` against the same model eager:

- on a CPU with AVX512-BF16, hlat-model's benchmark (``test_compiled_blocks_against_eager``,
  the same rounds), two runs: bf16 1.07x and 1.06x eager, fp32 1.01x and 1.07x; the first step
  compiled for 3.7 s and 4.8 s with inductor's cache of earlier runs, 18.9 s and 10.7 s
  without it; with the loss compiled too (hlat-model 0.13, hlat-parallel 0.8), bf16 1.072x
  and fp32 1.041x in one run; with hlat-model 0.14 (dense gate and up halves in compiled
  blocks; oneDNN's fp32 products in the eager step on AMD CPUs), bf16 1.109x and fp32
  1.009x in one run;
- on one NVIDIA H200 (torch 2.11), hlat-train's ``test_bench_compile_accelerator.py`` (whole
  ``hlat-train`` runs of a 1.0B Llama, TinyLlama's shape, 4 x 2048 tokens per step, bf16-sr,
  eager and compiled in one sitting): 1.29x eager (64,825 against 50,386 tokens/s; 17.1
  against 21.6 GiB of GPU memory), and 1.28x in an earlier pair of ``hlat-train demo`` runs of
  that shape; the first five steps took no longer compiled than eager (2.6 against 2.9 s per
  step: the eager run compiles hlat-optim's update there).

- on a 2-core Intel Xeon with AMX with hlat-model 0.15's fused CPU kernels (RMSNorm, SwiGLU,
  RoPE and the loss in one pass each way in eager code; compiled blocks keep torch's
  operators, which inductor fuses), the same benchmark: bf16 0.954x eager, fp32 0.994x; whole
  ``hlat-train`` runs against torchtitan (``benchmarks/test_bench_vs_torchtitan.py``, one
  process, bf16) made 3,386 tokens/s eager and 3,233 compiled in one run, 3,050 and 3,159 in
  another; with hlat-model 0.28.0, bf16 0.926x and fp32 0.996x (0.27.0 had read fp32 1.155x
  once, which did not repeat).

So ``auto`` compiles runs that compute in bf16 on CPUs without hlat-model's fused CPU
kernels (no C++ compiler, or ``HLAT_MODEL_NATIVE=0``) and on CUDA GPUs that multiply bf16
natively, when the run is long enough that the compilation (again for each new shape:
validation batches, the last partial batch) is repaid, and leaves everything else eager:

- fp32: on CPUs the gain is within this machine's run-to-run spread (1.01x to 1.07x); on
  GPUs it was not measured;
- bf16 on CPUs without native bf16 runs hlat-model's fp32-accumulating ``Linear``, and
  other accelerators (TorchNeuron) have not been measured by this project: there
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
"""Shortest run (``train.steps``) that ``auto`` compiles: at a 6 % gain (CPUs), 10,000 steps
repay 19 s of compilation (the cold-cache figure above) once a step takes 30 ms or more; at
the H200's 22 % shorter steps, once a step takes 9 ms or more."""


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
    cpu_kernels_reason: Callable[[], str | None] | None = None,
) -> CompileChoice:
    """Whether ``config`` (a validated ``TrainConfig`` whose ``optim.precision`` is resolved)
    compiles its blocks on ``device``. A layout that validation refuses with ``model.compile =
    true`` (at ``world_size`` processes) stays eager, with validation's reason. ``bf16_reason``
    says why a device multiplies bf16 natively, or None (``hlat_train.precision.native_bf16``);
    ``cpu_kernels_reason`` why hlat-model's fused CPU kernels do not run, or None where they
    do (default ``hlat_model.fused_cpu_kernels_reason``)."""
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
    kind = device.type
    measured = _MEASURED.get(kind)
    if measured is None:
        return CompileChoice(
            False, f"not measured on {kind}: set model.compile = true to compile the blocks"
        )
    where = "a CPU" if kind == "cpu" else "a GPU"
    if config.optim.precision == "fp32":
        if kind == "cpu":
            return CompileChoice(False, "fp32 on a CPU: compiled blocks measured 1.01x-1.07x eager")
        return CompileChoice(False, f"fp32 on {where}: not measured")
    why = bf16_reason(device)
    if why is None:
        return CompileChoice(False, f"bf16 on {where} without native bf16: not measured")
    steps = config.train.steps
    if steps < AUTO_MIN_STEPS:
        return CompileChoice(
            False,
            f"{steps} steps: auto compiles runs of "
            f"{AUTO_MIN_STEPS} steps or more, which repay the compilation",
        )
    if kind == "cpu":
        from hlat_model import fused_cpu_kernels_reason

        kernels_reason = cpu_kernels_reason or fused_cpu_kernels_reason
        if kernels_reason() is None:
            return CompileChoice(
                False,
                "bf16 on a CPU with hlat-model's fused CPU kernels: compiled blocks "
                "measured 0.95x eager",
            )
    return CompileChoice(True, f"bf16 for {steps} steps ({why}): {measured}")


# What the compiled blocks measured against eager, by device type (see the module's note).
_MEASURED = {
    "cpu": "compiled blocks measured 1.06x-1.07x eager without the fused CPU kernels",
    "cuda": "compiled blocks measured 1.28x-1.29x eager on an H200",
}
