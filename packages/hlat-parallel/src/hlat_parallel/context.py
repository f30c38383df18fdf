"""Context parallelism (CP): the sequence split over the ranks of a "cp" process group.

Each CP rank holds ``seq_len / cp`` tokens of every row. Everything but attention is
per-token and runs on the shard unchanged; each attention layer all-gathers the keys and
values of the whole sequence over the cp group and attends from its local queries to them
under a causal mask in global token positions (Llama 3's all-gather formulation). The
gather is autograd-aware: its backward reduce-scatters the gradients of the gathered keys
and values, so each rank's K/V shard receives the gradient from every rank's queries.

Load balance: under a causal mask a token attends to all tokens before it, so a contiguous
split gives the last rank ``2 cp - 1`` times the work of the first. Here the sequence is cut
into ``2 cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``; every rank
then attends to the same number of (query, key) pairs (:func:`cp_indices`).

The caller shards the inputs, labels and positions with the same layout, so RoPE sees
global positions::

    apply_context_parallel(model, mesh["cp"])
    pos = cp_indices(seq_len, cp, cp_rank).expand(batch, -1)
    logits = model(shard_sequence(ids, cp, cp_rank), position_ids=pos)
    loss = cross_entropy_loss(logits, shard_sequence(labels, cp, cp_rank))

Each rank's loss is the mean over its own tokens (equal counts), so the loss of the whole
sequence is the mean of the cp ranks' losses, and its gradient is the sum of the ranks'
gradients divided by cp: reduce gradients over the cp group as over a data-parallel one
(FSDP over a flattened dp x cp mesh does this). Where labels are ignored (``-100``) the
counts differ; then sum the losses and divide by the token count of the whole sequence.

Note: torch's ``context_parallel`` (ring attention) dispatches only CUDA SDPA kernels and
FlexAttention has no CPU backward in torch 2.13; the all-gather needs neither, so it runs on
every device. It holds the whole sequence's K/V per layer (with GQA, the few KV heads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hlat_parallel.dims import ParallelConfigError

AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


def check_context_parallel(cp: int, seq_len: int, document_mask: bool = False) -> None:
    """Raise :class:`ParallelConfigError` if ``seq_len`` cannot be split over ``cp`` ranks
    in the load-balanced layout, or if document masking is asked for with cp > 1; pure.
    With cp 1 every ``seq_len`` works."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ParallelConfigError(f"cp must be a positive integer, got {cp!r}")
    chunks = 2 * cp
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ParallelConfigError(f"seq_len must be a positive integer, got {seq_len!r}")
    if cp > 1 and seq_len % chunks:
        lower, upper = seq_len // chunks * chunks, (seq_len // chunks + 1) * chunks
        works = f"{lower} or {upper}" if lower else f"{upper}"
        raise ParallelConfigError(
            f"context parallelism cuts the sequence into 2 * cp = {chunks} equal chunks, but "
            f"seq_len {seq_len} is not divisible by {chunks}; use a multiple of {chunks} "
            f"(e.g. {works}) or another cp"
        )
    if document_mask and cp > 1:
        raise ParallelConfigError(
            f"document masking with context parallelism (cp {cp}) is not supported yet; set "
            "data.document_mask=false (train without doc_lens) or cp=1"
        )


def cp_indices(
    seq_len: int, cp: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global token positions CP rank ``cp_rank`` holds, in order: chunks ``cp_rank``
    and ``2 cp - 1 - cp_rank`` of ``2 cp`` equal chunks (a LongTensor of ``seq_len / cp``)."""
    check_context_parallel(cp, seq_len)
    if not 0 <= cp_rank < cp:
        raise ParallelConfigError(f"cp_rank {cp_rank} is outside 0..{cp - 1}")
    if cp == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat(
        (
            torch.arange(first, first + chunk, device=device),
            torch.arange(second, second + chunk, device=device),
        )
    )


def shard_sequence(t: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of ``t`` along ``dim`` (the sequence), in :func:`cp_indices`
    order: use it on input ids, labels and position ids alike."""
    return t.index_select(dim, cp_indices(t.shape[dim], cp, cp_rank, device=t.device))


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every CP rank's shard (``shards[r]`` from rank ``r``), in
    token order: the inverse of :func:`shard_sequence`, e.g. for evaluation."""
    cp = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    joined = torch.cat(list(shards), dim=dim)
    return joined.index_select(dim, _gathered_positions(seq_len, cp, joined.device).argsort())


def _gathered_positions(seq_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """The global positions of the sequence as gathered from the cp ranks, in rank order."""
    return torch.cat([cp_indices(seq_len, cp, r, device=device) for r in range(cp)])


def _cp_group(group: Any) -> dist.ProcessGroup:
    if group is None:
        return dist.group.WORLD  # type: ignore[return-value]
    if hasattr(group, "get_group"):  # a 1-D DeviceMesh, e.g. mesh["cp"]
        return group.get_group()
    return group


class _KeyMask:
    """The mask the wrapped attention receives: explicit, boolean, True where a query may
    attend to a key; read as ``mask.backend == "sdpa"`` and ``mask.mask``."""

    backend = "sdpa"
    doc_ids = None

    def __init__(self, mask: torch.Tensor):
        self.mask = mask


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.mask, enable_gqa=gqa)


class ContextParallelAttention:
    """An attention function ``(q, k, v, mask) -> out`` on [B, H, S_local, D] tensors of a
    CP shard (k/v may have fewer heads: GQA) that attends to the whole sequence.

    It all-gathers k and v along the sequence over ``group`` (a process group or a 1-D
    DeviceMesh; default: the world), builds the causal mask "key position <= query position"
    in global positions of the load-balanced layout, and calls ``inner(q, k_all, v_all,
    key_mask)`` with a mask object whose ``backend`` is ``"sdpa"`` and whose ``mask`` is a
    boolean [S_local, S] tensor. ``inner`` defaults to plain SDPA; :func:`apply_context_parallel`
    passes the model's own attention function, so its dtype handling is kept.

    ``mask`` must be plain causal (``mask.backend == "causal"``): document masking is
    refused.

    Note: under selective activation checkpointing the model recomputes this function in
    backward, so the all-gather runs again there (each rank in the same order); the K/V of
    the whole sequence are not kept between forward and backward.
    """

    def __init__(self, group: Any = None, inner: AttendFn | None = None):
        self.group = _cp_group(group)
        self.cp = dist.get_world_size(self.group)
        self.cp_rank = dist.get_rank(self.group)
        self.inner = inner or _sdpa

    def __repr__(self) -> str:
        return f"ContextParallelAttention(cp={self.cp}, cp_rank={self.cp_rank})"

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any
    ) -> torch.Tensor:
        backend = getattr(mask, "backend", None)
        if backend != "causal":
            raise ParallelConfigError(
                f"context parallelism attends with a plain causal mask only, got an attention "
                f"mask with backend {backend!r} (document masking), which is not supported "
                "yet: train without doc_lens (data.document_mask=false) or with cp=1"
            )
        local = q.shape[2]
        if self.cp > 1 and local % 2:
            raise ParallelConfigError(
                f"a CP shard holds two equal chunks of the sequence, got {local} tokens; "
                "shard the inputs with shard_sequence"
            )
        k_all, v_all = self._gather(k, v)
        seq_len = local * self.cp
        query_pos = cp_indices(seq_len, self.cp, self.cp_rank, device=q.device)
        key_pos = _gathered_positions(seq_len, self.cp, q.device)
        key_mask = key_pos[None, :] <= query_pos[:, None]
        return self.inner(q, k_all, v_all, _KeyMask(key_mask))

    def _gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v of every rank, concatenated along the sequence in rank order."""
        if self.cp == 1:
            return k, v
        # one collective for both, gathered along dim 0: [S, 2, B, H, D]
        kv = torch.stack((k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)), dim=1)
        gathered = _ContiguousGrad.apply(_all_gather(kv, self.group))
        k_all, v_all = gathered.permute(1, 2, 3, 0, 4).unbind(0)
        return k_all, v_all


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    Note: the gradient reaching the gathered k/v comes through a permute and is strided;
    torch 2.9's gloo reduce-scatter (the all-gather's backward) refuses strided input
    ("Expected input.is_contiguous()"), where 2.13 copies it itself.
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Autograd-aware all-gather along dim 0: the backward reduce-scatters (sums)."""
    from torch.distributed import _functional_collectives as funcol

    # torch 2.13 deprecates all_gather_tensor_autograd for this name; older torch lacks it
    gather = getattr(funcol, "all_gather_single_autograd", None)
    if gather is None:
        gather = funcol.all_gather_tensor_autograd
    return gather(t.contiguous(), 0, group)  # waited for by the first op that reads it


def apply_context_parallel(model: nn.Module, group: Any = None) -> nn.Module:
    """Make every attention module of ``model`` attend across the ranks of ``group`` (a
    process group or a 1-D DeviceMesh, e.g. ``mesh["cp"]``; default: the world); in place.

    The model contract: each attention module calls its core attention through an
    attribute ``attend(q, k, v, mask)`` (as ``hlat_model``'s ``Attention`` does); it is
    replaced by a :class:`ContextParallelAttention` wrapping it. The model must then be fed
    this rank's shard of the sequence and its global positions (:func:`shard_sequence`,
    :func:`cp_indices`) and no document mask. Returns ``model``.
    """
    modules: list[Any] = [m for m in model.modules() if callable(getattr(m, "attend", None))]
    if not modules:
        raise ParallelConfigError(
            f"{type(model).__name__} has no module with an `attend` attribute (the core "
            "attention function that context parallelism replaces); give its attention "
            "modules `self.attend = <fn(q, k, v, mask)>` and call it in forward"
        )
    applied = [m for m in modules if isinstance(m.attend, ContextParallelAttention)]
    if applied:
        raise ParallelConfigError(
            f"context parallelism is already applied to {type(model).__name__} "
            f"({len(applied)} attention modules); apply it once"
        )
    pg = _cp_group(group)
    for module in modules:
        module.attend = ContextParallelAttention(pg, inner=module.attend)
    return model
