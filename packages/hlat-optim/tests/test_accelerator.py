"""The compiled update on an accelerator (CUDA, or another device torch reports), skipped
where torch sees none: every element equals the eager reference on the same device, in every
precision mode, and the kernels a step launches."""

import pytest
import torch

from hlat_optim import AdamW

ACCELERATOR = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
pytestmark = pytest.mark.skipif(ACCELERATOR is None, reason="torch sees no accelerator")

MODES = {
    "fp32": (torch.float32, {"stochastic_rounding": False}),
    "bf16-sr": (torch.bfloat16, {}),
    "mixed": (torch.bfloat16, {"master_weights": True}),
    "bf16-kahan": (torch.bfloat16, {"kahan_sum": True}),
}


def _params(n, dtype, seed=0):
    """``n`` parameters of various sizes on the accelerator, with gradients that hold
    subnormal, tiny and non-finite values."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for i in range(n):
        x = torch.randn(257 + 61 * i, generator=g)
        x[::31] *= 1e-39  # subnormal in fp32
        p = torch.nn.Parameter(x.to(dtype).to(ACCELERATOR))
        params.append(p)
    return params


def _gradients(params, step, nonfinite=False):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        grad = torch.randn(p.shape, generator=g) * 1e-3
        grad[::17] *= 1e-36
        if nonfinite:
            grad[0], grad[-1] = float("nan"), float("inf")
        p.grad = grad.to(p.dtype).to(ACCELERATOR)


def _bits(t):
    t = t.detach().cpu()
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_update_equals_the_eager_reference_on_the_accelerator(mode):
    dtype, options = MODES[mode]
    runs = {}
    for impl in ("reference", "compiled"):
        params = _params(6, dtype)
        opt = AdamW(params, lr=1e-2, weight_decay=0.1, seed=3, impl=impl, **options)
        for step in range(3):
            _gradients(params, step, nonfinite=step == 1)
            opt.step(skip=torch.tensor(step == 1, device=ACCELERATOR))
        runs[impl] = [_bits(t) for p in params for t in [p, *opt.state[p].values()]]
    for a, b in zip(runs["compiled"], runs["reference"], strict=True):
        assert torch.equal(a, b)


def _launches(opt, params):
    """Kernels launched by one optimizer step (the runtime's launch calls, as the profiler
    records them)."""
    from torch.profiler import ProfilerActivity, profile

    _gradients(params, 9)
    torch.accelerator.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
        torch.accelerator.synchronize()
    return sum(1 for e in prof.events() if "LaunchKernel" in e.name)


@pytest.mark.skipif(
    ACCELERATOR is None or ACCELERATOR.type != "cuda", reason="counts CUDA launch calls"
)
def test_the_kernels_a_step_launches_do_not_grow_with_the_number_of_tensors():
    counts = {}
    for n in (8, 64):
        params = _params(n, torch.bfloat16)
        opt = AdamW(params, lr=1e-2, weight_decay=0.1, impl="compiled")
        for step in range(2):
            _gradients(params, step)
            opt.step()
        counts[n] = _launches(opt, params)
    # gathering the parameters and gradients, the update, writing the parameters back and
    # the table's copy, for 8 tensors as for 64
    assert counts[8] == counts[64], counts
    assert counts[8] <= 8, counts
