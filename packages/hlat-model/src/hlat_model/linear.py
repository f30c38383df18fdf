"""A bias-free ``nn.Linear`` that picks the fastest CPU product for its dtype.

- bf16: on x86 CPUs without AVX512-BF16/AMX, oneDNN emulates bf16 matrix products and runs
  them slower than fp32: 2.4x with AVX-512, 74x with AVX2 only (worst for the transposed
  layouts of backward). There we compute the product in fp32 from the bf16 operands and
  round the result to bf16: the same numbers a native bf16 GEMM produces (bf16 inputs, fp32
  accumulation, bf16 output), at fp32 speed, with only bf16 tensors saved for backward.
- fp32: torch multiplies fp32 matrices with MKL, tuned for Intel CPUs. On other x86 CPUs
  with AVX-512 (AMD Zen 4 and later), oneDNN's fp32 product runs faster, so there the
  forward product and the input's gradient go through oneDNN (:func:`cpu_fp32_onednn_reason`):
  fp32 operands, fp32 accumulation, fp32 results, as MKL's.

Everywhere else (GPU, Neuron, DTensor shards, code being compiled, other CPUs and dtypes)
it is exactly ``nn.Linear``.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def cpu_bf16_reason() -> str | None:
    """Why this CPU multiplies bf16 matrices natively (a phrase for a log line), or None
    where bf16 products would be emulated.

    x86: AMX tiles or AVX512-BF16. Note: oneDNN's own check
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) also says yes on AVX-512 CPUs without
    BF16 instructions, where its bf16 kernels convert in software: with oneDNN held to
    ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``, the model's bf16 products (forward and backward) ran
    2.4x slower through ``F.linear`` than through :class:`Linear`'s fp32-accumulating path,
    and causal attention 1.4x slower than in fp32 (``benchmarks/test_bench_train_step.py::
    test_linear_paths_against_the_cpu_rule``). Other CPUs (Arm): oneDNN's check, which is
    the BF16 extension (bfmmla) there.

    On x86, a limit on oneDNN's instructions below bf16 (:func:`onednn_max_isa`, e.g.
    ``ONEDNN_MAX_CPU_ISA=AVX2``) makes its bf16 products emulated on any CPU, so the answer
    is None there too: with oneDNN held to AVX2 on an AVX512-BF16 CPU (Zen 5), its bf16
    product ran at 4 GFLOP/s against fp32's 186.
    """
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        if onednn_max_isa() in _ONEDNN_BELOW_BF16:
            return None
        if cpu_has_amx():
            return "this CPU has AMX tiles"
        if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
            return "this CPU has AVX512-BF16"
        return None
    try:
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "this CPU has the Arm BF16 extension"
    except (AttributeError, RuntimeError):
        pass
    return None


_ONEDNN_BELOW_AVX512 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"})
"""oneDNN's instruction-set limits (``ONEDNN_MAX_CPU_ISA``) without AVX-512."""
_ONEDNN_BELOW_AVX2 = frozenset({"SSE41", "AVX"})
"""oneDNN's instruction-set limits below AVX2."""
_ONEDNN_BELOW_BF16 = _ONEDNN_BELOW_AVX512 | {"AVX512_CORE", "AVX512_CORE_VNNI"}
"""oneDNN's x86 limits without bf16 products (AVX512-BF16 or AMX): at these, its bf16
kernels convert in software whatever the CPU has."""


def onednn_max_isa() -> str:
    """The instruction-set limit oneDNN reads from the environment, upper case
    (``ONEDNN_MAX_CPU_ISA``, else its older name ``DNNL_MAX_CPU_ISA``); empty where neither
    is set. oneDNN reads it once, at its first product, so set it before the process starts.
    """
    value = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return value.strip().upper()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch's own check; False where torch lacks it)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively: :func:`cpu_bf16_reason`, asked
    once at import, so ``torch.compile`` reads a constant (tracing into torch's CPU checks
    broke every compiled block's graph)."""
    return _CPU_HAS_NATIVE_BF16


_CPU_HAS_NATIVE_BF16 = cpu_bf16_reason() is not None


def _cpu_vendor() -> str:
    """The x86 vendor string (``GenuineIntel``, ``AuthenticAMD``) where Linux tells it, else
    empty."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def fp32_onednn_rule(
    machine: str, vendor: str, capability: str, available: bool, onednn_isa: str = ""
) -> str | None:
    """Why fp32 products go through oneDNN on a CPU of this ``platform.machine()``, x86
    ``vendor``, torch ``capability`` (``torch.backends.cpu.get_cpu_capability()``), oneDNN
    linear operator ``available`` and oneDNN instruction-set limit ``onednn_isa``
    (:func:`onednn_max_isa`), or None for torch's own product (MKL).

    Note: on a 2-core AMD EPYC (Zen 4, AVX-512), MKL's fp32 products at the shapes of a
    width-512 model ran at 200-208 GFLOP/s, oneDNN's at 220-227 forward and for the input's
    gradient; the weight's gradient reads both operands transposed, which oneDNN's linear
    operator copies (176-209 GFLOP/s against MKL's 195-205), so it stays with MKL. On a
    2-core AMD EPYC with AVX2 only (Zen 3), the whole fp32 step of that model ran 1.10x
    faster with oneDNN's products than with MKL's (505 against 458 tokens/s). MKL is Intel's
    own, tuned for Intel CPUs, which keep it; so do CPUs of unknown vendor, x86 CPUs below
    AVX2 and oneDNN held below AVX2 (none measured).
    """
    if not available or machine.lower() not in ("x86_64", "amd64"):
        return None
    if vendor == "GenuineIntel" or not vendor:
        return None
    capability = capability.upper()
    if not capability.startswith(("AVX512", "AVX2")) or onednn_isa.upper() in _ONEDNN_BELOW_AVX2:
        return None
    vector = "AVX-512" if capability.startswith("AVX512") else "AVX2"
    return f"this {vendor} CPU has {vector} and runs oneDNN's fp32 products faster than MKL's"


def cpu_fp32_onednn_reason() -> str | None:
    """:func:`fp32_onednn_rule` for this CPU, asked once at import."""
    return _CPU_FP32_ONEDNN


def _cpu_fp32_onednn() -> str | None:
    available = torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )
    capability = torch.backends.cpu.get_cpu_capability()
    return fp32_onednn_rule(
        platform.machine(), _cpu_vendor(), capability, available, onednn_max_isa()
    )


_CPU_FP32_ONEDNN = _cpu_fp32_onednn()


def _fp32_accumulates(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes the fp32-accumulating path for these operands."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and type(x) is torch.Tensor
        and type(weight) in (nn.Parameter, torch.Tensor)
        and not cpu_has_native_bf16()
    )


def _onednn_fp32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` multiplies these operands through oneDNN: fp32 plain CPU
    tensors, outside code being compiled and CPU autocast (whose ``F.linear`` multiplies in
    the autocast dtype), where :func:`cpu_fp32_onednn_reason` says so."""
    return (
        _CPU_FP32_ONEDNN is not None
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and type(x) is torch.Tensor
        and type(weight) in (nn.Parameter, torch.Tensor)
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")
    )


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` by oneDNN's linear operator (``weight`` may be a strided view)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, None, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def _linear_grads(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, ...]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``linear(x, weight)`` for ``x`` and ``weight`` (None where
    ``needs`` says no), computed as that product was: in fp32 and rounded where it
    accumulated in fp32, else in the operands' dtype as autograd's own backward does (the
    input's through oneDNN where the forward product went there)."""
    g, w, flat_x = grad, weight, x.reshape(-1, x.shape[-1])
    if _fp32_accumulates(x, weight):
        g, w, flat_x = grad.float(), weight.float(), flat_x.float()
    onednn = _onednn_fp32(flat_x, w)
    grad_x = grad_w = None
    if needs[0] and onednn:
        grad_x = _onednn_linear(g, w.t())
    elif needs[0]:
        grad_x = (g @ w).to(x.dtype)
    if needs[1]:
        grad_w = (g.reshape(-1, g.shape[-1]).t() @ flat_x).to(weight.dtype)
    return grad_x, grad_w


class _Fp32AccumulateLinear(torch.autograd.Function):
    """bf16 ``linear`` as the fp32 product of fp32 copies, rounded once: through oneDNN where
    :func:`cpu_fp32_onednn_reason` sends fp32 products (forward and the input's gradient),
    else torch's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        x32, w32 = x.float(), weight.float()
        out = _onednn_linear(x32, w32) if _onednn_fp32(x32, w32) else F.linear(x32, w32)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        return _linear_grads(grad, x, weight, ctx.needs_input_grad)


class _OneDnnLinear(torch.autograd.Function):
    """fp32 ``linear`` through oneDNN (:func:`_onednn_fp32`); the weight's gradient by
    torch's product."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _onednn_linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        return _linear_grads(grad, x, weight, ctx.needs_input_grad)


class _PermutedRowsLinear(torch.autograd.Function):
    """``linear(x, weight[rows])`` that keeps ``weight`` itself for backward, not the
    permuted copy: backward permutes it again (a pass over the weight) and gathers the
    weight's gradient back into its own row order.

    Note: rows are gathered with ``index_select``, and the weight's gradient through the
    inverse permutation, a gather too: on CPUs advanced indexing (``weight[rows]``) and the
    scatter ``grad[rows] = ...`` take several times as long for the same rows."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight, rows)
        return linear(x, weight.index_select(0, rows))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rows = ctx.saved_tensors
        permuted = weight.index_select(0, rows)
        grad_x, grad_permuted = _linear_grads(grad, x, permuted, ctx.needs_input_grad)
        grad_w = None
        if grad_permuted is not None:
            grad_w = grad_permuted.index_select(0, torch.argsort(rows))
        return grad_x, grad_w, None


def linear_permuted_rows(x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``linear(x, weight[rows])`` for a permutation ``rows`` of the weight's rows (an
    output layout the caller prefers), with ``weight`` rather than its permuted copy kept
    for backward: autograd through ``weight[rows]`` would keep the copy, a second weight
    held per layer until backward (of the unsharded weight under FSDP)."""
    return _PermutedRowsLinear.apply(x, weight, rows)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as :class:`Linear` computes it: through the fp32-accumulating path
    for plain bf16 CPU tensors where this CPU has no native bf16 products, through oneDNN
    for plain fp32 CPU tensors where :func:`cpu_fp32_onednn_reason` says so, otherwise
    ``F.linear``. ``weight`` may be a parameter or a tensor computed from one, which then
    gets its gradient through autograd (for a permutation of its rows,
    :func:`linear_permuted_rows` keeps less for backward)."""
    if _fp32_accumulates(x, weight):
        return _Fp32AccumulateLinear.apply(x, weight)
    if _onednn_fp32(x, weight):
        return _OneDnnLinear.apply(x, weight)
    return F.linear(x, weight)


class Linear(nn.Linear):
    """``nn.Linear(in, out, bias=False)``; see the module docstring for the CPU bf16 path."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
