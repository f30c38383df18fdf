"""Next-token cross entropy in fp32, over row chunks of the logits.

``F.cross_entropy(logits.float(), ...)`` makes three fp32 tensors the size of the logits
(the copy, the log-softmax autograd keeps, and its gradient) besides the logits. Here the
logits are read in chunks of rows: forward keeps the logits themselves and one fp32 number
per row (the log-sum-exp); backward writes the gradient chunk by chunk, in the logits'
dtype. The values are those of ``F.cross_entropy`` on the fp32 logits (tested).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

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
    ignored gives NaN, as ``F.cross_entropy`` does).

    Plain tensors go through the chunked kernel of this module; tensor subclasses
    (vocabulary-sharded DTensors under ``loss_parallel``), code being compiled and
    PyTorch/XLA's lazy tensors (whose compiler fuses the loss itself) go through
    ``F.cross_entropy`` on the fp32 logits.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match logits of shape "
            f"{tuple(logits.shape)}: expected labels of shape {tuple(logits.shape[:-1])}"
        )
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be integer token ids, got {labels.dtype}")
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if not eager_plain(logits):
        return F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=ignore_index)
    return _ChunkedCrossEntropy.apply(flat_logits, flat_labels, ignore_index)


def eager_plain(x: torch.Tensor) -> bool:
    """Whether ``x`` is a plain tensor computed op by op: not a tensor subclass (DTensor),
    not traced by ``torch.compile``, not on PyTorch/XLA's lazy device (trn1), whose
    compilers fuse elementwise work themselves. hlat-model's hand-fused paths (this loss,
    the RoPE head split) run only there."""
    return type(x) is torch.Tensor and not torch.compiler.is_compiling() and x.device.type != "xla"


def _rows_per_chunk(logits: torch.Tensor) -> int:
    budget = LOSS_CHUNK_BYTES.get(logits.device.type, LOSS_CHUNK_BYTES_DEFAULT)
    return max(1, budget // (4 * logits.shape[-1]))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """One fp32 buffer of :func:`_rows_per_chunk` rows is reused for every chunk, forward
    and backward: fresh blocks per chunk cost page faults on CPUs."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
    ) -> torch.Tensor:
        n_rows, rows = logits.shape[0], _rows_per_chunk(logits)
        valid = labels != ignore_index
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
        n_rows, rows = logits.shape[0], _rows_per_chunk(logits)
        scale = (grad / count) * valid  # d loss / d (lse - picked), per row
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
