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
import os
from typing import Any

import torch
import torch.nn.functional as F

from hlat_model import _native
from hlat_model._compiled_ops import kernels_build
from hlat_model.linear import cpu_has_amx, cpu_has_native_bf16

_cpu_has_amx = functools.cache(cpu_has_amx)
"""hlat_model.linear.cpu_has_amx, asked once."""


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


def document_first_keys(doc_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, S] int64, contiguous: the first position of each token's document (the first key
    it attends to under document masking), what the flash kernels take for packed rows."""
    positions = torch.arange(seq_len, device=doc_lens.device)
    return (positions - document_positions(doc_lens, seq_len)).contiguous()


class AttentionMask:
    """What a layer needs to mask attention: nothing (plain causal) or packed documents.

    Built once per forward and shared by every layer, so the (possibly expensive) mask is
    made once per step.

    ``backend`` is the mask's form: ``causal`` (none), ``sdpa`` (a boolean [B, 1, S, S]
    tensor, True where a query may attend to a key) or ``flex`` (a flex block mask).
    ``kernel`` is what runs a ``causal`` or ``sdpa`` mask: ``sdpa`` or ``blocked``.
    ``flash``: ``auto`` chose on a CPU where one of the fused kernels' flash attention
    kernels runs (bf16 on AMX tiles or AVX512-BF16, fp32 on AVX-512 or AVX2), which then takes
    the attention it fits (:func:`blocked_causal_attention`) whatever ``kernel`` says: plain
    causal, or packed documents through ``first`` (:func:`document_first_keys`, set with
    ``flash`` for packed documents), the first key each query sees.

    Note: with packed documents the flash kernels skip the key blocks before each query
    block's document: the model step at this package's benchmark shape on rows of
    20-400-token documents ran 1.19x-1.22x (bf16) and 1.15x-1.16x (fp32) faster than with
    the blocked kernel and the block-diagonal mask, on a 2-core Zen 5 EPYC
    (``benchmarks/test_bench_train_step.py::test_document_masking_in_the_model_step``; the
    runs are in the package's BENCHMARKS.md).

    Note: forward + backward on a 2-core Intel Xeon with AMX
    (``benchmarks/test_bench_train_step.py::test_attention_kernels``, fastest of 9 rounds),
    the AMX attention against torch's flash kernel (hlat-model 0.20): 10.4 against 33.0 ms at
    4 x 8 heads x 512 x 64, 14.4 against 36.3 at 2 x 8 x 1,024 x 64, 24.4 against 55.4 at
    1 x 8 x 2,048 x 64 and 44.6 against 74.0 at 1 x 8 x 2,048 x 128. The fp32 flash kernel
    there (hlat-model 0.18, another day), against torch's fp32 flash kernel in the same
    rounds: 18.5 against 34.6 ms, 33.8 against 46.7, 63.6 against 75.1 and 123.3 against
    133.3 at those shapes.
    """

    def __init__(
        self,
        backend: str,
        doc_ids: torch.Tensor | None = None,
        mask: Any = None,
        kernel: str = "sdpa",
        flash: bool = False,
        first: torch.Tensor | None = None,
    ):
        self.backend = backend
        self.doc_ids = doc_ids
        self.mask = mask
        self.kernel = kernel
        self.flash = flash
        self.first = first

    @classmethod
    def build(
        cls, doc_lens: torch.Tensor | None, seq_len: int, backend: str, device: torch.device
    ) -> AttentionMask:
        """The mask of one forward; ``backend`` is ``LlamaConfig.attention`` (``auto``
        resolved by :func:`resolve_backend`)."""
        asked = backend
        backend = resolve_backend(
            backend, device.type, documents=doc_lens is not None, seq_len=seq_len
        )
        kernel = "blocked" if backend == "blocked" else "sdpa"
        flash = asked == "auto" and device.type == "cpu" and (_bf16_flash() or _f32_flash())
        if doc_lens is None:
            return cls("causal", kernel=kernel, flash=flash)
        doc_lens = doc_lens.to(device)
        doc_ids = document_ids(doc_lens, seq_len)
        if backend == "flex":
            return cls("flex", doc_ids, _flex_block_mask(doc_ids))
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        first = document_first_keys(doc_lens, seq_len) if flash else None
        return cls(
            "sdpa", doc_ids, (same_doc & causal).unsqueeze(1), kernel, flash=flash, first=first
        )

    @property
    def takes_flash(self) -> bool:
        """Whether a flash kernel takes this mask's attention where it fits: ``flash``, and
        plain causal or packed documents with their ``first`` keys."""
        return self.flash and (self.backend == "causal" or self.first is not None)


def resolve_backend(
    backend: str, device_type: str, documents: bool, seq_len: int | None = None
) -> str:
    """The attention backend that ``LlamaConfig.attention`` names on ``device_type``:
    ``auto`` is ``flex`` for packed documents on CUDA, ``sdpa`` on other accelerators, and
    on CPUs :func:`cpu_attention_rule` (``blocked``, or ``sdpa`` for long sequences on CPUs
    with AMX); any other name is itself."""
    if backend != "auto":
        return backend
    if device_type == "cpu":
        return cpu_attention_rule(_cpu_has_amx(), seq_len, documents)
    return "flex" if device_type == "cuda" and documents else "sdpa"


SDPA_FROM_TOKENS_WITH_AMX = 2048
"""Sequence length from which ``auto`` runs torch's flash kernel rather than the blocked one
on CPUs with AMX (plain causal attention).

Note: forward + backward on a 2-core Intel Xeon with AMX
(``benchmarks/test_bench_train_step.py::test_attention_kernels``, the fastest of 9 rounds),
the blocked kernel's time against the flash kernel's: in bf16 1.02x at 4 x 8 heads x 512 x
64, 1.07x at 2 x 8 x 1,024 x 64, 1.48x at 1 x 8 x 2,048 x 64 and 1.49x at 1 x 8 x 2,048 x
128 (0.81x, and 1.78x at the last shape, in an earlier run); in fp32 0.94x, 1.33x, 1.50x
and 1.12x. The flash kernel's tiles run on AMX there. On a 2-core AVX512-BF16 EPYC (no AMX)
the blocked kernel was 1.10x faster at 2,048 tokens with 128-wide heads in bf16 and 0.95x
in fp32 (:func:`blocked_causal_attention`), so CPUs without AMX keep it."""


def cpu_attention_rule(amx: bool, seq_len: int | None, documents: bool) -> str:
    """``auto``'s attention backend on a CPU: ``sdpa`` for plain causal attention over at
    least :data:`SDPA_FROM_TOKENS_WITH_AMX` tokens on a CPU with AMX tiles, else
    ``blocked`` (packed documents too: torch's flash kernel takes no document mask). Where
    the fused kernels' flash attention runs (bf16 on AMX tiles or AVX512-BF16, fp32 on
    AVX-512 or AVX2), ``auto`` takes it over either for the attention it fits, plain causal
    or packed documents (:attr:`AttentionMask.takes_flash`)."""
    long = seq_len is not None and seq_len >= SDPA_FROM_TOKENS_WITH_AMX
    return "sdpa" if amx and long and not documents else "blocked"


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
) -> torch.Tensor:
    """Scaled dot-product attention on [B, H, S, D] tensors; k/v may have fewer heads (GQA).

    Softmax statistics accumulate in fp32 in every kernel used here, also for bf16 inputs.
    ``mask.kernel == "blocked"`` runs :func:`blocked_causal_attention` on plain tensors,
    eager (one registered operator) or in compiled blocks (plain operators that inductor
    fuses, where the operator would keep its probabilities); tensor subclasses (DTensor) run
    SDPA.
    """
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not cpu_has_native_bf16():
        # Note: both CPU kernels multiply bf16 matrices (the flash kernel's backward, the
        # blocked kernel's products), emulated and slower than in fp32 on CPUs without bf16
        # instructions; on fp32 operands they accumulate in fp32 as a native kernel would.
        return attention(q.float(), k.float(), v.float(), mask).to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    if runs_flash_kernel(q, k, v, mask):
        return torch.ops.hlat.flash_causal_attention(q, k, v, mask.first)[0]
    if (
        getattr(mask, "kernel", "sdpa") == "blocked"
        and mask.backend in ("causal", "sdpa")
        and type(q) is torch.Tensor
    ):
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
    """A flex block mask of ``doc_ids`` [B, S]; one row (from ``doc_lens`` of one row) makes
    a mask of batch 1 that serves every batch row, as the other kernels' masks do."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq_len = doc_ids.shape
    if batch == 1:
        # flex_attention calls the mask with each batch row's index, not 0
        row = doc_ids[0]

        def same_document_causal(b, h, q_idx, kv_idx):
            return (row[q_idx] == row[kv_idx]) & (q_idx >= kv_idx)

    else:

        def same_document_causal(b, h, q_idx, kv_idx):
            return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(
        same_document_causal, batch, None, seq_len, seq_len, device=doc_ids.device
    )


KEEP_PROBABILITIES_BYTES = 256 * 2**20
"""Largest attention probabilities (bytes per call, in the inputs' dtype) that
:func:`blocked_causal_attention` keeps for backward; above it, backward recomputes them
block by block, so what a layer keeps for backward is linear in the sequence length (q, k
and v), as with flash kernels. Either way one block's scores ([B*H, block, S] at most)
exist at a time."""


def query_block(seq_len: int, dtype: torch.dtype | None = None) -> int:
    """Queries per block of :func:`blocked_causal_attention`: a multiple of 64, a
    sixteenth of the sequence, and at least 128 (a diagonal block computes its masked half
    too); twice that for bf16 on CPUs with AMX tiles (``dtype`` the inputs').

    Note: smaller blocks compute less of the masked half but make more, smaller products,
    each copying the key prefix it reads (a product copies a sliced operand), and more
    passes over the scores; which wins moves with the machine and the kernel. Forward and
    backward in bf16 (``benchmarks/test_bench_train_step.py::test_query_block_sizes``) on
    2-core AVX512-BF16 EPYCs: at 4 x 8 heads x 512 x 64, 41.1 ms with blocks of 64, 31.5
    ms with 128 and 58.1 ms with 32; at 1 x 8 x 2048 x 128, 127.3 ms with 128, 120.6 ms
    with 256 and 133.6 ms with 512. The kernel of hlat-model 0.11 (fp32 probabilities) ran
    44 ms with 64 against 46 ms with 128 on one such machine, 36.3 ms against 32.2 ms on
    another. On a 2-core Intel Xeon with AMX, whose bf16 products run about three times as
    fast, bf16 took 15.0 and 14.5 ms with blocks of 256 against 15.5 and 14.7 with 128 at
    4 x 8 x 512 x 64 (two runs), 20.8 and 22.7 against 24.0 and 25.0 at 2 x 8 x 1,024 x 64,
    and 60.8 and 52.9 against 72.1 and 65.4 at 1 x 8 x 2,048 x 128; fp32 took 21.4 ms with
    128 against 22.7 with 64 and 25.9 with 256 at 4 x 8 x 512 x 64, so it keeps 128.
    """
    block = max(128, -(-seq_len // 16 // 64) * 64)
    if dtype == torch.bfloat16 and _amx_cpu():
        block *= 2
    return block


def runs_flash_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
) -> bool:
    """Whether :func:`attention` runs one of the fused kernels' flash attention kernels on
    these [B, H, S, D] tensors as they are given (its one test for it): a kernel of their
    dtype and shape runs on this CPU, and either ``auto`` handed the mask's attention to it
    (``mask.takes_flash``) or the mask asks the blocked kernel for plain causal attention,
    which that kernel gives to the flash kernel (:func:`blocked_causal_attention`). bf16
    tensors that :func:`attention` converts to fp32 first (CPUs without bf16 instructions)
    are not run as they are.

    Such a kernel keeps for backward q, k and v, its output and each query's fp32
    log-sum-exp ([B * H, S]), nothing of the ``S x S`` scores; its output lies in memory as
    [B, S, H, D], the layout the output projection reads after the heads are merged, so
    the projection keeps that same tensor. Recomputing the kernel in backward (selective
    activation checkpointing) would free only the log-sum-exp."""
    # Note: other masks (context parallelism's) have no ``takes_flash``
    handed = getattr(mask, "takes_flash", False) or (
        getattr(mask, "kernel", "sdpa") == "blocked" and mask.backend == "causal"
    )
    return handed and _on_flash_kernel(q, k, v)


@torch.compiler.assume_constant_result
def _amx_cpu() -> bool:
    """:func:`cpu_has_amx` (through ``_cpu_has_amx``), a constant for ``torch.compile``."""
    return _cpu_has_amx()


def blocked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention on [B, H, S, D] tensors (k/v may have fewer heads: GQA), scale
    ``1/sqrt(D)``, as batched matrix products over blocks of :func:`query_block` queries,
    each block against the keys up to its own end, so the masked half of the scores is
    mostly never computed. ``allowed`` ([B, 1, S, S] boolean, True where a query may attend
    to a key, within the causal triangle) masks packed documents.

    Precision: scores come out of the product scaled and rounded to the inputs' dtype
    (fp32 accumulation inside it), as in Hugging Face's eager attention; the softmax is
    computed in fp32 and its probabilities rounded once to the inputs' dtype, which the
    products and the softmax's backward read; score gradients are computed in fp32 from
    those and rounded once; key and value gradients sum over blocks in fp32. In bf16 the
    output and gradients are as close to float64 as Hugging Face's eager attention's, which
    keeps fp32 probabilities for its softmax's backward (norm-wise, tested).
    Backward keeps the probabilities when they fit :data:`KEEP_PROBABILITIES_BYTES`, else
    recomputes them. Where they fit, code being compiled runs the same blocks as plain
    operators that inductor fuses (:func:`_composed`), but bf16 where the fused CPU kernels
    run (``hlat_model._compiled_ops.kernels_build``), which calls the operator. With those kernels
    (``hlat_model._native``, plain CPU tensors) the operator's softmax and the softmax's
    backward are theirs, in place, skipping the keys a causal row does not see, and bf16
    key and value gradients are added into their fp32 sums in one pass.

    On CPUs with AMX tiles or AVX512-BF16, plain causal bf16 attention whose sequence and
    head size are multiples of 32 runs the fused kernels' bf16 flash attention instead
    (:func:`bf16_flash_attention_reason`): flash style, blocks of 32 queries against 32 keys
    multiplied on the tiles or by AVX512-BF16 dot products, each query's
    log-sum-exp kept for backward (linear in the sequence) rather than the probabilities;
    the same roundings (probabilities and score gradients rounded to bf16 for the products
    that read them), but scores kept in fp32. On CPUs with AVX-512 or AVX2, plain causal
    fp32 attention of such shapes runs their fp32 flash kernel
    (:func:`fp32_flash_attention_reason`), the same scheme in fp32 throughout, its products
    register blocks of fused multiply-adds. Both flash kernels read grouped key and value
    heads for all their query heads without copies, and sum their gradients over those in
    fp32 (bf16: rounded once); elsewhere they are repeated for each query head, and autograd
    sums their gradients in the inputs' dtype.

    Note: on CPUs torch's flash kernel runs its products in small tiles; with these larger
    products forward + backward ran 1.61x faster in bf16 and 1.51x in fp32 at 4 x 8 heads x
    512 x 64, 1.10x faster in bf16 and 0.95x (slower) in fp32 at 1 x 8 x 2048 x 128, on a
    2-core AVX512-BF16 EPYC (``benchmarks/test_bench_train_step.py::
    test_attention_kernels``; hlat-model 0.11's kernel, on another such machine: 1.75x,
    1.63x, 1.30x, 1.09x).
    """
    if allowed is None and _on_flash_kernel(q, k, v):
        return torch.ops.hlat.flash_causal_attention(q, k, v)[0]
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    rows, seq_len = q.shape[0] * q.shape[1], q.shape[2]
    # Note: the block is an argument of the operator, so a compiled graph (and inductor's
    # cache of it) holds the size its kept probabilities were laid out with.
    block = query_block(seq_len, q.dtype)
    # Note: bf16 compiled blocks call the operator (with the kernels' softmax) rather than
    # the composed operators where the kernels run: on a 2-core Intel Xeon with AMX, 8 layers
    # of width 512 at 4 x 512 tokens, compiled blocks ran 3,979 and 3,912 tokens/s that way
    # against 3,620 and 3,574 composed (``benchmarks/test_bench_train_step.py::
    # test_compiled_blocks_against_eager``, two pairs of runs). In fp32 the composed
    # operators ran 1,596 tokens/s against 1,527, so fp32 keeps them.
    if (
        torch.compiler.is_compiling()
        and _kept_sizes(rows, seq_len, block, q.dtype)
        and not (q.dtype == torch.bfloat16 and kernels_build())
    ):
        return _composed(q, k, v, allowed, block)
    return torch.ops.hlat.blocked_causal_attention(q, k, v, allowed, block)[0]


def _composed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    block: int,
) -> torch.Tensor:
    """:func:`blocked_causal_attention` as plain differentiable operators, for code being
    compiled: the same blocks and products, the same precision (scores rounded to the
    inputs' dtype out of the product; a softmax computed in fp32, its probabilities rounded
    to the inputs' dtype for the product and its backward), backward derived by autograd.
    Inductor fuses the scale, the mask, the softmax and its backward, and the sums of the
    key and value gradients over blocks into a few kernels between the products, where the
    operator makes a pass over memory for each. It runs only where the operator would keep
    its probabilities (:data:`KEEP_PROBABILITIES_BYTES`); what backward keeps is the
    compiler's choice: at 4 x 8 heads x 512 x 64 in bf16, 16.0 MiB, what the operator keeps
    (tested to stay within 1.5x of it).

    Note: measured on a 2-core AVX512-BF16 CPU, 8 layers of width 512 at 4 x 512 bf16
    tokens, with blocks of 64 and fp32 probabilities kept (hlat-model 0.11), compiled
    blocks ran at 0.871 and 0.875 of the model's matrix-product ceiling this way, against
    0.863 and 0.864 calling the operator
    (``benchmarks/test_bench_train_step.py::test_compiled_blocks_against_eager``, runs
    alternating)."""
    batch, heads, seq_len, head_dim = q.shape
    qf, kf, vf = (t.reshape(batch * heads, seq_len, head_dim) for t in (q, k, v))
    rows = []
    for start, end in _blocks(seq_len, block):
        scores = torch.bmm(qf[:, start:end], kf[:, :end].transpose(1, 2))
        query = torch.arange(start, end, device=q.device)[:, None]
        keep = torch.arange(end, device=q.device) <= query
        if allowed is not None:
            in_document = allowed[:, :, start:end, :end].expand(batch, heads, -1, -1)
            keep = keep & in_document.reshape(batch * heads, end - start, end)
        scores = scores.mul(head_dim**-0.5).masked_fill(~keep, float("-inf"))
        # Note: inductor computes a bf16 softmax (and its backward) in fp32 and rounds once.
        probs = torch.softmax(scores, dim=-1)
        rows.append(torch.bmm(probs, vf[:, :end]))
    return torch.cat(rows, dim=1).view(q.shape)


def _probabilities(
    q: torch.Tensor,
    k_t: torch.Tensor | None,
    start: int,
    end: int,
    scale: float,
    masked: torch.Tensor | None,
    heads: int,
    causal: torch.Tensor | None,
    out: torch.Tensor | None = None,
    lib: Any = None,
    k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax of the scores of queries ``start:end`` against keys ``:end``, computed in
    fp32 and rounded once to q's dtype (written into ``out`` when given); q is [B*H, S, D],
    ``k_t`` the keys transposed, [B*H, D, S] (its slices are rows, which the product copies
    fast; slices of the untransposed keys copied 3x slower). ``masked`` is the negated
    ``allowed`` mask (True where masked), or None for plain causal, which adds
    :func:`_causal_bias` ``causal`` in the product, or with the fused CPU kernels (``lib``)
    masks inside their softmax, where ``k_t`` may be None: then it reads the untransposed
    keys ``k`` [B*H, S, D] (:func:`_prefix`)."""
    rows = end - start
    if masked is None and lib is not None:
        assert k is not None
        # Note: the scaled scores straight into the kept buffer, then the kernel's softmax in
        # place, which skips each row's masked keys: no mask pass, no second buffer.
        scores = out if out is not None else q.new_empty(q.shape[0], rows, end)
        zero = q.new_zeros(()).expand(scores.shape)
        keys_t = k_t[:, :, :end] if k_t is not None else _prefix(k, end).transpose(1, 2)
        torch.baddbmm(zero, q[:, start:end], keys_t, beta=0, alpha=scale, out=scores)
        return _native.attention_softmax(lib, scores, start)
    assert k_t is not None
    if masked is None:
        assert causal is not None
        # Note: the mask as an addend of the product (0 or -inf) rather than a fill of the
        # diagonal block after it: scores and mask in one pass.
        seq_len = q.shape[1]
        bias = causal[:rows, seq_len - start : seq_len + rows].expand(q.shape[0], rows, end)
        scores = torch.baddbmm(bias, q[:, start:end], k_t[:, :, :end], alpha=scale)
    else:
        scores = torch.baddbmm(
            q.new_zeros(()).expand(q.shape[0], rows, end),
            q[:, start:end],
            k_t[:, :, :end],
            beta=0,
            alpha=scale,
        )
        by_head = scores.unflatten(0, (-1, heads))
        by_head.masked_fill_(masked[:, :, start:end, :end], float("-inf"))
    # Note: torch's CPU softmax computes in fp32 for bf16 and rounds its result once: the
    # numbers of an fp32 softmax rounded to bf16, without the two conversions (tested).
    if out is None:
        return torch.softmax(scores, dim=-1)
    return torch.ops.aten._softmax.out(scores, -1, False, out=out)


def _prefix(t: torch.Tensor, end: int) -> torch.Tensor:
    """Rows ``:end`` of each batch of ``t`` [B*H, S, D], contiguous (``t`` itself for all of
    them), so that its transpose is an operand a bf16 product reads without a copy.

    Note: a bf16 product (oneDNN's) copies an operand that is neither contiguous nor a
    contiguous tensor transposed; copying the transposed keys (``k.transpose(1, 2)
    .contiguous()``) is a strided transpose, on a 2-core Xeon with AMX about 0.5 ms for bf16
    [32, 512, 64], so with the fused kernels bf16 keeps keys and values as they are and
    copies only the prefixes of the blocks before the last. fp32 (MKL's products, which
    read strided operands) keeps the transposed copy."""
    return t if end == t.shape[1] else t[:, :end].contiguous()


def _causal_bias(q: torch.Tensor, allowed: torch.Tensor | None, block: int) -> torch.Tensor | None:
    """For plain causal attention (``allowed`` None), the causal mask of every query block
    as one [block, S + block] tensor of q's dtype: zeros, then a block whose entries above
    the diagonal are -inf. Block ``start:end`` adds its columns
    ``S - start : S + end - start``: 0 for keys up to each query, -inf after it."""
    if allowed is not None:
        return None
    seq_len = q.shape[2]
    block = min(block, seq_len)
    bias = q.new_zeros(block, seq_len + block)
    above = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
    bias[:, seq_len:].masked_fill_(above, float("-inf"))
    return bias


def _blocks(seq_len: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, seq_len)) for start in range(0, seq_len, block)]


def _kept_sizes(rows: int, seq_len: int, block: int, dtype: torch.dtype) -> list[int]:
    """Elements of each block's kept probabilities for ``rows`` = B*H, of ``dtype``, or
    none when they exceed :data:`KEEP_PROBABILITIES_BYTES` (backward recomputes them)."""
    sizes = [rows * (end - start) * end for start, end in _blocks(seq_len, block)]
    return sizes if dtype.itemsize * sum(sizes) <= KEEP_PROBABILITIES_BYTES else []


def _per_block(
    kept: torch.Tensor, rows: int, seq_len: int, block: int
) -> list[torch.Tensor | None]:
    """Each block's [B*H, block, end] view of the flat kept probabilities (None for every
    block when they were not kept)."""
    blocks = _blocks(seq_len, block)
    if kept.numel() == 0:
        return [None] * len(blocks)
    pieces = kept.split(_kept_sizes(rows, seq_len, block, kept.dtype))
    return [p.view(rows, end - start, end) for p, (start, end) in zip(pieces, blocks, strict=True)]


# Note: a registered operator, not an autograd Function, so where compiled code calls it
# (probabilities too large to keep: backward recomputes them) torch.compile keeps it as one
# opaque call inside a compiled block (a graph break there split a tensor-parallel block
# into graphs whose collectives lost their process group, torch 2.13); inductor fuses the
# rest of the block around it.
@torch.library.custom_op(
    "hlat::blocked_causal_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? allowed, int block) -> (Tensor, Tensor)",
)
def _blocked_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output, the kept probabilities of all blocks flat, in q's dtype: empty when
    recomputed) for query blocks of ``block`` rows; q, k and v have the same number of
    heads."""
    batch, heads, seq_len, head_dim = q.shape
    qf, kf, vf = (t.reshape(batch * heads, seq_len, head_dim) for t in (q, k, v))
    masked = None if allowed is None else ~allowed
    scale = head_dim**-0.5
    sizes = _kept_sizes(qf.shape[0], seq_len, block, q.dtype)
    kept = q.new_empty(sum(sizes))
    into = _per_block(kept, qf.shape[0], seq_len, block)
    lib = _native.usable(qf, kf, vf)
    # the keys transposed, unless the fused kernels' bf16 products read them as they are
    untransposed = lib is not None and allowed is None and q.dtype == torch.bfloat16
    k_t = None if untransposed else kf.transpose(1, 2).contiguous()
    causal = None if lib is not None else _causal_bias(q, allowed, block)
    # Note: the output is laid out [B, S, H, D] (returned as a [B, H, S, D] view), so the
    # output projection reads it without a copy; each block is written in place.
    out = q.new_empty(batch, seq_len, heads, head_dim)
    for n, (start, end) in enumerate(_blocks(seq_len, block)):
        probs = _probabilities(qf, k_t, start, end, scale, masked, heads, causal, into[n], lib, kf)
        rows = torch.bmm(probs, vf[:, :end])
        out[:, start:end].copy_(rows.view(batch, heads, end - start, head_dim).transpose(1, 2))
    return out.transpose(1, 2), kept


@_blocked_forward.register_fake
def _(q, k, v, allowed, block):
    batch, heads, seq_len, head_dim = q.shape
    kept = q.new_empty(sum(_kept_sizes(batch * heads, seq_len, block, q.dtype)))
    return q.new_empty(batch, seq_len, heads, head_dim).transpose(1, 2), kept


@torch.library.custom_op(
    "hlat::blocked_causal_attention_backward",
    mutates_args=(),
    schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? allowed, Tensor kept, int block)"
    " -> (Tensor, Tensor, Tensor)",
)
def _blocked_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    kept: torch.Tensor,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, seq_len, head_dim = q.shape
    qf, kf, vf = (t.reshape(batch * heads, seq_len, head_dim) for t in (q, k, v))
    masked = None if allowed is None else ~allowed
    scale = head_dim**-0.5
    kept_blocks = _per_block(kept, qf.shape[0], seq_len, block)
    lib = _native.usable(qf, kf, vf, kept)
    # bf16 with the fused kernels: products read keys and values as they are (_prefix), and
    # the kernel adds the blocks' key and value gradients into their fp32 sums
    bf16_fused = lib is not None and q.dtype == torch.bfloat16
    recompute = kept.numel() == 0
    k_t = None
    if recompute and not (bf16_fused and allowed is None):
        k_t = kf.transpose(1, 2).contiguous()
    v_t = None if bf16_fused else vf.transpose(1, 2).contiguous()
    causal = _causal_bias(q, allowed, block) if recompute and lib is None else None
    # Note: key and value gradients sum over query blocks in fp32, as flash kernels do. The
    # blocks go last to first: the last one sees every key, so its products start the sums
    # (no zero-filled sums to add them into).
    dk = dv = torch.empty(0)
    dqs = []
    blocks = list(zip(_blocks(seq_len, block), kept_blocks, strict=True))
    for (start, end), probs in reversed(blocks):
        if probs is None:
            probs = _probabilities(qf, k_t, start, end, scale, masked, heads, causal, None, lib, kf)
        # one copy of the block's rows, which both products below read
        rows = grad[:, :, start:end].reshape(batch * heads, end - start, head_dim)
        dv_block = torch.bmm(probs.transpose(1, 2), rows)
        if end == seq_len:  # the last block: every key
            dv = dv_block.float()
        else:
            _accumulate(dv[:, :end], dv_block, lib if bf16_fused else None)
        # the scale goes into the product: d scores = scale * softmax'(d probs)
        dprobs = torch.baddbmm(
            rows.new_zeros(()).expand(rows.shape[0], end - start, end),
            rows,
            _prefix(vf, end).transpose(1, 2) if v_t is None else v_t[:, :, :end],
            beta=0,
            alpha=scale,
        )
        if lib is not None:  # in place, skipping the keys each causal row does not see
            first = start if masked is None else -1
            dscores = _native.attention_softmax_backward(lib, dprobs, probs, first)
        else:
            # Note: torch's CPU kernel computes in fp32 for bf16 operands and rounds once.
            dscores = torch.ops.aten._softmax_backward_data(dprobs, probs, -1, probs.dtype)
        dqs.append(torch.bmm(dscores, kf[:, :end]))
        dk_block = torch.bmm(dscores.transpose(1, 2), qf[:, start:end])
        if end == seq_len:
            dk = dk_block.float()
        else:
            _accumulate(dk[:, :end], dk_block, lib if bf16_fused else None)
    dq = torch.cat(dqs[::-1], dim=1).view(q.shape)
    return dq, dk.to(kf.dtype).view(q.shape), dv.to(vf.dtype).view(q.shape)


def _accumulate(acc: torch.Tensor, x: torch.Tensor, lib: Any) -> None:
    """``acc += x`` into an fp32 sum; with the fused CPU kernels (``lib``) a bf16 ``x`` is
    added in one pass, where ``add_`` first makes an fp32 copy of it."""
    if lib is None:
        acc.add_(x)
    else:
        _native.add_bf16_into_fp32(lib, acc, x)


@_blocked_backward.register_fake
def _(grad, q, k, v, allowed, kept, block):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, allowed, ctx.block = inputs
    ctx.save_for_backward(q, k, v, allowed, output[1])
    # no zero-filled gradient for the kept probabilities (as large as they are)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _attention_backward(ctx: Any, grad: torch.Tensor, _kept_grad: Any) -> tuple[Any, ...]:
    q, k, v, allowed, kept = ctx.saved_tensors
    dq, dk, dv = torch.ops.hlat.blocked_causal_attention_backward(
        grad, q, k, v, allowed, kept, ctx.block
    )
    return dq, dk, dv, None, None


torch.library.register_autograd(
    "hlat::blocked_causal_attention", _attention_backward, setup_context=_save_for_backward
)


FLASH_BLOCK = 32
"""Sequence lengths and head sizes the flash attention kernels take are multiples of this."""
AMX_BLOCK = FLASH_BLOCK
"""The same (its name in 0.17)."""

_FLASH_OFF = "turned off by HLAT_MODEL_FLASH_ATTENTION=0"


def _flash_kernels() -> tuple[Any, str | None]:
    """(the fused CPU kernels' library, None) where the flash kernels may run, else (None,
    why not: turned off, or no kernels)."""
    if os.environ.get("HLAT_MODEL_FLASH_ATTENTION", "1") == "0":
        return None, _FLASH_OFF
    lib = _native.load()
    if lib is None:
        return None, f"no fused CPU kernels ({_native.unavailable_reason()})"
    return lib, None


def amx_attention_reason() -> str | None:
    """``None`` where causal bf16 attention (plain, or of packed documents under ``auto``)
    runs on this CPU's AMX tiles (the fused CPU kernels' bf16 flash-style kernel,
    :func:`blocked_causal_attention`), else why not (``HLAT_MODEL_AMX_ATTENTION=0`` turns
    the tiles off: the kernel then runs by AVX512-BF16 dot products,
    :func:`bf16_flash_attention_reason`)."""
    lib, why = _flash_kernels()
    if lib is None:
        return why
    if os.environ.get("HLAT_MODEL_AMX_ATTENTION", "1") == "0":
        return "turned off by HLAT_MODEL_AMX_ATTENTION=0"
    if not _native.amx_attention_ready(lib):
        if not _cpu_has_amx():
            return "this CPU has no AMX tiles"
        return "the kernels were built without AMX, or the OS refused the tiles"
    return None


def bf16_flash_attention_reason() -> str | None:
    """``None`` where causal bf16 attention (plain, or of packed documents under ``auto``)
    runs the fused CPU kernels' bf16 flash-style kernel (:func:`blocked_causal_attention`):
    on AMX tiles where :func:`amx_attention_reason` says yes, else by AVX512-BF16 dot
    products where the kernels were built for them (AMD's Zen 4 and later, Intel's
    AVX512-BF16 CPUs); else why not. Where bf16 products are emulated
    (:func:`hlat_model.linear.cpu_bf16_reason`: no AMX tiles nor AVX512-BF16, or oneDNN held
    below them), bf16 attention runs on fp32 copies and this says so."""
    lib, why = _flash_kernels()
    if lib is None:
        return why
    if not cpu_has_native_bf16():
        return (
            "bf16 products are emulated here (neither AMX tiles nor AVX512-BF16, or oneDNN "
            "held below them): bf16 attention runs in fp32"
        )
    if amx_attention_reason() is None:
        return None
    if not _native.bf16_attention_ready(lib):
        return "the kernels were built without AVX512-BF16 (the compiler's target, -march=native)"
    return None


def fp32_flash_attention_reason() -> str | None:
    """``None`` where causal fp32 attention (plain, or of packed documents under ``auto``)
    runs the fused CPU kernels' fp32 flash kernel (AVX-512F, or AVX2 with FMA;
    :func:`blocked_causal_attention`), else why not."""
    lib, why = _flash_kernels()
    if lib is None:
        return why
    if not _native.f32_attention_ready(lib):
        return (
            "the kernels were built without AVX-512F or AVX2 with FMA (the compiler's target, "
            "-march=native)"
        )
    return None


@torch.compiler.assume_constant_result
def _amx_attention() -> bool:
    """Whether :func:`amx_attention_reason` says yes, a constant for ``torch.compile``."""
    return amx_attention_reason() is None


@torch.compiler.assume_constant_result
def _bf16_flash() -> bool:
    """Whether :func:`bf16_flash_attention_reason` says yes, a constant for
    ``torch.compile``."""
    return bf16_flash_attention_reason() is None


@torch.compiler.assume_constant_result
def _f32_flash() -> bool:
    """Whether :func:`fp32_flash_attention_reason` says yes, a constant for
    ``torch.compile``."""
    return fp32_flash_attention_reason() is None


def _on_flash_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether causal attention of these [B, H, S, D] tensors (as many heads each) runs a
    flash kernel: plain CPU tensors, S and D multiples of :data:`FLASH_BLOCK`, bf16 where
    :func:`bf16_flash_attention_reason` says yes or fp32 where
    :func:`fp32_flash_attention_reason` does."""
    if not (
        q.dtype == k.dtype == v.dtype
        and q.device.type == "cpu"
        and all(type(t) is torch.Tensor for t in (q, k, v))
        and q.shape[2] % FLASH_BLOCK == 0
        and q.shape[3] % FLASH_BLOCK == 0
    ):
        return False
    if q.dtype == torch.bfloat16:
        return _bf16_flash()
    return q.dtype == torch.float32 and _f32_flash()


# Note: a registered operator, as the blocked one, so compiled blocks keep it as one call.
@torch.library.custom_op(
    "hlat::flash_causal_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? first=None) -> (Tensor, Tensor)",
)
def _flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output, a [B, H, S, D] view of a [B, S, H, D] tensor; each query's fp32
    log-sum-exp [B*H, S]); with ``first`` ([B, S] int64, :func:`document_first_keys`),
    attention within packed documents."""
    lib = _native.load()
    assert lib is not None
    return _native.flash_attention_forward(
        lib, q.contiguous(), k.contiguous(), v.contiguous(), tiles=_amx_attention(),
        first=_first(first, q.shape[0]),
    )  # fmt: skip


def _first(first: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """The first keys as the kernels read them: int64, contiguous, one row per batch row (a
    single row, from ``doc_lens`` of one row, serves every batch row, as its mask would)."""
    if first is None:
        return None
    if first.shape[0] == 1 and batch > 1:
        first = first.expand(batch, -1)
    return first.to(torch.int64).contiguous()


@_flash_forward.register_fake
def _(q, k, v, first=None):
    batch, heads, seq_len, head_dim = q.shape
    out = q.new_empty(batch, seq_len, heads, head_dim).transpose(1, 2)
    return out, q.new_empty(batch * heads, seq_len, dtype=torch.float32)


@torch.library.custom_op(
    "hlat::flash_causal_attention_backward",
    mutates_args=(),
    schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,"
    " Tensor? first=None) -> (Tensor, Tensor, Tensor)",
)
def _flash_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    first: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lib = _native.load()
    assert lib is not None
    return _native.flash_attention_backward(
        lib, grad, q.contiguous(), k.contiguous(), v.contiguous(), out, lse.contiguous(),
        tiles=_amx_attention(), first=_first(first, q.shape[0]),
    )  # fmt: skip


@_flash_backward.register_fake
def _(grad, q, k, v, out, lse, first=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_save_for_backward(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs, *output)  # first may be None
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _flash_attention_backward(ctx: Any, grad: torch.Tensor, _lse_grad: Any) -> tuple[Any, ...]:
    q, k, v, first, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.hlat.flash_causal_attention_backward(grad, q, k, v, out, lse, first)
    return dq, dk, dv, None


torch.library.register_autograd(
    "hlat::flash_causal_attention",
    _flash_attention_backward,
    setup_context=_flash_save_for_backward,
)


def rope_flash_attention_fits(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask
) -> bool:
    """Whether :func:`rope_flash_attention` takes the attention of this fused product ``qkv``
    [B, S, G, P, D] (G groups of P - 2 query heads, a key and a value head) with these RoPE
    tables and mask: plain causal attention or packed documents that ``auto`` gave the flash
    kernels (``mask.takes_flash``), bf16 on a CPU whose bf16 flash attention runs
    (:func:`bf16_flash_attention_reason`), S and D multiples of :data:`FLASH_BLOCK`, a plain
    CPU tensor computed op by op outside autocast, dense over its last three dimensions
    (batch-first or sequence-first), and tables the kernel reads
    (``hlat_model._native.rope_tables_usable``)."""
    if qkv.dim() != 5:
        return False
    per_head, head_dim = qkv.shape[3:]
    return (
        getattr(mask, "takes_flash", False)
        and per_head >= 3
        and qkv.dtype == torch.bfloat16
        and type(qkv) is torch.Tensor
        and qkv.device.type == "cpu"
        and qkv.stride()[2:] == (per_head * head_dim, head_dim, 1)
        and qkv.shape[1] % FLASH_BLOCK == 0
        and head_dim % FLASH_BLOCK == 0
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")
        and _bf16_flash()
        and _native.rope_tables_usable(cos, sin, qkv.shape)
    )


class _RopeFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        first: torch.Tensor | None,
    ) -> Any:
        lib = _native.load()
        assert lib is not None
        tiles = _amx_attention()
        first = _first(first, qkv.shape[0])
        out, lse = _native.rope_attention_forward(lib, qkv, cos, sin, tiles=tiles, first=first)
        ctx.save_for_backward(qkv, cos, sin, out, lse, first)
        ctx.lib, ctx.tiles = lib, tiles
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        qkv, cos, sin, out, lse, first = ctx.saved_tensors
        grad_qkv = _native.rope_attention_backward(
            ctx.lib, grad, qkv, cos, sin, out, lse, tiles=ctx.tiles, first=first
        )
        return grad_qkv, None, None, None


def rope_flash_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, first: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of the heads of the fused product ``qkv`` [B, S, G, P, D] (G groups
    of P - 2 query heads sharing a key and a value head), within packed documents with
    ``first`` (:func:`document_first_keys`), RoPE (``cos``, ``sin`` as
    :func:`hlat_model.model.rope_cos_sin` makes them) applied to q and k: what splitting the
    heads with RoPE (``hlat_model.model._HeadsWithRope``) and then
    :func:`blocked_causal_attention` compute, in one kernel (the bf16 flash kernel, on AMX
    tiles or AVX512-BF16 dot products) that reads q, k and v where the product left them,
    rotating q and k as it reads them, and writes the gradient into ``qkv``'s layout
    directly: no [B, H, S, D] copies of q, k and v forward, nor of their gradients backward,
    and with grouped heads no copies of k and v for each query head. Returns [B, H, S, D] (a
    view of a [B, S, H, D] tensor). Only where :func:`rope_flash_attention_fits` says so.

    Precision: the forward's numbers are those of the two steps (q and k rotated in fp32 and
    rounded once, then the flash kernel). Backward rotates the q and k gradients back from
    their fp32 sums and rounds them once, where the two steps round the sums and then the
    rotation; with grouped heads it sums a group's key and value gradients over its query
    heads in fp32 and rounds them once, where the two steps round each head's and then
    their sum: at least as close to float64 (tested).

    Note: measured on a 2-core Intel Xeon with AMX, bf16, the benchmark model's attention
    (4 x 512 tokens, 8 heads of 64, one layer's forward and backward): see
    ``benchmarks/test_bench_train_step.py::test_rope_attention_against_heads_and_flash`` and
    ``::test_rope_attention_in_the_model_step``."""
    return _RopeFlashAttention.apply(qkv, cos, sin, first)
