"""The chunked cross entropy against ``F.cross_entropy`` on the fp32 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hlat_model import cross_entropy_loss
from hlat_model import loss as loss_module


def _reference(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100):
    logits = logits.detach().clone().requires_grad_()
    value = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=ignore_index
    )
    value.backward()
    return value.detach(), logits.grad


def _ours(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100):
    logits = logits.detach().clone().requires_grad_()
    value = cross_entropy_loss(logits, labels, ignore_index=ignore_index)
    value.backward()
    return value.detach(), logits.grad


@pytest.fixture(params=["one chunk", "uneven chunks"])
def chunking(request, monkeypatch):
    if request.param == "uneven chunks":
        # 7 rows of 1000 fp32 logits per chunk: 30 rows make 4 full chunks and one of 2
        monkeypatch.setitem(loss_module.LOSS_CHUNK_BYTES, "cpu", 7 * 4 * 1000)
        assert loss_module._rows_per_chunk(torch.empty(1, 1000)) == 7
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_value_and_gradient_are_those_of_f_cross_entropy(kernels, chunking, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 10, 1000) * 4).to(dtype)
    labels = torch.randint(0, 1000, (3, 10))
    labels[0, :4] = -100
    labels[2, 7] = -100
    expected, expected_grad = _reference(logits, labels)
    value, grad = _ours(logits, labels)
    assert value.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)
    # fp32: the same math in another order; bf16/fp16: at most one rounding step apart
    # (both compute in fp32 and round once). Below the smallest normal number a rounding
    # step is absolute: fp16's subnormal spacing is 2**-24 (gradients of ~5e-6 here, where
    # the fp32 values of the two paths can fall on either side of a rounding midpoint,
    # depending on the CPU's vectorised exp).
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    info = torch.finfo(dtype)
    subnormal_step = info.smallest_normal * info.eps if dtype != torch.float32 else 1e-10
    error = (grad.float() - expected_grad.float()).abs()
    assert (error <= rtol * expected_grad.float().abs() + subnormal_step).all()
    assert grad[0, :4].abs().max() == 0  # ignored positions get no gradient


def test_scales_with_the_incoming_gradient_and_ignores_a_custom_index(kernels):
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 50, requires_grad=True)
    labels = torch.randint(0, 50, (2, 6))
    labels[1, 2] = 7
    (3.5 * cross_entropy_loss(logits, labels, ignore_index=7)).backward()
    reference = logits.detach().clone().requires_grad_()
    (3.5 * F.cross_entropy(reference.flatten(0, 1), labels.flatten(), ignore_index=7)).backward()
    torch.testing.assert_close(logits.grad, reference.grad, rtol=1e-5, atol=1e-8)


def test_non_contiguous_logits_and_unchanged_inputs():
    """Sequence-first models hand over transposed logits; fp32 logits are not changed."""
    torch.manual_seed(2)
    stored = torch.randn(9, 2, 40)  # [S, B, V]
    logits = stored.transpose(0, 1).requires_grad_()
    before = stored.clone()
    labels = torch.randint(0, 40, (2, 9))
    cross_entropy_loss(logits, labels).backward()
    assert torch.equal(stored, before)
    _, expected_grad = _reference(logits, labels)
    torch.testing.assert_close(logits.grad, expected_grad, rtol=1e-5, atol=1e-8)


def test_keeps_the_logits_and_one_number_per_row_for_backward(kernels, saved_for_backward):
    """What autograd keeps: the bf16 logits and row-sized tensors, no fp32 copy of the
    logits (``F.cross_entropy`` on ``logits.float()`` keeps an fp32 log-softmax)."""
    logits = torch.randn(4, 64, 512, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 512, (4, 64))
    with saved_for_backward() as saved:
        cross_entropy_loss(logits, labels)
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16
    assert sum(t.numel() for t in saved if t.numel() < logits.numel()) <= 4 * 4 * 64 + 1

    with saved_for_backward() as saved:
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    assert any(t.dtype == torch.float32 and t.numel() == logits.numel() for t in saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_positions_ignored_gives_nan_and_zero_gradients_as_f_cross_entropy_does(kernels, dtype):
    logits = torch.randn(1, 3, 8, dtype=dtype)
    labels = torch.full((1, 3), -100)
    value, grad = _ours(logits, labels)
    expected, expected_grad = _reference(logits, labels)
    assert value.isnan() and expected.isnan()
    assert grad.dtype == dtype and not expected_grad.any()  # zeros
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


def test_bad_labels_are_refused_before_any_work():
    logits = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"labels of shape \(2, 4\) do not match.*\(2, 5\)"):
        cross_entropy_loss(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"integer token ids, got torch\.float32"):
        cross_entropy_loss(logits, torch.zeros(2, 5))


def test_no_grad_evaluation(kernels):
    torch.manual_seed(3)
    logits = torch.randn(2, 5, 16)
    labels = torch.randint(0, 16, (2, 5))
    with torch.no_grad():
        value = cross_entropy_loss(logits, labels)
    torch.testing.assert_close(value, F.cross_entropy(logits.flatten(0, 1), labels.flatten()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernel_on_extreme_logits(dtype):
    """The CPU kernel's loss terms and gradient against ``F.cross_entropy`` in float64, with
    -inf logits (probability 0), logits far apart (exponentials that underflow) and an
    ignored row (a target outside the vocabulary: no one-hot, picked 0)."""
    from hlat_model import _native

    lib = _native.load()
    assert lib is not None, _native.unavailable_reason()
    torch.manual_seed(4)
    logits = (torch.randn(6, 300) * 4).to(dtype)
    logits[0, :50] = float("-inf")
    logits[1, 3] = 200.0
    logits[2] *= 30
    targets = torch.tensor([60, 3, 7, -1, 299, 0])
    lse, picked = _native.cross_entropy_forward(lib, logits, targets)
    wide = logits.double()
    assert torch.equal(picked[3], torch.tensor(0.0))
    torch.testing.assert_close(lse.double(), wide.logsumexp(-1), rtol=1e-6, atol=1e-6)
    counted = targets >= 0
    torch.testing.assert_close(picked[counted].double(), wide[counted, targets[counted]])
    scale = torch.tensor([0.5, 1.0, 2.0, 0.0, 1.0, 0.25])
    grad = _native.cross_entropy_backward(lib, logits, targets, lse, scale)
    expected = torch.softmax(wide, -1)
    expected[counted, targets[counted]] -= 1
    expected *= scale.double()[:, None]
    assert grad.dtype == dtype and grad[3].abs().max() == 0 and grad[0, :50].abs().max() == 0
    unit = 2**-8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(grad.double(), expected, rtol=unit, atol=unit * 1e-3)
    # the gradient in place of the logits, as the fused head uses it: the same loss terms,
    # and the same gradient up to a unit in the last place (scaled after the division)
    in_place = logits.clone()
    again = _native.cross_entropy_forward(lib, in_place, targets, scale)
    assert torch.equal(again[0], lse) and torch.equal(again[1], picked)
    assert in_place[3].abs().max() == 0 and in_place[0, :50].abs().max() == 0
    torch.testing.assert_close(in_place.double(), expected, rtol=unit, atol=unit * 1e-3)
    torch.testing.assert_close(
        in_place, grad, rtol=2 * unit if dtype == torch.bfloat16 else 1e-6, atol=1e-9
    )
    with pytest.raises(ValueError, match=r"contiguous fp32 vector of 6 rows, got torch.float64"):
        _native.cross_entropy_forward(lib, in_place, targets, scale.double())


def test_a_label_outside_the_vocabulary_is_refused(kernels):
    """Not taken for an ignored row: the fused kernel's path says which label, torch's
    operators refuse it as an index out of bounds."""
    logits = torch.randn(2, 4, 10, requires_grad=True)
    labels = torch.tensor([[1, 2, 3, 12], [0, 1, -100, 3]])
    error = ValueError if kernels == "native" else (RuntimeError, IndexError)
    with pytest.raises(error, match="12"):
        cross_entropy_loss(logits, labels)
