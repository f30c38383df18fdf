"""The Llama decoder in plain PyTorch, with fused ``qkv_proj`` and ``gate_up_proj``.

No parallelism lives here: ``Llama.parallel_plan()`` describes how the model may be split and
``hlat_parallel.parallelize`` applies it. Shapes are read from tensors, not from the config,
so the same code runs on a tensor-parallel shard holding fewer heads.

Fused layouts (TP-independent; see ``parallel_plan``):

* ``qkv_proj.weight`` rows are grouped by key/value head:
  ``[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]``, each head
  ``head_dim`` rows. Any split of the rows into whole groups gives a shard its own matching
  q, k and v heads.
* ``gate_up_proj.weight`` rows interleave gate and up: ``[gate_0, up_0, gate_1, up_1, ...]``,
  so any even split keeps each gate row next to its up row.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hlat_model import _native
from hlat_model._compiled_ops import compiled_cpu_kernels
from hlat_model.attention import (
    AttentionMask,
    attention,
    document_positions,
    rope_flash_attention,
    rope_flash_attention_fits,
    runs_flash_kernel,
)
from hlat_model.config import LlamaConfig
from hlat_model.linear import Linear, linear, linear_permuted_rows
from hlat_model.loss import cross_entropy_loss, eager_plain, fuses_head, linear_cross_entropy


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the input dtype, then scaled by ``weight``.

    Plain CPU tensors computed op by op go through :class:`_RMSNormFunction` (the fused CPU
    kernel of ``hlat_model._native`` where it builds, else fewer passes of torch's operators,
    and the input instead of its fp32 copy kept for backward); in code being compiled on
    CPUs the kernel is the operator ``torch.ops.hlat.rms_norm`` (``hlat_model.
    _compiled_ops``); DTensors (sequence parallelism), XLA, other devices (where it has not
    been measured) and compiled code without the kernels take ``F.rms_norm``, whose
    compilers and kernels fuse it themselves."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = eager_plain(x) and type(self.weight) in (nn.Parameter, torch.Tensor)
        if plain and x.device.type == "cpu":
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        if compiled_cpu_kernels(x, self.weight):
            return torch.ops.hlat.rms_norm(x, self.weight, self.eps)[0]
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(total, self(total))`` with ``total = x + delta``: a residual add and the
        pre-norm that reads its sum. Where the fused CPU kernel takes all three tensors
        (plain contiguous CPU tensors of one dtype, op by op, the module without hooks) the
        two are one pass over the rows forward (:class:`_AddRMSNormFunction`), and backward
        adds the residual stream's gradient into the norm's in the same pass; elsewhere the
        add and a call of the module (hooks included: a tensor-parallel plan's, FSDP's)."""
        # Note: ``usable`` checks the three tensors' devices, dtypes, layouts and types
        lib = None
        if eager_plain(x) and type(delta) is torch.Tensor and x.shape == delta.shape:
            lib = None if _hooked(self) else _native.usable(x, delta, self.weight)
        if lib is not None:
            return _AddRMSNormFunction.apply(x, delta, self.weight, self.eps, lib)
        total = x + delta
        return total, self(total)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` would run hooks (its own or global ones), which a path
    around its ``forward`` would skip."""
    hooks = nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


class _AddRMSNormFunction(torch.autograd.Function):
    """``(total, rms_norm(total))``, ``total = x + delta``, by the fused CPU kernel (``lib``,
    the library :func:`hlat_model._native.usable` gave for the three tensors): forward
    writes ``total`` and the normalised rows in one pass, with the numbers of the add
    followed by :class:`_RMSNormFunction`'s kernel; it keeps ``total``, the weight and
    one fp32 scale per row (what the norm alone keeps). Backward is the norm's one pass,
    which also adds ``total``'s gradient from the residual stream and rounds the sum
    once (the composition rounds the norm's gradient, then the sum); ``x`` and ``delta``
    get that same tensor, as an add's backward gives them."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        delta: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        lib: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.native = lib
        ctx.set_materialize_grads(False)
        total, out, rstd = _native.add_rms_norm_forward(lib, x, delta, weight, eps)
        ctx.save_for_backward(total, weight, rstd)
        return total, out

    @staticmethod
    def backward(
        ctx: Any, grad_total: torch.Tensor | None, grad_out: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        if grad_out is None:
            return grad_total, grad_total, None, None, None
        total, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = _native.rms_norm_backward(
            ctx.native, grad_out, total, weight, rstd, residual=grad_total
        )
        return grad_x, grad_x, grad_weight, None, None


class _RMSNormFunction(torch.autograd.Function):
    """``weight * rms_norm(x.float()).to(x.dtype)``.

    **Fused CPU kernel** (``hlat_model._native``; contiguous ``x`` and ``weight``, both fp32
    or both bf16): one pass over each row forward (its sum of squares in registers) and one
    backward, fp32 inside, each result rounded once. Keeps ``x``, ``weight`` and one fp32
    scale per row; backward recomputes the normalised ``x`` from them. Forward gives the
    composition's numbers up to the order of the sum of squares; the gradients skip the
    composition's rounding of ``grad * weight`` to bf16, and are at least as close to
    float64 as its (tested). Measured on a 2-core Intel Xeon with AMX, one norm of 4 x 512
    tokens of width 512, forward and backward (the input's gradient accumulated): 1.19 ms
    against 3.86 ms with the operators below in bf16, 1.16 against 2.44 ms in fp32
    (``benchmarks/test_bench_train_step.py::test_fused_cpu_kernels``).

    **Torch's operators** (elsewhere): the composition's forward values, in four passes over
    ``x`` forward and about six backward. Keeps ``x``, the rounded normalised ``x`` and one
    fp32 scale per row for backward, where the composition kept an fp32 copy of ``x``
    besides the rounded one. In fp32 (``x`` and ``weight``) the normalised ``x`` is not
    rounded, so backward reads it instead of ``x``, which it does not keep, and takes the
    mean it needs as one product with the weight.

    Note: measured on a 2-core AVX512-BF16 EPYC, forward and backward of the 17 norms of an
    8-layer width-512 Llama at 4 x 512 bf16 tokens took 29-36 ms against 54-59 ms composed;
    the input's gradient differs from the composition's by rounding (at most one bf16 unit
    in the last place there), the weight's not at all. In fp32 the input's gradient differs
    from the composition's by the order of the mean's sum (tested)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        lib = _native.usable(x, weight)
        ctx.native = lib
        if lib is not None:
            out, rstd = _native.rms_norm_forward(lib, x, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            return out
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
        ctx.fp32 = x.dtype == weight.dtype == torch.float32
        # Note: in place only on a copy; an fp32 ``x`` is its own ``.float()``.
        normed = (xf.mul_(rstd) if xf is not x else xf * rstd).to(x.dtype)
        ctx.save_for_backward(None if ctx.fp32 else x, weight, rstd, normed)
        return normed * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        if ctx.native is not None:
            x, weight, rstd = ctx.saved_tensors
            grad_x, grad_weight = _native.rms_norm_backward(
                ctx.native, grad.contiguous(), x, weight, rstd
            )
            return grad_x, grad_weight, None
        x, weight, rstd, normed = ctx.saved_tensors
        scaled = grad * normed
        grad_weight = scaled.sum(dim=tuple(range(grad.dim() - 1)))
        # d/dx of x * rstd(x): rstd * (g - n * mean(g * n)), g the normalised output's grad
        # (``grad * weight``), n the normalised x
        if ctx.fp32:
            dot = torch.matmul(scaled, weight).div_(grad.shape[-1]).unsqueeze_(-1)
            grad_x = (grad * weight).addcmul_(normed, dot, value=-1).mul_(rstd)
            return grad_x, grad_weight, None
        d_normed = (grad * weight).float()
        xf = x.float()
        n = xf.mul_(rstd) if xf is not x else xf * rstd
        dot = (d_normed * n).mean(-1, keepdim=True)
        grad_x = d_normed.sub_(n.mul_(dot)).mul_(rstd).to(x.dtype)
        return grad_x, grad_weight, None


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables of shape [B, S, 1, head_dim/2] for the given positions."""
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (exponent / head_dim))
    angles = position_ids.float()[..., None] * inv_freq
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, S, H, D] in fp32 with the half-split pairing of Hugging Face's Llama."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """:func:`apply_rope` of ``x`` written into ``out`` (a view of any strides), computed in
    fp32 and rounded once to ``out``'s dtype; ``-sin`` gives the inverse rotation. Where
    ``out`` has the computation's dtype (fp32) each half is computed in place in ``out``,
    with no temporary and no copy; the numbers are the same. Otherwise ``x`` is widened
    once, not by each of the four operations that read a half of it (on CPUs an operation
    on operands of two dtypes converts the narrower one first); the numbers are the same."""
    half = x.shape[-1] // 2
    wide = torch.promote_types(x.dtype, cos.dtype)
    if out.dtype == wide:
        x1, x2 = x[..., :half], x[..., half:]
        out1, out2 = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=out2).addcmul_(x1, sin)
        return
    widened = x.to(wide)
    x1, x2 = widened[..., :half], widened[..., half:]
    rotated = torch.mul(x1, cos)
    out[..., :half].copy_(rotated.addcmul_(x2, sin, value=-1))
    torch.mul(x2, cos, out=rotated)
    out[..., half:].copy_(rotated.addcmul_(x1, sin))


class _HeadsWithRope(torch.autograd.Function):
    """q, k and v out of the fused qkv product, RoPE applied to q and k, each returned
    contiguous as [B, heads, S, D] (what the attention kernels read without copies).

    The same numbers as slicing, :func:`apply_rope` and transposing (fp32 inside, rounded
    once; a product and a sum may be contracted into one fused multiply-add), in fewer passes
    over memory; backward writes the inverse rotation of the q and k gradients and the v
    gradient straight into the qkv gradient, so no slice gradient is zero-filled. With the
    fused CPU kernel (``hlat_model._native``; a contiguous fp32 or bf16 ``qkv``, fp32
    tables of one layout) each direction is one pass over the rows, parallel over tokens;
    otherwise a few passes of torch's operators."""

    @staticmethod
    def forward(
        ctx: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq_len, groups, per_group, head_dim = qkv.shape
        ctx.save_for_backward(cos, sin)
        ctx.qkv_shape = qkv.shape
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None
        lib = _native.usable(qkv)
        if lib is not None and not _native.rope_tables_usable(cos, sin, qkv.shape):
            lib = None
        ctx.native = lib
        if lib is not None:
            return _native.rope_heads_forward(lib, qkv, cos, sin)
        q_per_kv = per_group - 2
        new = functools.partial(torch.empty, dtype=qkv.dtype, device=qkv.device)
        q = new(batch, groups * q_per_kv, seq_len, head_dim)
        k, v = new(batch, groups, seq_len, head_dim), new(batch, groups, seq_len, head_dim)
        by_group = q.transpose(1, 2).unflatten(2, (groups, q_per_kv))
        _rotate_into(by_group, qkv[:, :, :, :q_per_kv], cos[..., None, :], sin[..., None, :])
        _rotate_into(k.transpose(1, 2), qkv[:, :, :, q_per_kv], cos, sin)
        v.transpose(1, 2).copy_(qkv[:, :, :, q_per_kv + 1])
        return q, k, v

    @staticmethod
    def backward(
        ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        if ctx.native is not None:
            grad = _native.rope_heads_backward(ctx.native, ctx.qkv_shape, (dq, dk, dv), cos, sin)
            return grad, None, None
        groups, per_group = ctx.qkv_shape[2:4]
        q_per_kv = per_group - 2
        sample = next(g for g in (dq, dk, dv) if g is not None)
        grad = sample.new_empty(ctx.qkv_shape)
        if dq is None:
            grad[:, :, :, :q_per_kv].zero_()
        else:
            by_group = dq.transpose(1, 2).unflatten(2, (groups, q_per_kv))
            _rotate_into(grad[:, :, :, :q_per_kv], by_group, cos[..., None, :], -sin[..., None, :])
        if dk is None:
            grad[:, :, :, q_per_kv].zero_()
        else:
            _rotate_into(grad[:, :, :, q_per_kv], dk.transpose(1, 2), cos, -sin)
        if dv is None:
            grad[:, :, :, q_per_kv + 1].zero_()
        else:
            grad[:, :, :, q_per_kv + 1].copy_(dv.transpose(1, 2))
        return grad, None, None


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    # Note: gate and up are every other column of the fused product. Elementwise kernels on
    # such stride-2 views run about 3x slower on CPU (forward and backward) than on dense
    # tensors, more than the two copies cost.
    gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate.contiguous()) * up.contiguous()


def _silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up`` for ``gate_up = [gate | up]``, the two halves of the last
    dimension, with the gradients of that composition written into one buffer.

    **Fused CPU kernel** (``hlat_model._native``; a contiguous fp32 or bf16 ``gate_up``):
    one pass forward and one backward, fp32 inside (the sigmoid's exponential within 2 fp32
    units in the last place), each result rounded once where the composition rounds
    ``silu(gate)`` first: at least as close to float64 as autograd's (tested). Keeps
    ``gate_up`` alone and recomputes the activation in backward, whatever ``keep_silu``.

    **Torch's operators** (elsewhere): the same forward values and gradients as autograd's,
    bit for bit (the same kernels in the same order); what it saves is memory traffic:
    backward writes the gate and up gradients straight into the halves of ``gate_up``'s
    gradient instead of concatenating them, and it keeps ``gate_up`` itself (the product's
    own output) for backward rather than copies of its halves. ``keep_silu=False``
    recomputes ``silu(gate)`` in backward instead of keeping it (selective activation
    checkpointing)."""

    @staticmethod
    def forward(
        ctx: Any, gate_up: torch.Tensor, keep_silu: bool, interleaved: bool = False
    ) -> torch.Tensor:
        lib = _native.usable(gate_up) if gate_up.shape[-1] % 2 == 0 else None
        ctx.native, ctx.interleaved = lib, interleaved
        if lib is not None:
            ctx.save_for_backward(gate_up)
            return _native.swiglu_forward(lib, gate_up, interleaved)
        if interleaved:  # the halves' layout for the operators below (a copy)
            gate_up = gate_up.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        gate, up = gate_up.chunk(2, dim=-1)
        activated = F.silu(gate)
        ctx.keep_silu = keep_silu
        ctx.save_for_backward(gate_up, activated if keep_silu else None)
        return activated * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.native is not None:
            (gate_up,) = ctx.saved_tensors
            grad_gate_up = _native.swiglu_backward(
                ctx.native, grad.contiguous(), gate_up, ctx.interleaved
            )
            return grad_gate_up, None, None
        gate_up, activated = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        if not ctx.keep_silu:
            activated = F.silu(gate)
        grad_gate_up = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        torch.mul(grad, activated, out=grad_up)
        torch.mul(grad, up, out=grad_gate)
        # Note: output and input are the same memory, which elementwise kernels allow.
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        if ctx.interleaved:  # back to the input's layout
            grad_gate_up = grad_gate_up.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
        return grad_gate_up, None, None


def _plain_module(module: nn.Module) -> bool:
    """Whether ``module`` is an unhooked hlat :class:`Linear` holding a plain parameter, so
    that computing its product from its weight directly is the same as calling it."""
    return (
        type(module) is Linear
        and type(module.weight) is nn.Parameter
        and not (module._forward_hooks or module._forward_pre_hooks)
    )


class Attention(nn.Module):
    """Self-attention with RoPE and grouped-query heads, around a swappable core.

    ``attend(q, k, v, mask)`` is the core attention function on [B, H, S, D] tensors
    (default :func:`hlat_model.attention.attention`); parallel wrappers may replace it, as
    context parallelism does to attend to keys and values gathered from other ranks.

    With the default core, eager bf16 attention that
    :func:`hlat_model.attention.rope_flash_attention_fits` (CPUs with AMX or AVX512-BF16)
    runs the head split, RoPE and the core as one kernel,
    :func:`hlat_model.attention.rope_flash_attention`, on the fused product as it is.

    Selective checkpointing recomputes the core in backward, except where the default core
    runs a flash kernel on q, k and v as they are (not on fp32 copies of bf16 ones) and on
    batch-first activations (:func:`hlat_model.attention.runs_flash_kernel`): that kernel
    keeps no scores, and its output is the output projection's input itself, so
    recomputing it would free only its log-sum-exp (a core replaced through ``attend`` is
    always recomputed).

    Note: with ``selective``, the model step at the package benchmark's shape (8 layers of
    width 512, 4 x 512 tokens) on a 2-core Zen 5 EPYC (AVX512-BF16, no AMX) ran 1.059x and
    1.069x (bf16), 1.024x and 1.031x (fp32) faster than recomputing the flash kernels (two
    runs), and held the same memory when backward started, within 0.4 MiB of 270 MiB (bf16)
    and 539 MiB (fp32)
    (``benchmarks/test_bench_train_step.py::test_selective_checkpointing_in_the_model_step``).
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attend = attention
        self.head_dim = config.head_dim
        self.q_per_kv = config.q_per_kv
        self.selective = config.checkpointing == "selective"
        self.sequence_first = config.sequence_first
        # Note: sequence-first output is permuted and copied for the output projection, so
        # there recomputing even a flash kernel frees its output
        self.recompute_flash = self.selective and self.sequence_first
        qkv_rows = (config.n_heads + 2 * config.kv_heads) * config.head_dim
        self.qkv_proj = Linear(config.dim, qkv_rows)
        self.o_proj = Linear(config.n_heads * config.head_dim, config.dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.sequence_first:
            qkv = qkv.transpose(0, 1)
        batch, seq_len, _ = qkv.shape  # the full sequence, also when x is sequence-sharded
        qkv = qkv.reshape(batch, seq_len, -1, self.q_per_kv + 2, self.head_dim)
        if (
            self.attend is attention
            and not self.recompute_flash
            and eager_plain(qkv)
            and rope_flash_attention_fits(qkv, cos, sin, mask)
        ):
            # the head split, RoPE and attention in one kernel (AMX or AVX512-BF16 CPUs)
            out = rope_flash_attention(qkv, cos, sin, mask.first)
        else:
            out = self._split_and_attend(qkv, cos, sin, mask)
        out = out.permute(2, 0, 1, 3) if self.sequence_first else out.transpose(1, 2)
        return self.o_proj(out.reshape(out.shape[0], out.shape[1], -1))

    def _split_and_attend(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """q, k and v out of the fused product ``qkv`` [B, S, G, P, D], RoPE applied, then
        the core attention: [B, H, S, D]."""
        if eager_plain(qkv):
            q, k, v = _HeadsWithRope.apply(qkv, cos, sin)
        elif compiled_cpu_kernels(qkv) and _native.rope_tables_usable(cos, sin, qkv.shape):
            q, k, v = torch.ops.hlat.rope_heads(qkv, cos, sin)
        else:
            # Note: compiled blocks without the kernels (other devices, DTensors) keep the
            # plain ops, which inductor (or XLA) fuses itself.
            q = qkv[:, :, :, : self.q_per_kv].flatten(2, 3)
            k, v = qkv[:, :, :, self.q_per_kv], qkv[:, :, :, self.q_per_kv + 1]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.selective and (
            self.recompute_flash
            or self.attend is not attention
            or not runs_flash_kernel(q, k, v, mask)
        ):
            return checkpoint(self.attend, q, k, v, mask, use_reentrant=False)
        return self.attend(q, k, v, mask)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.selective = config.checkpointing == "selective"
        self.gate_up_proj = Linear(config.dim, 2 * config.ffn_dim)
        self.down_proj = Linear(config.ffn_dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.gate_up_proj
        plain_cpu = x.device.type == "cpu" and type(x) is torch.Tensor and _plain_module(proj)
        if plain_cpu and eager_plain(x) and _native.usable(x, proj.weight) is not None:
            # the fused kernel reads gate and up where the product leaves them (interleaved):
            # no permutation of the weight's rows, forward or backward
            gate_up = linear(x, proj.weight)
            return self.down_proj(_SwiGLUFunction.apply(gate_up, not self.selective, True))
        if plain_cpu and eager_plain(x):
            # Note: the product is computed with the weight's gate rows first and its up rows
            # second, so gate and up come out as dense halves instead of every other column.
            weight = proj.weight
            rows = torch.arange(weight.shape[0], device=weight.device)
            rows = rows.view(-1, 2).t().flatten()  # [0, 2, 4, ..., 1, 3, 5, ...]
            gate_up = linear_permuted_rows(x, weight, rows)
            return self.down_proj(_SwiGLUFunction.apply(gate_up, not self.selective))
        if plain_cpu and compiled_cpu_kernels(x, proj.weight):
            # compiled code on CPUs with the fused kernels: their SwiGLU as an operator, on
            # the product's interleaved gate and up
            gate_up = linear(x, proj.weight)
            return self.down_proj(torch.ops.hlat.swiglu(gate_up, True))
        if plain_cpu and torch.compiler.is_compiling():
            # Note: in code being compiled on CPUs, gate and up are two products with the
            # weight's every other row (strided views: backward keeps the weight itself, no
            # copy of it), so inductor's SwiGLU kernels read dense operands; on the
            # interleaved product its loads are scalar gathers. Compiled blocks of the
            # benchmark's model (8 layers of width 512, 4 x 512 tokens) ran 1.3 % faster in
            # bf16 on a 2-core AVX512-BF16 EPYC (median of 16 steps alternating in one
            # process; fastest 1.6 %).
            weight = proj.weight
            gate, up = linear(x, weight[0::2]), linear(x, weight[1::2])
            if self.selective:
                hidden = checkpoint(_silu_times, gate, up, use_reentrant=False)
            else:
                hidden = _silu_times(gate, up)
            return self.down_proj(hidden)
        gate_up = proj(x)
        if self.selective:
            hidden = checkpoint(_swiglu, gate_up, use_reentrant=False)
        else:
            hidden = _swiglu(gate_up)
        return self.down_proj(hidden)


class Block(nn.Module):
    """Pre-norm transformer block: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``; the
    first sum and the MLP's norm go through :meth:`RMSNorm.add_forward` (one fused pass on
    CPUs with hlat-model's kernels)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        delta = self.attention(self.attention_norm(h), cos, sin, mask)
        if isinstance(self.mlp_norm, RMSNorm):
            h, normed = self.mlp_norm.add_forward(h, delta)
        else:  # a norm module put in its place
            h = h + delta
            normed = self.mlp_norm(h)
        return h + self.mlp(normed)


def block_inputs(
    config: LlamaConfig, position_ids: torch.Tensor, doc_lens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, AttentionMask]:
    """What every block takes besides the hidden state, ``(cos, sin, mask)``, for tokens at
    ``position_ids`` [B, S] (the whole sequence) with document lengths ``doc_lens``.

    ``Llama.forward`` computes it once before its blocks; code that runs blocks itself (a
    pipeline stage holding a few of them) calls it with the same arguments. It needs the
    config only, not the weights.
    """
    seq_len = position_ids.shape[-1]
    cos, sin = rope_cos_sin(position_ids, config.head_dim, config.rope_theta)
    mask = AttentionMask.build(doc_lens, seq_len, config.attention, position_ids.device)
    return cos, sin, mask


def _is_default_loss(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` computes :func:`cross_entropy_loss` exactly, so the head and the
    loss may be fused in its place: it is that function, or a compiled form of it that says
    so (``hlat_compiled = True`` and ``__wrapped__`` the default, as
    ``hlat_parallel.compile_blocks`` marks it). Another wrapper, even through
    ``functools.wraps``, may compute something else and gets the logits."""
    if loss_fn is cross_entropy_loss:
        return True
    marked = getattr(loss_fn, "hlat_compiled", False) is True
    return marked and getattr(loss_fn, "__wrapped__", None) is cross_entropy_loss


def _retie(module: Llama, _incompatible_keys: Any) -> None:
    """``load_state_dict`` post-hook: tie the head to the embedding again (a module-level
    function, so that the model pickles)."""
    module._tie()


class Llama(nn.Module):
    """A Llama-family decoder returning next-token logits.

    Build on the meta device for large models, then materialise and initialise::

        with torch.device("meta"):
            model = Llama(LlamaConfig.preset("hlat-7b"))
        model.to_empty(device=torch.accelerator.current_accelerator() or "cpu")
        model.init_weights()

    Built on a real device, the weights are initialised at once.

    ``loss_fn(logits, labels)`` is the loss that ``forward`` computes from the logits when
    given ``labels`` (default :func:`hlat_model.cross_entropy_loss`; see ``forward`` for
    when the head and the loss are fused instead). Another trainer may set its own;
    ``hlat_parallel.compile_blocks`` replaces it with its compiled form, as torchtitan
    compiles its loss beside its blocks.
    """

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.loss_fn = cross_entropy_loss
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = Linear(config.dim, config.vocab_size)
        self._tie()
        # ``load_state_dict(assign=True)`` puts a Parameter of the state into each module
        self.register_load_state_dict_post_hook(_retie)
        if self.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    def _tie(self) -> None:
        """With ``tie_embeddings``, make the head's weight the embedding's (again)."""
        if self.config.tie_embeddings and self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.weight = self.embed_tokens.weight

    def _apply(self, fn: Any, recurse: bool = True) -> Llama:
        # Note: materialising from the meta device (``to_empty``) gives each module a new
        # Parameter of its own, which would untie the head from the embedding; FSDP2 keeps
        # the tie itself, and then this finds them tied
        super()._apply(fn, recurse)
        self._tie()
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, ``init_std``) for every matrix; ``init_std / sqrt(2 * n_layers)`` for
        ``o_proj`` and ``down_proj`` when ``scaled_init``; ones for norms.

        Works on materialised parameters of any placement (plain tensors or DTensors).
        """
        self._tie()
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers) if self.config.scaled_init else std
        nn.init.normal_(self.embed_tokens.weight, std=std)
        for block in cast("list[Block]", list(self.layers)):
            nn.init.normal_(block.attention.qkv_proj.weight, std=std)
            nn.init.normal_(block.attention.o_proj.weight, std=out_std)
            nn.init.normal_(block.mlp.gate_up_proj.weight, std=std)
            nn.init.normal_(block.mlp.down_proj.weight, std=out_std)
            block.attention_norm.reset_parameters()
            block.mlp_norm.reset_parameters()
        self.norm.reset_parameters()
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_lens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, vocab] for ``input_ids`` [B, S]; with ``labels``, the mean loss.

        ``position_ids`` [B, S] drive RoPE (default: 0..S-1, or restarting per document when
        ``doc_lens`` is given). ``doc_lens`` [B, D] (zero padded) enables document masking:
        no token attends across a document boundary.

        ``labels`` [B, S] (already shifted; ``-100`` is ignored) make it return the mean
        loss, a 0-d fp32 tensor: ``loss_fn`` of the logits (another ``loss_fn`` than the
        default gets the [B, S, vocab] logits and ``labels`` as given, also with
        ``sequence_first``), or
        :func:`hlat_model.linear_cross_entropy` where that fuses the head (on CPUs: fp32,
        and bf16 where the CPU multiplies bf16 natively; with the default ``loss_fn``): the
        logits are then never made. Any other head (another module in its place, a wrapper,
        one with forward hooks, or one sharded by tensor parallelism) goes through its module
        and the logits.
        """
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be [batch, seq] token ids, got shape {tuple(input_ids.shape)}"
            )
        batch, seq_len = input_ids.shape
        if seq_len == 0 or input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise ValueError(
                f"input_ids must be integer token ids of at least one position, got "
                f"{input_ids.dtype} of shape {tuple(input_ids.shape)}"
            )
        # Note: shapes only, checked before any work; values would need a device read
        if position_ids is not None and (
            position_ids.dim() != 2 or position_ids.shape[1] != seq_len
            or position_ids.shape[0] not in (1, batch)
        ):  # fmt: skip
            raise ValueError(
                f"position_ids must be [batch, seq] = [{batch}, {seq_len}] (or [1, {seq_len}]), "
                f"got {tuple(position_ids.shape)}"
            )
        if doc_lens is not None and (
            doc_lens.dim() != 2 or doc_lens.shape[0] not in (1, batch) or doc_lens.shape[1] == 0
            or doc_lens.is_floating_point() or doc_lens.dtype == torch.bool
        ):  # fmt: skip
            raise ValueError(
                f"doc_lens must be integer document lengths [batch, documents] with batch "
                f"{batch} (or 1, shared by the rows), zero padded, got {doc_lens.dtype} of "
                f"shape {tuple(doc_lens.shape)}"
            )
        # Note: values are checked on CPU tensors only (reading an accelerator's would wait
        # for it), and not while compiling (a graph break)
        if (
            doc_lens is not None and doc_lens.device.type == "cpu"
            and not torch.compiler.is_compiling()
        ):  # fmt: skip
            wrong = (doc_lens < 0).any(1) | (doc_lens.sum(1) > seq_len)
            if bool(wrong.any()):
                row = int(wrong.nonzero()[0])
                raise ValueError(
                    f"doc_lens must be non-negative document lengths summing to at most the "
                    f"sequence length {seq_len}, got {doc_lens[row].tolist()} in row {row}"
                )

        if (
            self.config.attention == "flex" and doc_lens is not None
            and input_ids.device.type == "cpu" and torch.is_grad_enabled()
            and any(p.requires_grad for p in self.parameters())
        ):  # fmt: skip
            raise ValueError(
                "attention='flex' cannot train on CPU (flex_attention has no CPU backward): "
                "use attention='auto', 'blocked' or 'sdpa' there, or run under torch.no_grad()"
            )
        if labels is not None:
            # Note: the losses' own check, made here before the first layer; the error types
            # are theirs (ValueError for the shape, TypeError for the dtype).
            wrong_shape = labels.shape != input_ids.shape
            if wrong_shape or labels.is_floating_point() or labels.is_complex():
                error = ValueError if wrong_shape else TypeError
                raise error(
                    f"labels must be integer token ids of the shape of input_ids "
                    f"{tuple(input_ids.shape)}, got {labels.dtype} of shape {tuple(labels.shape)}"
                )
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len {self.config.max_seq_len}; "
                "set LlamaConfig.max_seq_len or feed shorter rows"
            )
        device = input_ids.device
        if position_ids is None:
            if doc_lens is not None:
                position_ids = document_positions(doc_lens.to(device), seq_len)
            else:
                position_ids = torch.arange(seq_len, device=device).expand(batch, seq_len)
        cos, sin, mask = self.block_inputs(position_ids, doc_lens)

        try:
            h = self.embed_tokens(input_ids)
        except IndexError:
            # Note: said once the embedding refused it (on CPUs), not checked before: a
            # check would read the ids on the host at every step
            low, high = int(input_ids.min()), int(input_ids.max())
            bad = low if low < 0 else high
            raise ValueError(
                f"input_ids must be token ids in [0, vocab_size {self.config.vocab_size}), "
                f"got {bad}"
            ) from None
        if self.config.sequence_first:
            h = h.transpose(0, 1).contiguous()
        for block in self.layers:
            if self.config.checkpointing == "full" and torch.is_grad_enabled():
                h = checkpoint(block, h, cos, sin, mask, use_reentrant=False)
            else:
                h = block(h, cos, sin, mask)
        h = self.norm(h)
        if labels is not None:
            head = self.lm_head
            default_loss = _is_default_loss(self.loss_fn)
            if not default_loss:
                # another loss gets batch-first logits and the labels as given
                logits = head(h)
                logits = logits.transpose(0, 1) if self.config.sequence_first else logits
                return self.loss_fn(logits, labels)
            if self.config.sequence_first:  # the mean over all positions, in either layout
                labels = labels.transpose(0, 1)
            if _plain_module(head) and fuses_head(h, head.weight):
                return linear_cross_entropy(h, head.weight, labels)
            return self.loss_fn(head(h), labels)
        logits = self.lm_head(h)
        return logits.transpose(0, 1) if self.config.sequence_first else logits

    def block_inputs(
        self, position_ids: torch.Tensor, doc_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMask]:
        """What every block takes besides the hidden state: :func:`block_inputs` of this
        model's config."""
        return block_inputs(self.config, position_ids, doc_lens)

    def parallel_plan(self) -> dict[str, Any]:
        """How to split this model for tensor (and sequence) parallelism, as plain data.

        Keys are module-name patterns (``*`` matches one name component); values are a
        style name or a dict with ``"style"``. Styles:

        * ``embedding``: shard the vocabulary rows (vocab-parallel embedding);
        * ``colwise`` / ``rowwise``: Megatron column / row parallel linear;
        * ``fused_colwise``: column parallel over ``groups`` repeats of ``segments`` rows;
          a shard must hold whole groups, so the TP degree must divide ``groups``;
        * ``norm``: replicated weight; runs on sequence shards under sequence parallelism;
        * ``lm_head``: column parallel over the vocabulary, logits left sharded for a
          vocab-parallel cross entropy.
        """
        c = self.config
        hd = c.head_dim
        plan: dict[str, Any] = {
            "embed_tokens": "embedding",
            "layers.*.attention_norm": "norm",
            "layers.*.attention.qkv_proj": {
                "style": "fused_colwise",
                "segments": [c.q_per_kv * hd, hd, hd],
                "groups": c.kv_heads,
            },
            "layers.*.attention.o_proj": "rowwise",
            "layers.*.mlp_norm": "norm",
            "layers.*.mlp.gate_up_proj": {
                "style": "fused_colwise",
                "segments": [1, 1],
                "groups": c.ffn_dim,
            },
            "layers.*.mlp.down_proj": "rowwise",
            "norm": "norm",
            "lm_head": "lm_head",
        }
        return plan

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (shared tensors once); optionally without the input embedding."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and not self.config.tie_embeddings:
            total -= self.embed_tokens.weight.numel()
        return total


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): ``6 N + 12 L d S``.

    ``N`` counts every weight matrix that a token multiplies with (all but the input
    embedding, which is a lookup); ``12 L d S`` is the attention score and value matmuls
    (``QK^T`` and ``PV``, ``2 x 2 x S x d`` per layer forward, times 3 for backward).

    Note: as in PaLM's MFU definition, the causal mask is not discounted, so figures are
    comparable with Megatron, torchtitan and NxD reports.
    """
    c = config
    per_layer = c.dim * (c.n_heads + 2 * c.kv_heads) * c.head_dim  # qkv
    per_layer += c.n_heads * c.head_dim * c.dim  # o
    per_layer += 3 * c.dim * c.ffn_dim  # gate, up, down
    matmul_params = c.n_layers * per_layer + c.vocab_size * c.dim  # + lm_head
    return 6.0 * matmul_params + 12.0 * c.n_layers * c.dim * seq_len
