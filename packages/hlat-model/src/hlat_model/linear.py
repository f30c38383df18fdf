"""A bias-free ``nn.Linear`` that picks the fastest CPU product for its dtype.

- bf16: on x86 CPUs without AVX512-BF16/AMX, oneDNN emulates bf16 matrix products and runs
  them slower than fp32: 2.4x with AVX-512, 74x with AVX2 only (worst for the transposed
  layouts of backward). There we compute the product in fp32 from the bf16 operands and
  round the result to bf16: the same numbers a native bf16 GEMM produces (bf16 inputs, fp32
  accumulation, bf16 output), at fp32 speed, with only bf16 tensors saved for backward.
- fp32: torch multiplies fp32 matrices with MKL, tuned for Intel CPUs. On other x86 CPUs
  with AVX-512 or AVX2 (AMD's), oneDNN's fp32 product can run faster, and on some machines
  of one CPU model it does while on others it does not, so there both are timed once per
  machine and thread count, and where oneDNN's is faster the forward product and the input's
  gradient go through it (:func:`cpu_fp32_onednn_reason`, ``HLAT_MODEL_FP32_PRODUCTS``):
  fp32 operands, fp32 accumulation, fp32 results, as MKL's.

Everywhere else (GPU, Neuron, DTensor shards, code being compiled, other CPUs and dtypes)
it is exactly ``nn.Linear``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


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


def _cpuinfo_line(field: str) -> str:
    """The first line of Linux's ``/proc/cpuinfo`` starting with ``field``, else empty."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(field):
                    return line
    except OSError:
        pass
    return ""


def _cpu_vendor() -> str:
    """The x86 vendor string (``GenuineIntel``, ``AuthenticAMD``) where Linux tells it, else
    empty."""
    return _cpuinfo_line("vendor_id").partition(":")[2].strip()


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
    AVX2 and oneDNN held below AVX2 (none measured). On another Zen 3 EPYC of the same model
    MKL's ran faster (oneDNN's 0.93x in the whole step), so this rule only allows oneDNN:
    :func:`cpu_fp32_onednn_reason` takes it where it also ran faster on this machine.
    """
    if not available or machine.lower() not in ("x86_64", "amd64"):
        return None
    if vendor == "GenuineIntel" or not vendor:
        return None
    capability = capability.upper()
    if not capability.startswith(("AVX512", "AVX2")) or onednn_isa.upper() in _ONEDNN_BELOW_AVX2:
        return None
    vector = "AVX-512" if capability.startswith("AVX512") else "AVX2"
    return f"this {vendor} CPU has {vector}, where oneDNN's fp32 products can beat MKL's"


FP32_PRODUCTS_VARIABLE = "HLAT_MODEL_FP32_PRODUCTS"
"""``auto`` (the default): oneDNN's fp32 products where :func:`fp32_onednn_rule` allows them
and they ran faster than MKL's on this machine (:func:`measured_fp32_products`); ``onednn``:
oneDNN's wherever its linear operator exists; ``torch``: torch's (MKL) everywhere."""
FP32_PRODUCTS_CHOICES = ("auto", "onednn", "torch")
ONEDNN_MARGIN = 1.03
"""How much faster than MKL's oneDNN's products must run for ``auto`` to take them."""

_UNRESOLVED: Any = object()
_CPU_FP32_ONEDNN: Any = _UNRESOLVED  # str | None once resolved (at the first fp32 product)


def fp32_products_choice() -> str:
    """``HLAT_MODEL_FP32_PRODUCTS``, checked: one of :data:`FP32_PRODUCTS_CHOICES`."""
    value = os.environ.get(FP32_PRODUCTS_VARIABLE, "auto").strip().lower() or "auto"
    if value not in FP32_PRODUCTS_CHOICES:
        raise ValueError(
            f"{FP32_PRODUCTS_VARIABLE}={value!r}: expected one of "
            f"{', '.join(FP32_PRODUCTS_CHOICES)}"
        )
    return value


fp32_products_choice()  # a wrong value is refused at import, before any work


def cpu_fp32_onednn_reason() -> str | None:
    """Why :class:`Linear`'s fp32 products (forward and the input's gradient) go through
    oneDNN here, or None where they are torch's (MKL): ``HLAT_MODEL_FP32_PRODUCTS``, else
    :func:`fp32_onednn_rule` and, where it allows oneDNN, which of the two ran faster on
    this machine (:func:`measured_fp32_products`). Decided once per process, at the first
    call (the first fp32 product on the CPU), and kept."""
    global _CPU_FP32_ONEDNN
    if _CPU_FP32_ONEDNN is _UNRESOLVED:
        _CPU_FP32_ONEDNN = _resolve_fp32_products()
        logger.info("fp32 products on this CPU: %s", _CPU_FP32_ONEDNN or "torch's (MKL)")
    return _CPU_FP32_ONEDNN


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _cpu_fp32_onednn() -> str | None:
    """:func:`fp32_onednn_rule` for this CPU."""
    capability = torch.backends.cpu.get_cpu_capability()
    return fp32_onednn_rule(
        platform.machine(), _cpu_vendor(), capability, _onednn_available(), onednn_max_isa()
    )


def _resolve_fp32_products() -> str | None:
    choice = fp32_products_choice()
    if choice == "torch":
        return None
    if choice == "onednn":
        return f"{FP32_PRODUCTS_VARIABLE}=onednn" if _onednn_available() else None
    candidate = _cpu_fp32_onednn()
    if candidate is None:
        return None
    speedup = measured_fp32_products()
    if speedup < ONEDNN_MARGIN:
        return None
    return f"{candidate}; here they ran {speedup:.2f}x as fast (measured)"


# Operand shapes of the timed products: rows, then the weight's [out, in] (a width-512
# model's attention and MLP products).
_PROBE_ROWS = 1024
_PROBE_WEIGHTS = ((1536, 512), (512, 1536))


def _probe_fp32_products(repeats: int = 5) -> float:
    """MKL's time over oneDNN's for fp32 products as :class:`Linear` computes them (forward
    and the input's gradient) at :data:`_PROBE_WEIGHTS`' shapes: the best of ``repeats``
    alternating runs of each, summed over the shapes."""
    generator = torch.Generator().manual_seed(0)
    best = {"torch": 0.0, "onednn": 0.0}
    for out_features, in_features in _PROBE_WEIGHTS:
        x = torch.randn(_PROBE_ROWS, in_features, generator=generator)
        w = torch.randn(out_features, in_features, generator=generator)
        g = torch.randn(_PROBE_ROWS, out_features, generator=generator)
        runs = {
            "torch": lambda x=x, w=w, g=g: (F.linear(x, w), g @ w),
            "onednn": lambda x=x, w=w, g=g: (_onednn_linear(x, w), _onednn_linear(g, w.t())),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # warm-up: oneDNN builds its kernels at the first call of a shape
        for _ in range(repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        for name in runs:
            best[name] += min(times[name])
    return best["torch"] / best["onednn"]


def _probe_key() -> str:
    """This machine (host name, CPU model and flags), torch, oneDNN's limit and the thread
    count: what the timing of :func:`measured_fp32_products` depends on."""
    cpu = _cpuinfo_line("model name") + _cpuinfo_line("flags") or platform.processor()
    parts = (platform.node(), cpu, torch.__version__, onednn_max_isa(), torch.get_num_threads())
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:20]


def measured_fp32_products() -> float:
    """How many times as fast oneDNN's fp32 products ran as MKL's on this machine at this
    thread count (:func:`_probe_fp32_products`, about a second of products). Timed once per
    machine: kept in hlat-model's cache folder (``$HLAT_MODEL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/hlat-model`` or ``~/.cache/hlat-model``), where the first process to
    write it decides for every later one (ranks of a job started together read the same
    answer); timed in each process where the folder cannot be written."""
    from hlat_model._native import cache_dir

    path = cache_dir() / f"fp32_products_{_probe_key()}.json"
    try:
        return float(json.loads(path.read_text())["onednn_vs_torch"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    speedup = _probe_fp32_products()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, prefix=".fp32_products_", suffix=".json", delete=False
        ) as tmp:
            json.dump({"onednn_vs_torch": speedup}, tmp)
        try:
            os.link(tmp.name, path)  # the first writer wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp.name)
        return float(json.loads(path.read_text())["onednn_vs_torch"])
    except (OSError, ValueError, KeyError, TypeError):
        return speedup


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
        and cpu_fp32_onednn_reason() is not None
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
