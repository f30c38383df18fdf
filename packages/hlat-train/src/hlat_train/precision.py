"""``optim.precision = "auto"``: bf16 with stochastic rounding where bf16 matrix products are
native, fp32 where bf16 would be emulated.

bf16-sr is HLAT's mode and halves the bytes of weights, gradients and optimizer states; it
pays in speed only where the hardware multiplies bf16 natively. Where it is emulated (x86 CPUs
without AVX512-BF16 or AMX), bf16 products run slower than fp32 ones, so ``auto`` trains in
fp32 there. The CPU rule is hlat-model's (``hlat_model.linear.cpu_bf16_reason``), the one
its ``Linear`` and attention use to pick their bf16 path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hlat_model.linear import cpu_bf16_reason

__all__ = ["PrecisionChoice", "native_bf16", "resolve_precision"]


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision mode a run uses, and why."""

    mode: str
    reason: str

    def describe(self, asked: str) -> str:
        if asked != "auto":
            return f"precision {self.mode}"
        return f"precision auto -> {self.mode} ({self.reason})"


def native_bf16(device: torch.device) -> str | None:
    """Why ``device`` multiplies bf16 matrices natively (a phrase for the log), or None."""
    kind = device.type
    if kind == "cpu":
        return cpu_bf16_reason()
    if kind == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return f"{torch.cuda.get_device_name(device)} has bf16 tensor cores"
        return None
    if kind in ("neuron", "xla"):
        return "Trainium's NeuronCores multiply bf16 natively"
    module = getattr(torch, kind, None)
    check = getattr(module, "is_bf16_supported", None)
    if callable(check):
        try:
            return f"torch.{kind} reports bf16 support" if check() else None
        except (RuntimeError, TypeError):
            return None
    return None


def resolve_precision(precision: str, device: torch.device) -> PrecisionChoice:
    """The mode for ``precision`` on ``device``: itself, unless it is ``"auto"``."""
    if precision != "auto":
        return PrecisionChoice(precision, "set in the config")
    why = native_bf16(device)
    if why is not None:
        return PrecisionChoice("bf16-sr", why)
    return PrecisionChoice(
        "fp32", f"{device.type} has no native bf16 matrix multiply: bf16 would be emulated"
    )
