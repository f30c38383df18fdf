import io
import math

import pytest
import torch

from hlat_optim import AdamW, cosine_with_warmup

SHAPES = [(48, 32), (32,), (7, 5)]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _run(opt, params, steps, seed=1, start=0):
    g = torch.Generator().manual_seed(seed)
    for i in range(start + steps):
        grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
        if i < start:
            continue
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        opt.step()


def _bits(t):
    return t.detach().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("impl", ["reference", "compiled"])
def test_fp32_matches_torch_adamw_over_100_steps_with_weight_decay(impl):
    ours, theirs = _params(torch.float32), _params(torch.float32)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    _run(AdamW(ours, impl=impl, **kw), ours, 100)
    _run(torch.optim.AdamW(theirs, **kw), theirs, 100)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "state_dtype", "master"),
    [
        (torch.float32, None, False),
        (torch.bfloat16, None, False),
        (torch.bfloat16, torch.float32, False),
        (torch.bfloat16, None, True),
    ],
    ids=["fp32", "bf16-sr", "bf16-sr-fp32-states", "mixed"],
)
def test_reference_and_compiled_paths_are_bit_identical(dtype, state_dtype, master):
    runs = []
    for impl in ("reference", "compiled"):
        params = _params(dtype)
        opt = AdamW(
            params,
            lr=1e-2,
            weight_decay=0.1,
            state_dtype=state_dtype,
            master_weights=master,
            impl=impl,
        )
        _run(opt, params, 5)
        states = [t for p in params for t in opt.state[p].values()]
        runs.append([_bits(t) for t in [*params, *states]])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"state_dtype": torch.float32}, {"master_weights": True}],
    ids=["bf16-states", "fp32-states", "mixed"],
)
def test_resume_from_state_dict_gives_bit_identical_following_steps(kwargs):
    params = _params(torch.bfloat16)
    opt = AdamW(params, lr=1e-2, weight_decay=0.1, seed=123, impl="reference", **kwargs)
    _run(opt, params, 5)
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    _run(opt, params, 5, start=5)

    buf.seek(0)
    saved = torch.load(buf)
    resumed = [torch.nn.Parameter(t) for t in saved["params"]]
    opt2 = AdamW(resumed, lr=1e-2, weight_decay=0.1, seed=0, impl="reference", **kwargs)
    opt2.load_state_dict(saved["opt"])  # restores seed 123 and each parameter's step
    _run(opt2, resumed, 5, start=5)
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        for name, value in opt.state[a].items():
            assert opt2.state[b][name].dtype == value.dtype
            assert torch.equal(opt2.state[b][name], value)


def _constant_grad_run(stochastic_rounding, steps=500, n=2048):
    # A norm weight at 1.0 and an update of 1e-4 per step: a 40th of bf16's spacing below 1.
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = AdamW(
        [p],
        lr=1e-4,
        weight_decay=0.0,
        state_dtype=torch.float32,
        stochastic_rounding=stochastic_rounding,
        impl="reference",
    )
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    return p.detach().double()


def test_norm_weight_stays_at_one_with_round_to_nearest():
    assert (_constant_grad_run(False, steps=200) == 1.0).all()


def test_norm_weight_moves_by_the_expected_amount_with_stochastic_rounding():
    p = _constant_grad_run(True)
    expected = 1.0 - 500 * 1e-4  # Adam's step with a constant gradient is lr
    bound = 5 * p.std().item() / math.sqrt(p.numel())
    assert abs(p.mean().item() - expected) < bound + 1e-5


def test_weight_decay_applies_to_every_group_unless_it_sets_zero():
    decayed = torch.nn.Parameter(torch.ones(8))
    norm = torch.nn.Parameter(torch.ones(8))
    kept = torch.nn.Parameter(torch.ones(8))
    opt = AdamW(
        [{"params": [decayed, norm]}, {"params": [kept], "weight_decay": 0.0}],
        lr=0.1,
        weight_decay=0.1,
        impl="reference",
    )
    for p in (decayed, norm, kept):
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(decayed, torch.full((8,), 0.99))
    assert torch.allclose(norm, torch.full((8,), 0.99))
    assert torch.equal(kept, torch.ones(8))


def test_master_weights_follow_the_fp32_trajectory():
    init = [p.bfloat16().float() for p in _params(torch.float32)]
    fp32 = [torch.nn.Parameter(t.clone()) for t in init]
    bf16 = [torch.nn.Parameter(t.bfloat16()) for t in init]
    opt32 = AdamW(fp32, lr=1e-2, impl="reference")
    opt16 = AdamW(bf16, lr=1e-2, master_weights=True, impl="reference")
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        for a, b in zip(fp32, bf16, strict=True):
            grad = torch.randn(a.shape, generator=g).bfloat16()
            a.grad, b.grad = grad.float(), grad
        opt32.step(), opt16.step()
    for a, b in zip(fp32, bf16, strict=True):
        assert torch.equal(opt16.state[b]["master"], a.detach())
        assert torch.equal(b.detach(), a.detach().bfloat16())


def test_lr_scheduler_and_tensor_lr_drive_the_update():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = AdamW([p], lr=torch.tensor(0.5), weight_decay=0.0, impl="reference")
    sched = cosine_with_warmup(opt, warmup_steps=2, total_steps=4)
    p.grad = torch.ones(4)
    opt.step()  # lr 0 at warmup start: no movement
    assert torch.equal(p.detach(), torch.zeros(4))
    sched.step()
    opt.step()  # lr 0.25, Adam step of lr * 1
    assert torch.allclose(p.detach(), torch.full((4,), -0.25))


def test_bytes_per_parameter_match_each_precision_mode():
    def bytes_per_param(dtype, **kw):
        p = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
        opt = AdamW([p], impl="reference", **kw)
        p.grad = torch.zeros_like(p)
        opt.step()
        tensors = [p, p.grad, *(t for t in opt.state[p].values() if t.dim() > 0)]
        return sum(t.numel() * t.element_size() for t in tensors) / p.numel()

    assert bytes_per_param(torch.bfloat16) == 8
    assert bytes_per_param(torch.bfloat16, state_dtype=torch.float32) == 12
    assert bytes_per_param(torch.bfloat16, master_weights=True) == 16
    assert bytes_per_param(torch.float32) == 16


def test_float16_parameters_are_rejected_with_their_position():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3).half())]
    with pytest.raises(
        TypeError, match=r"parameter 1 of param group 0 \(shape \(3,\)\) is torch.float16"
    ):
        AdamW(params)


def test_failed_compilation_falls_back_to_the_reference_update_with_a_warning(monkeypatch):
    import hlat_optim.adamw as adamw_module

    def broken_compiler_output(*args):
        raise RuntimeError("no C++ compiler found")

    # Fault injection: what torch.compile returns on a machine without a working toolchain.
    monkeypatch.setattr(adamw_module, "_compiled", broken_compiler_output)
    params, expected = _params(torch.bfloat16), _params(torch.bfloat16)
    opt = AdamW(params, lr=1e-2, impl="auto")
    with pytest.warns(RuntimeWarning, match="torch.compile of the update failed"):
        _run(opt, params, 3)
    assert opt.impl == "reference"
    _run(AdamW(expected, lr=1e-2, impl="reference"), expected, 3)
    for a, b in zip(params, expected, strict=True):
        assert torch.equal(_bits(a), _bits(b))
