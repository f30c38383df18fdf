"""Causal attention kernels, with optional block-diagonal masking of packed documents.

A packed row holds several documents; ``doc_lens`` ([B, D] lengths, zero padded) says where
each one ends. Masking keeps every token's attention inside its own document, so the logits
of one document do not depend on its neighbours in the row.

Kernels: torch's ``scaled_dot_product_attention`` (``sdpa``), compiled ``flex_attention``
(``flex``) and :func:`blocked_causal_attention` (``blocked``, the default on CPUs), which
runs causal attention as batched matrix products over blocks of queries, each against the
keys up to its end only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from hlat_model.linear import cpu_has_native_bf16


def document_ids(doc_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, S] index of the document each token belongs to.

    Tokens past ``doc_lens.sum(-1)`` (padding) form one extra trailing segment.
    """
    ends = torch.cumsum(doc_lens, dim=-1)
    positions = torch.arange(seq_len, device=doc_lens.device).expand(ends.shape[0], seq_len)
    return torch.searchsorted(ends.contiguous(), positions.contiguous(), right=True)


def document_positions(doc_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, S] position of each token inside its document (restarts at 0 per document)."""
    doc_ids = document_ids(doc_lens, seq_len)
    ends = torch.cumsum(doc_lens, dim=-1)
    starts = torch.cat([ends - doc_lens, ends[:, -1:]], dim=-1)  # + the trailing segment
    positions = torch.arange(seq_len, device=doc_lens.device).expand_as(doc_ids)
    return positions - torch.gather(starts, 1, doc_ids)


class AttentionMask:
    """What a layer needs to mask attention: nothing (plain causal) or packed documents.

    Built once per forward and shared by every layer, so the (possibly expensive) mask is
    made once per step.

    ``backend`` is the mask's form: ``causal`` (none), ``sdpa`` (a boolean [B, 1, S, S]
    tensor, True where a query may attend to a key) or ``flex`` (a flex block mask).
    ``kernel`` is what runs a ``causal`` or ``sdpa`` mask: ``sdpa`` or ``blocked``.
    """

    def __init__(
        self,
        backend: str,
        doc_ids: torch.Tensor | None = None,
        mask: Any = None,
        kernel: str = "sdpa",
    ):
        self.backend = backend
        self.doc_ids = doc_ids
        self.mask = mask
        self.kernel = kernel

    @classmethod
    def build(
        cls, doc_lens: torch.Tensor | None, seq_len: int, backend: str, device: torch.device
    ) -> AttentionMask:
        """The mask of one forward; ``backend`` is ``LlamaConfig.attention``: ``auto`` is
        ``blocked`` on CPUs, ``flex`` for packed documents on CUDA, ``sdpa`` elsewhere."""
        if backend == "auto":
            if device.type == "cpu":
                backend = "blocked"
            else:
                backend = "flex" if device.type == "cuda" and doc_lens is not None else "sdpa"
        kernel = "blocked" if backend == "blocked" else "sdpa"
        if doc_lens is None:
            return cls("causal", kernel=kernel)
        doc_ids = document_ids(doc_lens.to(device), seq_len)
        if backend == "flex":
            return cls("flex", doc_ids, _flex_block_mask(doc_ids))
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        return cls("sdpa", doc_ids, (same_doc & causal).unsqueeze(1), kernel=kernel)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
) -> torch.Tensor:
    """Scaled dot-product attention on [B, H, S, D] tensors; k/v may have fewer heads (GQA).

    Softmax statistics accumulate in fp32 in every kernel used here, also for bf16 inputs.
    ``mask.kernel == "blocked"`` runs :func:`blocked_causal_attention` on plain tensors
    outside ``torch.compile``; tensor subclasses (DTensor) and compiled blocks run SDPA.
    """
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not cpu_has_native_bf16():
        # Note: both CPU kernels multiply bf16 matrices (the flash kernel's backward, the
        # blocked kernel's products), emulated and slower than in fp32 on CPUs without bf16
        # instructions; on fp32 operands they accumulate in fp32 as a native kernel would.
        return attention(q.float(), k.float(), v.float(), mask).to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    if (
        getattr(mask, "kernel", "sdpa") == "blocked"
        and mask.backend in ("causal", "sdpa")
        and type(q) is torch.Tensor
        and not torch.compiler.is_compiling()
    ):
        # Note: compiled blocks keep SDPA: a graph break here split a tensor-parallel
        # block into graphs whose collectives lost their process group (torch 2.13).
        return blocked_causal_attention(q, k, v, mask.mask)
    if mask.backend == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask.backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.mask, enable_gqa=gqa)
    return _compiled_flex()(q, k, v, block_mask=mask.mask, enable_gqa=gqa)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_block_mask(doc_ids: torch.Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    batch, seq_len = doc_ids.shape
    return create_block_mask(
        same_document_causal, batch, None, seq_len, seq_len, device=doc_ids.device
    )


KEEP_PROBABILITIES_BYTES = 256 * 2**20
"""Largest attention probabilities (bytes per call) that :func:`blocked_causal_attention`
keeps for backward; above it, backward recomputes them block by block, so what a layer
keeps for backward is linear in the sequence length (q, k and v), as with flash kernels.
Either way one block's scores ([B*H, block, S] at most) exist at a time."""


def query_block(seq_len: int) -> int:
    """Queries per block of :func:`blocked_causal_attention`: a multiple of 64, an eighth
    of the sequence or more (a diagonal block computes its masked half too)."""
    return max(64, -(-seq_len // 8 // 64) * 64)


def blocked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention on [B, H, S, D] tensors (k/v may have fewer heads: GQA), scale
    ``1/sqrt(D)``, as batched matrix products over blocks of :func:`query_block` queries,
    each block against the keys up to its own end, so the masked half of the scores is
    mostly never computed. ``allowed`` ([B, 1, S, S] boolean, True where a query may attend
    to a key, within the causal triangle) masks packed documents.

    Precision: scores come out of the product scaled and rounded to the inputs' dtype
    (fp32 accumulation inside it), as in Hugging Face's eager attention; probabilities are
    fp32 (rounded to the inputs' dtype for the products); score gradients are computed in
    fp32, scaled, and rounded once; key and value gradients sum over blocks in fp32. In
    bf16 the output and gradients are as close to float64 as the eager path's (tested).
    Backward keeps the probabilities when they fit :data:`KEEP_PROBABILITIES_BYTES`, else
    recomputes them.

    Note: on CPUs torch's flash kernel runs its products in small tiles; with these larger
    products forward + backward ran 1.9x faster in bf16 and 1.7x in fp32 at 4 x 8 heads x
    512 x 64, 1.4x and 1.1x at 1 x 8 x 2048 x 128, on a 2-core AVX512-BF16 CPU
    (``benchmarks/test_bench_train_step.py::test_attention_kernels``).
    """
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return _BlockedCausal.apply(q, k, v, allowed)


def _probabilities(
    q: torch.Tensor,
    k_t: torch.Tensor,
    start: int,
    end: int,
    scale: float,
    masked: torch.Tensor | None,
    heads: int,
) -> torch.Tensor:
    """Softmax of the scores of queries ``start:end`` against keys ``:end``; q is
    [B*H, S, D], ``k_t`` the keys transposed, [B*H, D, S] (its slices are rows, which the
    product copies fast; slices of the untransposed keys copied 3x slower). ``masked`` is
    the negated ``allowed`` mask (True where masked), or None for plain causal."""
    rows = end - start
    scores = torch.baddbmm(
        q.new_zeros(()).expand(q.shape[0], rows, end),
        q[:, start:end],
        k_t[:, :, :end],
        beta=0,
        alpha=scale,
    )
    if masked is None:
        above = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu(1)
        scores[:, :, start:].masked_fill_(above, float("-inf"))
    else:
        by_head = scores.unflatten(0, (-1, heads))
        by_head.masked_fill_(masked[:, :, start:end, :end], float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32)


def _blocks(seq_len: int) -> list[tuple[int, int]]:
    block = query_block(seq_len)
    return [(start, min(start + block, seq_len)) for start in range(0, seq_len, block)]


class _BlockedCausal(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, heads, seq_len, head_dim = q.shape
        qf, kf, vf = (t.reshape(batch * heads, seq_len, head_dim) for t in (q, k, v))
        k_t = kf.transpose(1, 2).contiguous()
        masked = None if allowed is None else ~allowed
        scale = head_dim**-0.5
        blocks = _blocks(seq_len)
        kept_bytes = qf.shape[0] * seq_len * (seq_len + blocks[0][1]) // 2 * 4
        keep = kept_bytes <= KEEP_PROBABILITIES_BYTES
        outs, kept = [], []
        for start, end in blocks:
            probs = _probabilities(qf, k_t, start, end, scale, masked, heads)
            outs.append(torch.bmm(probs.to(vf.dtype), vf[:, :end]))
            if keep:
                kept.append(probs)
        ctx.save_for_backward(qf, kf, vf, masked, *kept)
        ctx.shape, ctx.scale = q.shape, scale
        return torch.cat(outs, dim=1).view(q.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qf, kf, vf, masked, *kept = ctx.saved_tensors
        batch, heads, seq_len, head_dim = ctx.shape
        scale = ctx.scale
        grad = grad.reshape(batch * heads, seq_len, head_dim)
        k_t, v_t = (t.transpose(1, 2).contiguous() for t in (kf, vf))
        # Note: key and value gradients sum over query blocks in fp32, as flash kernels do.
        dk = torch.zeros(kf.shape, dtype=torch.float32, device=kf.device)
        dv = torch.zeros_like(dk)
        dqs = []
        for n, (start, end) in enumerate(_blocks(seq_len)):
            probs = kept[n] if kept else _probabilities(qf, k_t, start, end, scale, masked, heads)
            rows = grad[:, start:end]
            dv[:, :end].add_(torch.bmm(probs.to(rows.dtype).transpose(1, 2), rows))
            dprobs = torch.bmm(rows, v_t[:, :, :end]).float()
            dscores = torch.ops.aten._softmax_backward_data(dprobs, probs, -1, probs.dtype)
            dscores = dscores.mul_(scale).to(qf.dtype)
            dqs.append(torch.bmm(dscores, kf[:, :end]))
            dk[:, :end].add_(torch.bmm(dscores.transpose(1, 2), qf[:, start:end]))
        dq = torch.cat(dqs, dim=1)
        dk = dk.to(kf.dtype)
        return dq.view(ctx.shape), dk.view(ctx.shape), dv.to(vf.dtype).view(ctx.shape), None
