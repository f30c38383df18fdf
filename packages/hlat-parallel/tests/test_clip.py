"""`clip_grad_norm_` on one process: the exact L2 norm, and scaling only above max_norm.
(Sharded gradients are covered by the parity tests on spawned groups.)"""

from __future__ import annotations

import torch

from hlat_parallel import clip_grad_norm_, param_norm


def params_with_grads(scale: float) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 2_000_000, 7)]
    for p in params:
        p.grad = torch.randn_like(p) * scale
    return params


def test_returned_norm_is_the_float64_norm_of_all_gradients():
    params = params_with_grads(1e-3)
    exact = torch.cat([p.grad.double().flatten() for p in params]).norm()
    norm = clip_grad_norm_(params, max_norm=1e9)
    assert abs(norm.double() - exact) / exact < 1e-6


def test_gradients_above_max_norm_are_scaled_to_it():
    params = params_with_grads(1.0)
    clip_grad_norm_(params, max_norm=1.0)
    after = torch.cat([p.grad.double().flatten() for p in params]).norm()
    assert abs(after.item() - 1.0) < 1e-5


def test_gradients_below_max_norm_are_left_alone():
    params = params_with_grads(1e-4)
    before = [p.grad.clone() for p in params]
    clip_grad_norm_(params, max_norm=1.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))


def test_parameters_without_gradients_are_skipped():
    params = params_with_grads(1.0)
    params.append(torch.nn.Parameter(torch.ones(3)))
    assert clip_grad_norm_(params, max_norm=1.0) > 1.0
    assert params[-1].grad is None


def test_a_non_finite_norm_leaves_the_gradients_untouched_and_is_returned():
    params = params_with_grads(1.0)
    params[1].grad[5] = float("nan")
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, max_norm=1.0)
    assert norm.isnan()
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.grad.nan_to_num(), b.nan_to_num())


def test_param_norm_is_the_norm_of_all_weights():
    params = params_with_grads(1.0)
    for p in params:
        p.data.normal_()
    exact = torch.cat([p.detach().double().flatten() for p in params]).norm()
    assert abs(param_norm(params).double() - exact) / exact < 1e-6
