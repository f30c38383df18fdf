import pytest
import torch

from hlat_optim import NonFiniteGradNormError, clip_grad_norm_


def _params(*shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    return params


def test_norm_and_clipped_gradients_match_torch():
    ours, theirs = _params((10, 3), (7,)), _params((10, 3), (7,))
    norm = clip_grad_norm_(ours, max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_gradients_below_max_norm_are_untouched():
    params = _params((4,))
    before = params[0].grad.clone()
    norm = clip_grad_norm_(params, max_norm=1e6)
    assert torch.equal(params[0].grad, before)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(before))


def test_bf16_gradient_norm_is_accumulated_in_fp32():
    params = _params((4096,), dtype=torch.bfloat16)
    norm = clip_grad_norm_(params, max_norm=1e6)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, torch.linalg.vector_norm(params[0].grad.float()))


def test_non_finite_norm_warns_and_leaves_gradients_for_the_caller_to_skip():
    params = _params((3,), (2,))
    params[1].grad[0] = float("nan")
    before = [p.grad.clone() for p in params]
    with pytest.warns(RuntimeWarning, match=r"non-finite gradients: #1 \(2,\)"):
        norm = clip_grad_norm_(params, max_norm=1.0)
    assert not norm.isfinite()
    assert torch.equal(params[0].grad, before[0])


def test_non_finite_norm_raises_when_asked():
    params = _params((3,))
    params[0].grad[1] = float("inf")
    with pytest.raises(NonFiniteGradNormError, match="gradient norm is inf"):
        clip_grad_norm_(params, max_norm=1.0, error_if_nonfinite=True)


def test_non_positive_max_norm_is_rejected():
    with pytest.raises(ValueError, match="max_norm must be > 0, got 0"):
        clip_grad_norm_(_params((3,)), max_norm=0)
