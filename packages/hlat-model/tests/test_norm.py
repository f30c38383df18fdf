"""RMSNorm's own autograd function (plain CPU tensors, op by op), through the fused CPU
kernel and through torch's operators, against float64 and against the composition it
replaces, ``weight * F.rms_norm(x.float()).to(x.dtype)``, which DTensors and compiled code
still take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hlat_model import _native
from hlat_model.model import RMSNorm


def _composed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _exact(x, weight, grad, eps):
    """The function in float64, the normalised input rounded to x's dtype as the module
    rounds it, and its exact gradients (the rounding's derivative taken as 1)."""
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    normed = F.rms_norm(x64, (x.shape[-1],), eps=eps)
    rounding = normed.detach().to(x.dtype).double() - normed.detach()
    out = (normed + rounding) * w64
    out.backward(grad.double())
    return out.detach(), x64.grad, w64.grad


def _error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return ((ours.double() - exact).norm() / exact.norm()).item()


def _inputs(dtype, rows=(3, 40), dim=96):
    weight = (torch.rand(dim) + 0.5).to(dtype)
    x = (torch.randn(*rows, dim) * 3).to(dtype)
    grad = torch.randn(*rows, dim).to(dtype)
    return x, weight, grad


@pytest.mark.parametrize("dim", [96, 100])  # whole vectors of 16, and a tail
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_as_accurate_as_the_composition(kernels, dtype, dim):
    """Output and both gradients: as close to float64 as the composition's (which rounds
    ``grad * weight`` to bf16 before using it), within one rounding of the dtype."""
    x, w, grad = _inputs(dtype, dim=dim)
    norm = RMSNorm(dim, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    weight = w.clone().requires_grad_()
    ours, theirs = norm(ours_x), _composed(theirs_x, weight, 1e-5)
    assert ours.dtype == dtype and "RMSNormFunction" in type(ours.grad_fn).__name__
    assert (ours.grad_fn.native is not None) == (kernels == "native")
    ours.backward(grad)
    theirs.backward(grad)
    exact = _exact(x, w, grad, 1e-5)
    unit = 2**-8 if dtype == torch.bfloat16 else 2**-23
    for what, a, b, e in zip(
        ("output", "input's gradient", "weight's gradient"),
        (ours, ours_x.grad, norm.weight.grad),
        (theirs, theirs_x.grad, weight.grad),
        exact,
        strict=True,
    ):
        assert a.dtype == dtype, what
        assert _error(a, e) <= _error(b, e) + unit, what
        torch.testing.assert_close(a.double(), e, rtol=4 * unit, atol=4 * unit * e.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_gives_the_same_numbers_for_any_thread_count(dtype):
    assert _native.load() is not None, _native.unavailable_reason()
    x, w, grad = _inputs(dtype, rows=(7, 33))
    norm = RMSNorm(96).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    results, threads = [], torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            norm.weight.grad = None
            xs = x.clone().requires_grad_()
            out = norm(xs)
            out.backward(grad)
            results.append((out, xs.grad, norm.weight.grad))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_non_finite_inputs_propagate(kernels):
    x = torch.randn(3, 32).to(torch.bfloat16)
    x[0, 3], x[1, 5] = float("nan"), float("inf")
    norm = RMSNorm(32).to(torch.bfloat16)
    norm.reset_parameters()
    out = norm(x)
    assert out[0].isnan().all() and not out[1].isfinite().all()
    assert out[2].isfinite().all()


def test_an_fp32_input_is_left_unchanged(kernels):
    """``x.float()`` of an fp32 tensor is the tensor itself: nothing may scale it in place."""
    norm = RMSNorm(32)
    norm.reset_parameters()
    x = torch.randn(4, 32, requires_grad=True)
    before = x.detach().clone()
    norm(x).sum().backward()  # an expanded (zero-stride) gradient
    assert torch.equal(x.detach(), before)


def test_without_gradients_it_still_normalises(kernels):
    norm = RMSNorm(16).to(torch.bfloat16)
    norm.reset_parameters()
    x = torch.randn(2, 16).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), _composed(x, norm.weight, norm.eps))


def test_a_non_contiguous_input_takes_torch_operators():
    x = torch.randn(16, 4).t()
    assert _native.usable(x) is None
    norm = RMSNorm(16)
    norm.reset_parameters()
    torch.testing.assert_close(norm(x), _composed(x, norm.weight, norm.eps))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_what_backward_keeps(kernels, dtype):
    """The kernel keeps the input, the weight and one fp32 scale per row (backward
    recomputes the normalised input from them). Torch's operators: bf16 keeps the input
    too (and the rounded normalised input); fp32 keeps the normalised input, which is
    unrounded there, and not the input."""
    norm = RMSNorm(32).to(dtype)
    norm.reset_parameters()
    x = torch.randn(4, 32).to(dtype).requires_grad_()
    out = norm(x)  # held: its node's saved tensors live as long as it does
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    keeps_input = any(t.data_ptr() == x.data_ptr() for t in saved)
    if kernels == "native":
        assert keeps_input and len(saved) == 3
        return
    assert keeps_input == (dtype == torch.bfloat16)
    assert len(saved) == (4 if dtype == torch.bfloat16 else 3)
