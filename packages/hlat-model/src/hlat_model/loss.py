"""Next-token cross entropy in fp32, over row chunks of the logits.

``F.cross_entropy(logits.float(), ...)`` makes three fp32 tensors the size of the logits
(the copy, the log-softmax autograd keeps, and its gradient) besides the logits. Here the
logits are read in chunks of rows: forward keeps the logits themselves and one fp32 number
per row (the log-sum-exp); backward writes the gradient chunk by chunk, in the logits'
dtype. The values are those of ``F.cross_entropy`` on the fp32 logits (tested).

:func:`linear_cross_entropy` goes one step further where it is measured to pay (CPUs: fp32,
and bf16 where the CPU multiplies bf16 natively): it takes the LM head's input and weight
instead of the logits, and never makes the logits at all. Each chunk of rows is multiplied
out, turned into its loss terms and, when gradients are wanted, into its logits' gradient
(rounded once, as the loss's backward through the logits rounds it), which goes straight
into the gradients of the head's input and weight. Backward then only scales those by the
incoming gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hlat_model import _native
from hlat_model.linear import _fp32_accumulates, linear

LOSS_CHUNK_BYTES = {"cpu": 8 * 2**20}
"""Bytes of one fp32 chunk of logits, by device type; other devices use
:data:`LOSS_CHUNK_BYTES_DEFAULT`.

Note: on CPUs, glibc serves blocks above 32 MiB from fresh pages (mmap) every time, and
the page faults on full-size fp32 copies cost a 2-core AVX512-BF16 CPU more than their
arithmetic: at 2,048 tokens and vocabulary 32,000, the loss took 113 ms beside the LM head's
products in chunks and 301 ms through ``F.cross_entropy`` on the fp32 copy, which
page-faulted 128,002 times per call (``benchmarks/test_bench_train_step.py::
test_loss_kernels``)."""

LOSS_CHUNK_BYTES_DEFAULT = 256 * 2**20
"""Bytes of one fp32 chunk of logits on accelerators: large enough that the loss is a few
kernel launches, small beside the full fp32 copy at a 7B model's shapes."""


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean next-token loss in fp32. ``labels`` are already shifted (``labels[t]`` is the
    token after ``input_ids[t]``); positions equal to ``ignore_index`` do not count (all
    ignored gives NaN and zero gradients, as ``F.cross_entropy`` does).

    Plain tensors go through the chunked kernel of this module; tensor subclasses
    (vocabulary-sharded DTensors under ``loss_parallel``), code being compiled and
    PyTorch/XLA's lazy tensors (whose compiler fuses the loss itself) go through
    ``F.cross_entropy`` on the fp32 logits.
    """
    _check_labels(logits, labels, "logits")
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if not eager_plain(logits):
        return F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=ignore_index)
    return _ChunkedCrossEntropy.apply(flat_logits, flat_labels, ignore_index)


def _check_labels(inputs: torch.Tensor, labels: torch.Tensor, what: str) -> None:
    """Refuse labels that do not fit ``inputs`` [..., features] before any work."""
    if inputs.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match {what} of shape "
            f"{tuple(inputs.shape)}: expected labels of shape {tuple(inputs.shape[:-1])}"
        )
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be integer token ids, got {labels.dtype}")


def _native_targets(
    lib: Any, labels: torch.Tensor, valid: torch.Tensor, vocab: int, ignore_index: int
) -> torch.Tensor:
    """int64 targets for the fused CPU kernel: the labels, ``-1`` where ignored (outside the
    vocabulary: no one-hot). A counted label outside ``[0, vocab)`` is refused first, as the
    operators' gather refuses it (the kernel would take it for an ignored row)."""
    wide = labels.to(torch.int64).contiguous()
    _native.check_labels(lib, wide, vocab, ignore_index)
    return wide.where(valid, -1)


def eager_plain(x: torch.Tensor) -> bool:
    """Whether ``x`` is a plain tensor computed op by op: not a tensor subclass (DTensor),
    not traced by ``torch.compile``, not on PyTorch/XLA's lazy device (trn1), whose
    compilers fuse elementwise work themselves, and not under autocast, which casts
    operators' inputs where the hand-fused functions do not. hlat-model's hand-fused paths
    (this loss, the RoPE head split, RMSNorm, SwiGLU) run only there."""
    return (
        type(x) is torch.Tensor
        and not torch.compiler.is_compiling()
        and x.device.type != "xla"
        and not _autocast_enabled(x.device.type)
    )


def _autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for device types autocast does not
    know (``meta``, where it raises)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def _rows_per_chunk(logits: torch.Tensor) -> int:
    budget = LOSS_CHUNK_BYTES.get(logits.device.type, LOSS_CHUNK_BYTES_DEFAULT)
    return max(1, budget // (4 * logits.shape[-1]))


FUSED_HEAD_ROWS = {"cpu": 1024}
"""Rows of one chunk of logits in :func:`linear_cross_entropy`, by device type; its fused
path runs only on these device types.

Note: counted in rows, not bytes: each chunk adds its product into the whole weight's
gradient, so fewer, larger chunks pass over that gradient fewer times. On a 2-core AVX2
EPYC, fp32, 2,048 tokens, dim 512, forward and backward, the fastest of 7 interleaved
rounds: at vocabulary 8,192, 328 ms in chunks of 1,024 rows against 374 ms through the
logits, 335-347 ms in 256-512 rows, 341 ms in one chunk; at vocabulary 32,000, 1,410-1,456
ms in 524-1,048 rows against 1,637 ms, and 1,753 ms (slower than the logits) in 131 rows.
(Those runs zero-filled the weight's gradient before the first chunk; it now starts from
the first chunk's product.) ``benchmarks/test_bench_train_step.py::test_fused_head_against_logits`` measures 1,024
rows against the logits.

CPUs only, where it pays. On CUDA (one H200, fp32, 8,192 tokens, forward and backward) it
took 0.90-0.99x the time of the path through the logits, in chunks of 1,024 to 8,192 rows,
while needing a fifth to a half of its peak memory (the package README has the figures), so
CUDA keeps the logits."""


def fuses_head(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear_cross_entropy` takes its fused path for these operands: plain
    tensors (see :func:`eager_plain`) on a device type of :data:`FUSED_HEAD_ROWS`, both fp32,
    or both bf16 where :class:`hlat_model.Linear` multiplies bf16 natively (the head's
    products are then the same oneDNN products either way). On CPUs that would emulate bf16
    products, ``Linear`` multiplies through its fp32-accumulating path, so bf16 keeps the
    logits there."""
    return (
        eager_plain(hidden)
        and type(weight) in (nn.Parameter, torch.Tensor)
        and hidden.dtype == weight.dtype
        and hidden.device.type in FUSED_HEAD_ROWS
        and (
            hidden.dtype == torch.float32
            or (hidden.dtype == torch.bfloat16 and not _fp32_accumulates(hidden, weight))
        )
    )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
) -> torch.Tensor:
    """:func:`cross_entropy_loss` of the logits ``hidden @ weight.T`` (an LM head without
    bias: ``hidden`` [..., dim], ``weight`` [vocab, dim], ``labels`` ``hidden.shape[:-1]``).

    Where :func:`fuses_head` says so, the logits are never made: rows go through the
    head's product and the loss in chunks of :data:`FUSED_HEAD_ROWS`, and with
    gradients wanted each chunk's logits' gradient goes straight into those of ``hidden``
    and ``weight`` (computed in forward, scaled in backward). Elsewhere it is
    ``cross_entropy_loss(linear(hidden, weight), labels)``. Both give the same values up to
    the order of the sums (tested); in bf16 the weight's gradient is rounded once per chunk
    (its error against float64 within 1.5x of the logits path's, tested).
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden of shape {tuple(hidden.shape)} does not fit an LM head weight of shape "
            f"{tuple(weight.shape)}: expected a [vocab, {hidden.shape[-1]}] weight"
        )
    _check_labels(hidden, labels, "hidden states")
    if not fuses_head(hidden, weight):
        return cross_entropy_loss(linear(hidden, weight), labels, ignore_index)
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(flat_hidden, weight, flat_labels, ignore_index)
    return _head_loss_in_chunks(flat_hidden, weight, flat_labels, ignore_index, False, False)[0]


def _head_loss_in_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    grad_hidden: bool,
    grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mean loss of ``hidden @ weight.T`` and, as asked, its gradients for ``hidden``
    and ``weight``; one logits buffer of a chunk's rows is reused throughout."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    rows = max(1, min(n_rows, FUSED_HEAD_ROWS[hidden.device.type]))
    valid = labels != ignore_index
    count = valid.sum()
    buffer = hidden.new_empty((rows, vocab))
    lse, picked = (hidden.new_empty(n_rows, dtype=torch.float32) for _ in range(2))
    wants_grad = grad_hidden or grad_weight
    gh = torch.empty_like(hidden) if grad_hidden else None
    gw = torch.empty_like(weight, memory_format=torch.contiguous_format) if grad_weight else None
    # d loss / d (lse - picked) per row (zeros when none counts, as F.cross_entropy's
    # gradient, though the loss is NaN): each chunk's logits are overwritten with their
    # gradient, (softmax - onehot) times it, rounded once to the logits' dtype, as the
    # loss's backward through the logits writes it
    scale = (valid / count.clamp_min(1)).to(torch.float32) if wants_grad else None
    lib = _native.usable(buffer)
    if lib is not None:
        targets = _native_targets(lib, labels, valid, vocab, ignore_index)
    else:
        targets = labels.where(valid, 0)
        # torch's operators run on an fp32 chunk (bf16 logits copied into it)
        widen = buffer.dtype != torch.float32
        work = torch.empty_like(buffer, dtype=torch.float32) if widen else buffer
        minus_one = work.new_full((rows, 1), -1.0)
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        chunk, x = buffer[: end - start], hidden[start:end]
        torch.mm(x, weight.t(), out=chunk)
        if lib is not None:
            # the loss terms and, with gradients wanted, the logits' gradient in place
            into = (lse[start:end], picked[start:end])
            row_scale = None if scale is None else scale[start:end]
            _native.cross_entropy_forward(lib, chunk, targets[start:end], row_scale, into)
        else:
            fp32 = work[: end - start]
            if widen:
                fp32.copy_(chunk)
            torch.gather(fp32, 1, targets[start:end, None], out=picked[start:end, None])
            row_max = torch.amax(fp32, dim=-1, keepdim=True)
            torch.sum(fp32.sub_(row_max).exp_(), dim=-1, out=lse[start:end])
            if scale is not None:
                fp32.div_(lse[start:end, None])  # softmax
                fp32.scatter_add_(1, targets[start:end, None], minus_one[: end - start])
                fp32.mul_(scale[start:end, None])
                if widen:
                    chunk.copy_(fp32)
            lse[start:end].log_().add_(row_max[:, 0])
        if wants_grad:
            # this chunk's share of the gradients of the head's input and weight
            if gh is not None:
                torch.mm(chunk, weight, out=gh[start:end])
            if gw is not None and start == 0:
                torch.mm(chunk.t(), x, out=gw)
            elif gw is not None:
                gw.addmm_(chunk.t(), x)
    loss = (lse - picked).mul_(valid).sum() / count
    return loss, gh, gw


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the gradients too (the logits exist only a chunk at a time);
    backward scales them by the incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
    ) -> torch.Tensor:
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        loss, gh, gw = _head_loss_in_chunks(
            hidden, weight, labels, ignore_index, want_hidden, want_weight
        )
        ctx.save_for_backward(gh, gw)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gh, gw = ctx.saved_tensors
        return (
            None if gh is None else gh * grad,
            None if gw is None else gw * grad,
            None,
            None,
        )


class _ChunkedCrossEntropy(torch.autograd.Function):
    """One fp32 buffer of :func:`_rows_per_chunk` rows is reused for every chunk, forward
    and backward: fresh blocks per chunk cost page faults on CPUs."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
    ) -> torch.Tensor:
        ctx.native = lib = _native.usable(logits)
        valid = labels != ignore_index
        if lib is not None:
            targets = _native_targets(lib, labels, valid, logits.shape[1], ignore_index)
            lse, picked = _native.cross_entropy_forward(lib, logits, targets)
            count = valid.sum()
            ctx.save_for_backward(logits, lse, targets, valid, count)
            return (lse - picked).mul_(valid).sum() / count
        n_rows, rows = logits.shape[0], _rows_per_chunk(logits)
        targets = labels.where(valid, 0)
        buffer = logits.new_empty((min(rows, n_rows), logits.shape[1]), dtype=torch.float32)
        lse = buffer.new_empty(n_rows)
        picked = buffer.new_empty(n_rows)
        for start in range(0, n_rows, rows):
            end = min(start + rows, n_rows)
            chunk = buffer[: end - start]
            chunk.copy_(logits[start:end])
            torch.gather(chunk, 1, targets[start:end, None], out=picked[start:end, None])
            row_max = torch.amax(chunk, dim=-1, keepdim=True)
            torch.sum(chunk.sub_(row_max).exp_(), dim=-1, out=lse[start:end])
            lse[start:end].log_().add_(row_max[:, 0])
        count = valid.sum()
        ctx.save_for_backward(logits, lse, targets, valid, count)
        return (lse - picked).mul_(valid).sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        logits, lse, targets, valid, count = ctx.saved_tensors
        # d loss / d (lse - picked), per row; zeros when none counts, as F.cross_entropy's
        scale = (grad / count.clamp_min(1)) * valid
        if ctx.native is not None:
            scale = scale.to(torch.float32).contiguous()
            out = _native.cross_entropy_backward(ctx.native, logits, targets, lse, scale)
            return out, None, None
        n_rows, rows = logits.shape[0], _rows_per_chunk(logits)
        out = torch.empty_like(logits)
        buffer = logits.new_empty((min(rows, n_rows), logits.shape[1]), dtype=torch.float32)
        minus_one = buffer.new_full((buffer.shape[0], 1), -1.0)
        for start in range(0, n_rows, rows):
            end = min(start + rows, n_rows)
            chunk = buffer[: end - start]
            chunk.copy_(logits[start:end])  # a copy: backward leaves fp32 logits unchanged
            chunk.sub_(lse[start:end, None]).exp_()  # softmax
            chunk.scatter_add_(1, targets[start:end, None], minus_one[: end - start])
            if out.dtype == chunk.dtype:
                torch.mul(chunk, scale[start:end, None], out=out[start:end])
            else:
                # Note: scaled in place, then rounded into ``out``: a product written
                # into an output of another dtype goes through a fresh fp32 result on
                # CPUs (6,144 more page faults per step at the benchmark's shape).
                out[start:end].copy_(chunk.mul_(scale[start:end, None]))
        return out, None, None
