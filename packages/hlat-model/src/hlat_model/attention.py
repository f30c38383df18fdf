"""Causal attention kernels, with optional block-diagonal masking of packed documents.

A packed row holds several documents; ``doc_lens`` ([B, D] lengths, zero padded) says where
each one ends. Masking keeps every token's attention inside its own document, so the logits
of one document do not depend on its neighbours in the row.
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
    """

    def __init__(self, backend: str, doc_ids: torch.Tensor | None = None, mask: Any = None):
        self.backend = backend
        self.doc_ids = doc_ids
        self.mask = mask

    @classmethod
    def build(
        cls, doc_lens: torch.Tensor | None, seq_len: int, backend: str, device: torch.device
    ) -> AttentionMask:
        if doc_lens is None:
            return cls("causal")
        doc_ids = document_ids(doc_lens.to(device), seq_len)
        if backend == "auto":
            backend = "flex" if device.type == "cuda" else "sdpa"
        if backend == "flex":
            return cls("flex", doc_ids, _flex_block_mask(doc_ids))
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        return cls("sdpa", doc_ids, (same_doc & causal).unsqueeze(1))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
) -> torch.Tensor:
    """Scaled dot-product attention on [B, H, S, D] tensors; k/v may have fewer heads (GQA).

    Softmax statistics accumulate in fp32 in every kernel used here, also for bf16 inputs.
    """
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not cpu_has_native_bf16():
        # Note: the CPU flash kernel's backward multiplies in bf16, emulated (10x slower) on
        # CPUs without bf16 instructions; fp32 operands give the same fp32-accumulated result.
        return attention(q.float(), k.float(), v.float(), mask).to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
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
