"""The fused CPU kernels of ``hlat_model._native`` (RMSNorm, SwiGLU, the RoPE head split) as
registered operators, for code being compiled on CPUs.

Eager code calls the kernels from autograd functions, which ``torch.compile`` would trace
into (and cannot: they call a C library). In a compiled block each of these operators is one
opaque call with a fake implementation (its output shapes) and a registered backward, itself
an operator, so inductor compiles the rest of the block around them. Which code takes them:
:func:`compiled_cpu_kernels`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hlat_model import _native


@torch.compiler.assume_constant_result
def kernels_build() -> bool:
    """Whether the fused CPU kernels run here: a constant for ``torch.compile``, which reads
    it while tracing."""
    return _native.load() is not None


def compiled_cpu_kernels(*tensors: torch.Tensor) -> bool:
    """Whether code being compiled calls the kernels' operators for these tensors: plain CPU
    tensors (not DTensor shards), all fp32 or all bf16, outside autocast (which casts
    operators' inputs, as these do not), where the kernels build.

    Note: on a 2-core Intel Xeon with AMX, the bf16 step of 8 compiled layers of width 512
    ran as fast as the eager step with these kernels and faster than inductor's own fusion
    of the same functions (``benchmarks/test_bench_train_step.py::
    test_compiled_blocks_against_eager``; the figures are in the package's BENCHMARKS.md)."""
    first = tensors[0]
    return (
        torch.compiler.is_compiling()
        and first.dtype in (torch.float32, torch.bfloat16)
        and all(
            type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.device.type == "cpu"
            and t.dtype == first.dtype
            for t in tensors
        )
        and not torch.is_autocast_enabled("cpu")
        and kernels_build()
    )


def _library() -> Any:
    lib = _native.load()
    if lib is None:  # the kernels built when the graph was traced
        raise RuntimeError(
            f"hlat-model's fused CPU kernels are gone: {_native.unavailable_reason()}"
        )
    return lib


# ---------------------------------------------------------------------------------------
# RMSNorm: (out, fp32 rstd per row)


@torch.library.custom_op("hlat::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _native.rms_norm_forward(_library(), x.contiguous(), weight.contiguous(), eps)


@rms_norm.register_fake
def _(x, weight, eps):
    rows = math.prod(x.shape[:-1])
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("hlat::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _native.rms_norm_backward(
        _library(), grad.contiguous(), x.contiguous(), weight.contiguous(), rstd
    )


@rms_norm_backward.register_fake
def _(grad, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_norm_grad(ctx: Any, grad: torch.Tensor, _rstd_grad: Any) -> tuple[Any, ...]:
    x, weight, rstd = ctx.saved_tensors
    grad_x, grad_weight = torch.ops.hlat.rms_norm_backward(grad, x, weight, rstd)
    return grad_x, grad_weight, None


torch.library.register_autograd("hlat::rms_norm", _rms_norm_grad, setup_context=_rms_norm_setup)


# ---------------------------------------------------------------------------------------
# SwiGLU of gate_up: [gate | up], or gate and up interleaved (the fused product's rows)


@torch.library.custom_op("hlat::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _native.swiglu_forward(_library(), gate_up.contiguous(), interleaved)


@swiglu.register_fake
def _(gate_up, interleaved):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("hlat::swiglu_backward", mutates_args=())
def swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _native.swiglu_backward(_library(), grad.contiguous(), gate_up.contiguous(), interleaved)


@swiglu_backward.register_fake
def _(grad, gate_up, interleaved):
    return gate_up.new_empty(gate_up.shape)


def _swiglu_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.interleaved = inputs[1]


def _swiglu_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    (gate_up,) = ctx.saved_tensors
    return torch.ops.hlat.swiglu_backward(grad, gate_up, ctx.interleaved), None


torch.library.register_autograd("hlat::swiglu", _swiglu_grad, setup_context=_swiglu_setup)


# ---------------------------------------------------------------------------------------
# The q/k/v split of the fused product with RoPE


@torch.library.custom_op("hlat::rope_heads", mutates_args=())
def rope_heads(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _native.rope_heads_forward(_library(), qkv.contiguous(), cos, sin)


@rope_heads.register_fake
def _(qkv, cos, sin):
    batch, seq, groups, per_group, head_dim = qkv.shape
    q = qkv.new_empty(batch, groups * (per_group - 2), seq, head_dim)
    return (
        q,
        qkv.new_empty(batch, groups, seq, head_dim),
        qkv.new_empty(batch, groups, seq, head_dim),
    )


@torch.library.custom_op("hlat::rope_heads_backward", mutates_args=())
def rope_heads_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    shape: list[int],
) -> torch.Tensor:
    return _native.rope_heads_backward(_library(), torch.Size(shape), (dq, dk, dv), cos, sin)


@rope_heads_backward.register_fake
def _(dq, dk, dv, cos, sin, shape):
    return dq.new_empty(shape)


def _rope_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    qkv, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.shape = list(qkv.shape)
    ctx.outputs = [(list(t.shape), t.dtype) for t in output]


def _rope_grad(ctx: Any, *grads: Any) -> tuple[Any, ...]:
    cos, sin = ctx.saved_tensors
    # an output the block does not use may come without a gradient: zeros
    dq, dk, dv = (
        g if g is not None else torch.zeros(shape, dtype=dtype, device=cos.device)
        for g, (shape, dtype) in zip(grads, ctx.outputs, strict=True)
    )
    return torch.ops.hlat.rope_heads_backward(dq, dk, dv, cos, sin, ctx.shape), None, None


torch.library.register_autograd("hlat::rope_heads", _rope_grad, setup_context=_rope_setup)
