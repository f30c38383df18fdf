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


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_and_norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_gives_the_same_numbers_for_any_thread_count(dtype, residual):
    """The norm alone, and with ``residual`` the fused add and norm (``add_forward``)."""
    assert _native.load() is not None, _native.unavailable_reason()
    x, w, grad = _inputs(dtype, rows=(7, 33))
    delta = torch.randn_like(x.float()).to(dtype)
    norm = RMSNorm(96).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    results, threads = [], torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            norm.weight.grad = None
            xs = x.clone().requires_grad_()
            outs = norm.add_forward(xs, delta) if residual else (norm(xs),)
            torch.autograd.backward(list(outs), [grad] * len(outs))
            results.append((*outs, xs.grad, norm.weight.grad))
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


def _exact_add_norm(x, delta, weight, grad_total, grad_out, eps):
    """The exact gradients of x (delta's is the same) and of the weight for
    ``(x + delta, norm(x + delta))``, computed in float64 after the sum's rounding to x's
    dtype."""
    total = (x.double() + delta.double()).to(x.dtype)
    t64 = total.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    normed = F.rms_norm(t64, (x.shape[-1],), eps=eps)
    rounding = normed.detach().to(x.dtype).double() - normed.detach()
    out = (normed + rounding) * w64
    torch.autograd.backward([t64, out], [grad_total.double(), grad_out.double()])
    return t64.grad, w64.grad


@pytest.mark.parametrize("dim", [96, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_residual_add_and_norm(kernels, dtype, dim):
    """``add_forward``: the sum and its norm are the add's and the module's numbers exactly;
    the inputs' gradient (one tensor for both, as an add gives) and the weight's are as
    close to float64 as the composition's within one rounding of the dtype (the fused
    backward rounds the norm's gradient plus the residual's once, the composition twice)."""
    x, w, grad_out = _inputs(dtype, dim=dim)
    delta, grad_total = (torch.randn_like(x.float()) * 2).to(dtype), torch.randn_like(grad_out)
    norm = RMSNorm(dim, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    xs, ds = x.clone().requires_grad_(), delta.clone().requires_grad_()
    total, normed = norm.add_forward(xs, ds)
    fused = type(normed.grad_fn).__name__ == "_AddRMSNormFunctionBackward"
    assert fused == (kernels == "native") and total.grad_fn is not None
    torch.autograd.backward([total, normed], [grad_total, grad_out])
    ours_w = norm.weight.grad
    norm.weight.grad = None
    xt, dt = x.clone().requires_grad_(), delta.clone().requires_grad_()
    their_total = xt + dt
    theirs = norm(their_total)
    assert torch.equal(total, their_total) and torch.equal(normed, theirs)
    torch.autograd.backward([their_total, theirs], [grad_total, grad_out])
    assert torch.equal(xs.grad, ds.grad)
    exact_x, exact_w = _exact_add_norm(x, delta, w, grad_total, grad_out, 1e-5)
    unit = 2**-8 if dtype == torch.bfloat16 else 2**-23
    for what, a, b, e in (
        ("inputs' gradient", xs.grad, xt.grad, exact_x),
        ("weight's gradient", ours_w, norm.weight.grad, exact_w),
    ):
        assert a.dtype == dtype, what
        assert _error(a, e) <= _error(b, e) + unit, what
        torch.testing.assert_close(a.double(), e, rtol=4 * unit, atol=4 * unit * e.abs().max())


@pytest.mark.parametrize("used", ["sum", "norm"])
def test_the_residual_add_and_norm_with_one_output_used(kernels, used):
    norm = RMSNorm(32).to(torch.bfloat16)
    norm.reset_parameters()
    x = torch.randn(4, 32).to(torch.bfloat16).requires_grad_()
    delta = torch.randn(4, 32).to(torch.bfloat16).requires_grad_()
    total, normed = norm.add_forward(x, delta)
    (total if used == "sum" else normed).float().square().sum().backward()
    reference = x.detach().clone().requires_grad_()
    out = reference + delta.detach()
    (out if used == "sum" else norm(out)).float().square().sum().backward()
    torch.testing.assert_close(x.grad, reference.grad, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(delta.grad, reference.grad, rtol=2**-7, atol=2**-7)


def test_the_residual_add_and_norm_runs_the_modules_hooks(kernels):
    """A hook on the norm (a tensor-parallel plan's, FSDP's) must run: with one, the add
    and a call of the module, whose hook here adds 1 to the input (a norm does not see a
    scaling)."""
    norm = RMSNorm(16)
    norm.reset_parameters()
    norm.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    x, delta = torch.randn(3, 16), torch.randn(3, 16)
    total, normed = norm.add_forward(x, delta)
    torch.testing.assert_close(total, x + delta)
    torch.testing.assert_close(normed, _composed(x + delta + 1, norm.weight, norm.eps))


def _small_llama(dtype):
    from hlat_model import Llama, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, ffn_dim=96, max_seq_len=32)
    return Llama(config).to(dtype), torch.randint(0, 64, (2, 33))


def test_the_blocks_fuse_the_residual_add_into_the_mlps_norm(kernels, monkeypatch):
    """The model's loss is the same with the fused add and norm as with the add and the
    module (bit for bit: forward's numbers are the same), its gradients within bf16's
    rounding; with the kernels off, the blocks take the composition."""
    model, tokens = _small_llama(torch.bfloat16)
    calls, kernel = [], _native.add_rms_norm_forward
    monkeypatch.setattr(_native, "add_rms_norm_forward", lambda *a: calls.append(1) or kernel(*a))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    assert len(calls) == (2 if kernels == "native" else 0)  # one per block
    loss.backward()
    ours = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    def composed(self, x, delta):
        total = x + delta
        return total, self(total)

    monkeypatch.setattr(RMSNorm, "add_forward", composed)
    theirs = model(tokens[:, :-1], labels=tokens[:, 1:])
    assert torch.equal(loss, theirs)
    theirs.backward()
    for name, p in model.named_parameters():
        scale = p.grad.float().abs().max().item()
        torch.testing.assert_close(ours[name].float(), p.grad.float(), rtol=0.05, atol=0.02 * scale)


def test_a_block_takes_a_norm_module_put_in_the_mlps_norms_place():
    model, tokens = _small_llama(torch.float32)
    for block in model.layers:
        block.mlp_norm = torch.nn.RMSNorm(64, eps=1e-5)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    assert loss.isfinite() and model.layers[0].mlp_norm.weight.grad is not None
