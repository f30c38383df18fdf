"""Parameters and gradients in other memory layouts than contiguous (channels_last
convolution weights, transposed parameters and gradients) step as contiguous copies of them
do, bit for bit, on every path."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from hlat_optim import AdamW

sys.path.insert(0, str(Path(__file__).parent))
from optim_bits import assert_same, bits

MODES = {
    "fp32": dict(dtype=torch.float32),
    "bf16-sr": dict(dtype=torch.bfloat16),
}
KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _strided_params(dtype):
    """A channels_last Conv2d (weight and bias) and a transposed parameter, with a
    contiguous parameter: their gradients are a real backward's (channels_last), a
    transposed one's and a transposed gradient of the contiguous parameter."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3).to(dtype).to(memory_format=torch.channels_last)
    transposed = torch.nn.Parameter(torch.randn(6, 4).to(dtype).t())
    plain = torch.nn.Parameter(torch.randn(5, 7).to(dtype))
    params = [conv.weight, conv.bias, transposed, plain]
    assert not conv.weight.is_contiguous() and not transposed.is_contiguous()
    return conv, params


def _gradients(conv, params, step):
    """Gradients in the layouts above, fresh each step."""
    for p in params:
        p.grad = None
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2, 3, 8, 8, generator=g).to(conv.weight.dtype)
    conv(x.to(memory_format=torch.channels_last)).float().square().mean().backward()
    params[2].grad = torch.randn(6, 4, generator=g).to(params[2].dtype).t()
    params[3].grad = torch.randn(7, 5, generator=g).to(params[3].dtype).t()
    assert not params[0].grad.is_contiguous()
    assert not params[2].grad.is_contiguous() and not params[3].grad.is_contiguous()


def _contiguous_copies(params):
    copies = [torch.nn.Parameter(p.detach().contiguous()) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad = p.grad.contiguous()
    return copies


def _snapshot(opt, params):
    """Bit patterns of every parameter and state, each in row-major order."""
    return [bits(t.contiguous()) for p in params for t in [p, *opt.state[p].values()]]


@pytest.mark.parametrize("impl", ["native", "reference", "compiled"])
@pytest.mark.parametrize("mode", list(MODES))
def test_strided_parameters_and_gradients_step_as_contiguous_copies_bit_for_bit(impl, mode):
    dtype = MODES[mode]["dtype"]
    conv, params = _strided_params(dtype)
    strides = [p.stride() for p in params]
    copies = [torch.nn.Parameter(p.detach().contiguous()) for p in params]
    opt = AdamW(params, impl=impl, seed=3, **KW)
    expected = AdamW(copies, impl=impl, seed=3, **KW)
    for step in range(3):
        _gradients(conv, params, step)
        for c, p in zip(copies, params, strict=True):
            c.grad = p.grad.contiguous()
        opt.step()
        expected.step()
        assert_same(_snapshot(opt, params), _snapshot(expected, copies))
    # the parameters keep their layout; the states are contiguous
    assert [p.stride() for p in params] == strides
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    for p in params:
        assert all(t.is_contiguous() for t in opt.state[p].values())


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_strided_fp32_parameters_follow_torch_adamw(impl):
    conv, params = _strided_params(torch.float32)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = AdamW(params, impl=impl, **KW)
    torch_opt = torch.optim.AdamW(theirs, **KW)
    for step in range(5):
        _gradients(conv, params, step)
        for t, p in zip(theirs, params, strict=True):
            t.grad = p.grad.clone()
        opt.step()
        torch_opt.step()
    for a, b in zip(params, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_state_dict_loads_into_strided_parameters_and_steps_as_contiguous_copies(impl, mode):
    """A ``torch.optim.AdamW`` state dict (its states in the parameters' layouts) and one of
    this AdamW (contiguous states) load into channels_last and transposed parameters; the
    states are made contiguous, and the steps are those of contiguous copies."""
    dtype = MODES[mode]["dtype"]
    conv, params = _strided_params(dtype)
    torch_opt = torch.optim.AdamW(params, **KW)
    for step in range(2):
        _gradients(conv, params, step)
        torch_opt.step()
    saved = copy.deepcopy(torch_opt.state_dict())
    assert not saved["state"][0]["exp_avg"].is_contiguous()  # channels_last, as its weight

    _gradients(conv, params, 2)
    copies = _contiguous_copies(params)
    opt = AdamW(params, impl=impl, seed=3, **KW)
    expected = AdamW(copies, impl=impl, seed=3, **KW)
    opt.load_state_dict(copy.deepcopy(saved))
    expected.load_state_dict(copy.deepcopy(saved))
    for p in params:
        assert all(t.is_contiguous() for t in opt.state[p].values())
    opt.step()
    expected.step()
    assert_same(_snapshot(opt, params), _snapshot(expected, copies))

    # and this AdamW's own state dict, round trip
    resumed = AdamW(params, impl=impl, seed=3, **KW)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    _gradients(conv, params, 3)
    for c, p in zip(copies, params, strict=True):
        c.grad = p.grad.contiguous()
    resumed.step()
    expected.step()
    assert_same(_snapshot(resumed, params), _snapshot(expected, copies))
