"""The fused split of q, k and v with RoPE against slicing, ``apply_rope`` and transposing."""

from __future__ import annotations

import pytest
import torch

from hlat_model.model import _HeadsWithRope, apply_rope, rope_cos_sin


def _composite(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    q_per_kv = qkv.shape[3] - 2
    q = qkv[:, :, :, :q_per_kv].flatten(2, 3)
    k, v = qkv[:, :, :, q_per_kv], qkv[:, :, :, q_per_kv + 1]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return tuple(t.transpose(1, 2) for t in (q, k, v))


def _inputs(dtype, q_per_kv: int, sequence_first: bool, head_dim: int = 16):
    torch.manual_seed(q_per_kv)
    batch, seq_len, groups = 2, 12, 2
    shape = (seq_len, batch) if sequence_first else (batch, seq_len)
    qkv = torch.randn(*shape, groups * (q_per_kv + 2) * head_dim, dtype=dtype)
    if sequence_first:
        qkv = qkv.transpose(0, 1)  # what a sequence-first block hands over
    qkv = qkv.unflatten(-1, (groups, q_per_kv + 2, head_dim))
    positions = torch.stack([torch.arange(seq_len), torch.arange(seq_len).flip(0)])
    cos, sin = rope_cos_sin(positions, head_dim, 10000.0)
    grads = [torch.randn(batch, n, seq_len, head_dim, dtype=dtype) for n in (groups * q_per_kv,)]
    grads += [torch.randn(batch, groups, seq_len, head_dim, dtype=dtype) for _ in range(2)]
    return qkv, cos, sin, grads


@pytest.mark.parametrize("head_dim", [16, 40])  # whole vectors of 8 pairs, and a tail
@pytest.mark.parametrize("sequence_first", [False, True])
@pytest.mark.parametrize("q_per_kv", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_and_gradient_match_the_composite_ops(
    kernels, dtype, q_per_kv, sequence_first, head_dim
):
    """The fused CPU kernel where it applies (a sequence-first block's qkv is not contiguous
    and takes torch's operators), torch's operators otherwise."""
    qkv, cos, sin, grads = _inputs(dtype, q_per_kv, sequence_first, head_dim)
    ours_in, ref_in = (qkv.detach().clone().requires_grad_() for _ in range(2))
    ours = _HeadsWithRope.apply(ours_in, cos, sin)
    ref = _composite(ref_in, cos, sin)
    assert (ours[0].grad_fn.native is not None) == (kernels == "native" and not sequence_first)
    torch.autograd.backward(ours, grads)
    torch.autograd.backward(ref, grads)
    # both compute in fp32 and round once; the fused path may contract a product and a sum
    # into one fused multiply-add, so bf16 results may differ in their last bit
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    for a, b in zip(ours, ref, strict=True):
        assert a.is_contiguous() and a.shape == b.shape
        torch.testing.assert_close(a, b, **tolerance)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, **tolerance)


def test_unused_outputs_get_zero_gradients(kernels):
    qkv, cos, sin, _ = _inputs(torch.float32, 2, False)
    qkv.requires_grad_()
    q = _HeadsWithRope.apply(qkv, cos, sin)[0]
    q.sum().backward()
    ref_in = qkv.detach().clone().requires_grad_()
    _composite(ref_in, cos, sin)[0].sum().backward()
    torch.testing.assert_close(qkv.grad, ref_in.grad, rtol=1e-6, atol=1e-6)
    assert qkv.grad[:, :, :, 2:].abs().max() == 0  # k and v parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_shared_by_the_batch(kernels, dtype):
    """Positions without documents give one [1, S, 1, D/2] table for every row."""
    qkv, _, _, grads = _inputs(dtype, 2, False)
    cos, sin = rope_cos_sin(torch.arange(qkv.shape[1])[None], qkv.shape[-1], 10000.0)
    assert cos.shape[0] == 1
    ours_in, ref_in = (qkv.detach().clone().requires_grad_() for _ in range(2))
    ours, ref = _HeadsWithRope.apply(ours_in, cos, sin), _composite(ref_in, cos, sin)
    assert (ours[0].grad_fn.native is not None) == (kernels == "native")
    torch.autograd.backward(ours, grads)
    torch.autograd.backward(ref, grads)
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    for a, b in zip((*ours, ours_in.grad), (*ref, ref_in.grad), strict=True):
        torch.testing.assert_close(a, b, **tolerance)


def test_which_tables_the_kernel_reads():
    from hlat_model import _native

    cos, sin = rope_cos_sin(torch.arange(12).expand(2, 12), 16, 10000.0)
    qkv = torch.Size([2, 12, 2, 3, 16])
    assert _native.rope_tables_usable(cos, sin, qkv)
    assert _native.rope_tables_usable(cos[:1], sin[:1], qkv)
    assert not _native.rope_tables_usable(cos, sin, torch.Size([3, 12, 2, 3, 16]))  # batch
    assert not _native.rope_tables_usable(cos, sin, torch.Size([2, 12, 2, 3, 32]))  # width
    assert not _native.rope_tables_usable(cos.double(), sin.double(), qkv)
    assert not _native.rope_tables_usable(cos, sin[..., :4], qkv)
    strided = torch.randn(2, 12, 1, 16)[..., ::2]
    assert not _native.rope_tables_usable(strided, strided, qkv)
