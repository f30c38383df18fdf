"""RMSNorm's own autograd function (plain tensors, op by op) against the composition it
replaces, ``weight * F.rms_norm(x.float()).to(x.dtype)``, which DTensors and compiled code
still take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hlat_model.model import RMSNorm


def _composed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_and_gradients_match_the_composition(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    x = (torch.randn(3, 40, 96) * 3).to(dtype)
    grad = torch.randn(3, 40, 96).to(dtype)
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    weight = norm.weight.detach().clone().requires_grad_()

    ours = norm(ours_x)
    theirs = _composed(theirs_x, weight, 1e-5)
    assert ours.dtype == dtype and ours.grad_fn is not None
    assert "RMSNormFunction" in type(ours.grad_fn).__name__
    assert torch.equal(ours, theirs)  # the same forward values, bit for bit
    ours.backward(grad)
    theirs.backward(grad)
    assert torch.equal(norm.weight.grad, weight.grad)
    # the input's gradient differs by rounding only: the same formula, another order
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, rtol=tolerance, atol=tolerance)


def test_an_fp32_input_is_left_unchanged():
    """``x.float()`` of an fp32 tensor is the tensor itself: nothing may scale it in place."""
    norm = RMSNorm(32)
    norm.reset_parameters()
    x = torch.randn(4, 32, requires_grad=True)
    before = x.detach().clone()
    norm(x).sum().backward()
    assert torch.equal(x.detach(), before)


def test_without_gradients_it_still_normalises():
    norm = RMSNorm(16).to(torch.bfloat16)
    norm.reset_parameters()
    x = torch.randn(2, 16).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm(x), _composed(x, norm.weight, norm.eps))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_what_backward_keeps(dtype):
    """bf16 keeps the input (backward recomputes the unrounded normalised input from it);
    fp32 keeps the normalised input, which is unrounded there, and not the input."""
    norm = RMSNorm(32).to(dtype)
    norm.reset_parameters()
    x = torch.randn(4, 32).to(dtype).requires_grad_()
    out = norm(x)  # held: its node's saved tensors live as long as it does
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    keeps_input = any(t.data_ptr() == x.data_ptr() for t in saved)
    assert keeps_input == (dtype == torch.bfloat16)
    assert len(saved) == (4 if dtype == torch.bfloat16 else 3)
