import copy
import io
import math
import pickle
import re
import warnings
from pathlib import Path

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


@pytest.mark.parametrize("impl", ["reference", "compiled", "native"])
def test_fp32_matches_torch_adamw_over_100_steps_with_weight_decay(impl):
    ours, theirs = _params(torch.float32), _params(torch.float32)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    _run(AdamW(ours, impl=impl, **kw), ours, 100)
    _run(torch.optim.AdamW(theirs, **kw), theirs, 100)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


MODES = {
    "fp32": dict(dtype=torch.float32),
    "fp32-bf16-states": dict(dtype=torch.float32, state_dtype=torch.bfloat16),
    "bf16-sr": dict(dtype=torch.bfloat16),
    "bf16-sr-fp32-states": dict(dtype=torch.bfloat16, state_dtype=torch.float32),
    "bf16-nearest": dict(dtype=torch.bfloat16, stochastic_rounding=False),
    "mixed": dict(dtype=torch.bfloat16, master_weights=True),
    "bf16-kahan": dict(dtype=torch.bfloat16, kahan_sum=True),
    "bf16-kahan-fp32-states": dict(dtype=torch.bfloat16, kahan_sum=True, state_dtype=torch.float32),
    "mixed-bf16-states": dict(
        dtype=torch.bfloat16, master_weights=True, state_dtype=torch.bfloat16
    ),
}


def _final_bits(impl, mode, params):
    kwargs = dict(MODES[mode])
    kwargs.pop("dtype")
    opt = AdamW(params, lr=1e-2, weight_decay=0.1, impl=impl, **kwargs)
    _run(opt, params, 5)
    states = [t for p in params for t in opt.state[p].values()]
    return [_bits(t) for t in [*params, *states]]


@pytest.mark.parametrize("impl", ["compiled", "native"])
@pytest.mark.parametrize("mode", list(MODES))
def test_fast_paths_are_bit_identical_to_the_reference(impl, mode):
    dtype = MODES[mode]["dtype"]
    expected = _final_bits("reference", mode, _params(dtype))
    for a, b in zip(_final_bits(impl, mode, _params(dtype)), expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_under_torch_compile_is_the_eager_step_bit_for_bit(mode):
    # the default impl: the CPU kernel here, which a traced step handed freed memory
    dtype = MODES[mode]["dtype"]
    kwargs = {k: v for k, v in MODES[mode].items() if k != "dtype"}
    runs = []
    for compiled in (False, True):
        params = _params(dtype)
        opt = AdamW(params, lr=1e-2, weight_decay=0.1, **kwargs)
        step = torch.compile(opt.step) if compiled else opt.step
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
            step()
        runs.append([_bits(t).clone() for p in params for t in [p, *opt.state[p].values()]])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["native", "compiled"])
@pytest.mark.parametrize("mode", ["bf16-sr", "bf16-sr-fp32-states", "mixed", "bf16-kahan"])
def test_a_deepcopied_or_unpickled_optimizer_steps_on_as_the_original(impl, mode):
    dtype = MODES[mode]["dtype"]
    kwargs = {k: v for k, v in MODES[mode].items() if k != "dtype"}
    params = _params(dtype)
    opt = AdamW(params, lr=1e-2, weight_decay=0.1, seed=5, impl=impl, **kwargs)
    _run(opt, params, 2)
    copies = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    _run(opt, params, 3, start=2)
    for other in copies:
        for name, value in {"impl": impl, **kwargs}.items():
            assert getattr(other, name) == value
        mine = other.param_groups[0]["params"]
        _run(other, mine, 3, start=2)
        for a, b in zip(params, mine, strict=True):
            assert torch.equal(_bits(a), _bits(b))
            for name, value in opt.state[a].items():
                assert torch.equal(_bits(other.state[b][name]), _bits(value)), name


def _hostile_params(dtype):
    """Two parameters of 100,003 elements (several kernel blocks and thread tasks, an odd
    tail) seeded with ±inf, NaN, values next to the largest bf16, subnormals and exact
    bf16 values, in different blocks."""
    g = torch.Generator().manual_seed(3)
    params = []
    for _ in range(2):
        x = torch.randn(100_003, generator=g)
        x[5] = float("inf")
        x[6] = -float("inf")
        x[7] = float("nan")
        x[40_000] = 3.3895e38  # largest bf16 is 3.3895314e38
        x[40_001] = -3.4e38
        x[70_000:70_010] = 1e-40  # fp32 subnormals
        x[100_002] = 1.0
        params.append(torch.nn.Parameter(x.to(dtype)))
    return params


@pytest.mark.parametrize("width", ["host", "8 lanes"])
@pytest.mark.parametrize("mode", ["bf16-sr", "fp32-bf16-states", "mixed-bf16-states", "bf16-kahan"])
def test_native_kernel_matches_the_reference_on_special_values(mode, width, request):
    if width == "8 lanes":
        request.getfixturevalue("eight_lane_kernel")
    dtype = MODES[mode]["dtype"]
    kwargs = {k: v for k, v in MODES[mode].items() if k != "dtype"}
    runs = []
    for impl in ("reference", "native"):
        params = _hostile_params(dtype)
        opt = AdamW(params, lr=1e-2, weight_decay=0.1, impl=impl, **kwargs)
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            for p in params:
                grad = torch.randn(p.shape, generator=g)
                grad[9] = float("inf")  # a non-finite gradient reaches the states
                grad[50_000] = 3e38
                p.grad = grad.to(dtype)
            opt.step()
        states = [t for p in params for t in opt.state[p].values()]
        runs.append([t.detach().clone() for t in [*params, *states]])
    for a, b in zip(*runs, strict=True):
        _same_bits_nan_aside(a, b)


def _same_bits_nan_aside(a, b):
    # Note: NaN payloads are not specified by IEEE 754 and differ between eager torch and
    # compiled code (inf/inf gives 0xFFC0 in one, 0xFFFF in the other); every other value
    # must match bit for bit.
    assert torch.equal(a.isnan(), b.isnan())
    keep = ~a.isnan()
    assert torch.equal(_bits(a[keep]), _bits(b[keep]))


def _nan_with_payload(bits, n):
    return torch.full((n,), bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_native_kernel_matches_the_reference_where_fast_rounding_needs_its_fix_up():
    """Rounding cases that the kernel's short path gets wrong and must redo exactly: finite
    values above the largest bf16 (which must saturate, not become inf) and NaNs whose
    payload would carry into the sign bit (which must stay NaN)."""
    n = 70_001
    big = torch.finfo(torch.bfloat16).max
    runs = []
    for impl in ("reference", "native"):
        g = torch.Generator().manual_seed(5)
        # bf16 parameters at ±max bf16, pushed outwards by lr: w = p ± lr, SR rounds it.
        p1 = torch.nn.Parameter(torch.full((n,), big, dtype=torch.bfloat16))
        p1.data[1::2] = -big
        p1.grad = -p1.detach().sign()
        # fp32 parameters with bf16 states: NaN gradients with all-ones payloads reach the
        # moments (one in each of two blocks; the rest of those blocks are ordinary values).
        p2 = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(6)))
        grad = torch.randn(n, generator=g)
        grad[100:104] = _nan_with_payload(0x7FFFFFFF, 4)
        grad[60_000:60_004] = _nan_with_payload(-1, 4)  # 0xFFFFFFFF
        p2.grad = grad
        opt = AdamW([p1], lr=5e35, weight_decay=0.0, impl=impl)
        opt.add_param_group({"params": [p2], "lr": 1e-2})
        opt.state[p2]["exp_avg"] = torch.zeros(n, dtype=torch.bfloat16)
        opt.state[p2]["exp_avg_sq"] = torch.zeros(n, dtype=torch.bfloat16)
        opt.state[p2]["step"] = torch.tensor(0.0)
        opt.step()
        runs.append([t.detach().clone() for t in [p1, p2, *opt.state[p2].values()]])
    reference, native = runs
    assert (reference[0].abs() == big).all()  # saturated: none became inf
    assert reference[2][100:104].isnan().all() and reference[2][60_000:60_004].isnan().all()
    for a, b in zip(reference, native, strict=True):
        if a.dim():
            _same_bits_nan_aside(a, b)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"state_dtype": torch.float32}, {"master_weights": True}, {"kahan_sum": True}],
    ids=["bf16-states", "fp32-states", "mixed", "kahan"],
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


def _constant_grad_run(stochastic_rounding, steps=500, n=2048, **kwargs):
    # A norm weight at 1.0 and an update of 1e-4 per step: a 40th of bf16's spacing below 1.
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = AdamW(
        [p],
        lr=1e-4,
        weight_decay=0.0,
        state_dtype=torch.float32,
        stochastic_rounding=stochastic_rounding,
        impl="reference",
        **kwargs,
    )
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    if kwargs.get("kahan_sum"):
        return p.detach().double(), opt.state[p]["compensation"].double()
    return p.detach().double()


def test_norm_weight_stays_at_one_with_round_to_nearest():
    assert (_constant_grad_run(False, steps=200) == 1.0).all()


def test_norm_weight_moves_by_the_expected_amount_with_stochastic_rounding():
    p = _constant_grad_run(True)
    expected = 1.0 - 500 * 1e-4  # Adam's step with a constant gradient is lr
    bound = 5 * p.std().item() / math.sqrt(p.numel())
    assert abs(p.mean().item() - expected) < bound + 1e-5


def test_norm_weight_follows_the_exact_sum_with_kahan_compensation():
    p, compensation = _constant_grad_run(False, kahan_sum=True)
    expected = 1.0 - 500 * 1e-4
    # The parameter itself moved (by whole bf16 steps) to within one bf16 spacing of the
    # exact sum, where round-to-nearest alone stays at 1.0 (0.05 off). Parameter plus
    # compensation is the exact sum up to the compensation's own rounding, which drifts one
    # way when every increment is the same (measured: 3.1e-4 after 500 steps).
    assert (p < 1.0).all() and (p.unique().numel() == 1)
    assert abs(p[0].item() - expected) <= 2**-8
    assert ((p + compensation) - expected).abs().max().item() < 1e-3


def test_kahan_sum_and_master_weights_are_exclusive():
    with pytest.raises(ValueError, match=r"kahan_sum and master_weights .* choose one"):
        AdamW(
            [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))],
            kahan_sum=True,
            master_weights=True,
        )


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
    assert bytes_per_param(torch.bfloat16, kahan_sum=True) == 10
    assert bytes_per_param(torch.float32) == 16


def test_float16_parameters_are_rejected_with_their_position():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3).half())]
    with pytest.raises(
        TypeError, match=r"parameter 1 of param group 0 \(shape \(3,\)\) is torch.float16"
    ):
        AdamW(params)


@pytest.mark.parametrize("impl", ["native", "compiled"])
def test_a_parameter_that_cannot_be_updated_is_reported_before_any_parameter_changes(impl):
    params = _params(torch.bfloat16)
    opt = AdamW(params, lr=1e-2, impl=impl)
    _run(opt, params, 1)
    # elements that share memory: no update could be written back
    params[2].data = params[2].data[:1].expand(7, 5)
    before = [_bits(t).clone() for p in params for t in [p, *opt.state[p].values()]]
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(
        RuntimeError, match=r"parameter 2 \(shape \(7, 5\)\) cannot be updated: its elements may"
    ):
        opt.step()
    after = [_bits(t) for p in params for t in [p, *opt.state[p].values()]]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)  # parameters, states and step counts as they were


def _no_compiler(gm, example_inputs):
    raise RuntimeError("no C++ compiler found")


def _no_triton(gm, example_inputs):
    from torch._inductor.exc import TritonMissing

    raise TritonMissing(first_useful_frame=None)


@pytest.mark.parametrize(
    ("compiler", "named"),
    [
        # inductor on a machine without a working toolchain (where the native CPU kernel
        # cannot be built either): dynamo wraps the error in BackendCompilerFailed
        (_no_compiler, "BackendCompilerFailed"),
        # inductor on a CUDA machine without a working Triton: TritonMissing, which dynamo
        # raises as it is, not wrapped
        (_no_triton, "TritonMissing"),
    ],
    ids=["no-compiler", "no-triton"],
)
def test_failed_compilation_falls_back_to_the_reference_update_with_a_warning(
    monkeypatch, compiler, named
):
    from torch._dynamo.backends import registry

    import hlat_optim.adamw as adamw_module

    # Fault injection: a torch.compile backend that fails as inductor does there
    registry._lazy_import()  # torch's own backends first, so none is registered later
    monkeypatch.setitem(registry._BACKENDS, "hlat-failing", None)
    monkeypatch.setitem(registry._COMPILER_FNS, "hlat-failing", compiler)
    monkeypatch.setattr(adamw_module, "_compiled", {})
    monkeypatch.setattr(adamw_module._native, "load", lambda: None)
    params, expected = _params(torch.bfloat16), _params(torch.bfloat16)
    opt = AdamW(params, lr=1e-2, impl="auto", compile_backend="hlat-failing")
    with pytest.warns(RuntimeWarning, match=f"torch.compile of the update failed.*{named}"):
        _run(opt, params, 3)
    assert opt.impl == "reference"
    _run(AdamW(expected, lr=1e-2, impl="reference"), expected, 3)
    for a, b in zip(params, expected, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_an_error_of_the_first_compiled_step_that_is_no_compile_failure_is_raised(monkeypatch):
    import hlat_optim.adamw as adamw_module

    compiled = adamw_module._compiled_update("eager")
    calls = []

    def out_of_memory_once(*args):
        calls.append(args[0].numel())
        if len(calls) == 1:
            raise torch.OutOfMemoryError("out of memory (injected)")
        compiled(*args)

    # Fault injection: a transient out-of-memory error in the first call of the compiled update.
    monkeypatch.setitem(adamw_module._compiled, ("inductor", "cpu"), out_of_memory_once)
    monkeypatch.setattr(adamw_module._native, "load", lambda: None)
    params = _params(torch.bfloat16)
    opt = AdamW(params, lr=1e-2, impl="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            _run(opt, params, 1)
        assert opt.impl == "auto"  # not taken for a failed compilation
        _run(opt, params, 2, start=1)
    assert len(calls) == 3  # the later steps went through the compiled update


def test_the_update_compiles_to_static_shapes_for_neurons_backend(monkeypatch):
    # TorchNeuron's torch.compile backend ("neuron") rejects dynamic=True at compilation (its
    # backend reference, Neuron 2.33). Played here by a backend registered under that name
    # which refuses graphs with symbolic sizes and runs the others as traced.
    from torch._dynamo.backends import registry

    import hlat_optim.adamw as adamw_module

    graphs = []

    def static_shapes_only(gm, example_inputs):
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            sizes = getattr(value, "shape", ())
            if isinstance(value, torch.SymInt) or any(isinstance(d, torch.SymInt) for d in sizes):
                raise RuntimeError("dynamic shapes are not supported by this backend")
        graphs.append(gm)
        return gm.forward

    registry._lazy_import()  # torch's own backends first, so none is registered later
    monkeypatch.setitem(registry._BACKENDS, "neuron", None)
    monkeypatch.setitem(registry._COMPILER_FNS, "neuron", static_shapes_only)
    monkeypatch.setattr(adamw_module, "_compiled", {})
    assert adamw_module._compile_kwargs("inductor", "cuda")["dynamic"] is True
    params, expected = _params(torch.bfloat16), _params(torch.bfloat16)
    _run(AdamW(params, lr=1e-2, impl="compiled", compile_backend="neuron"), params, 3)
    _run(AdamW(expected, lr=1e-2, impl="reference"), expected, 3)
    assert graphs
    for a, b in zip(params, expected, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def _stepped(params, **kwargs):
    """An optimizer over ``params`` one step in, and its state dict."""
    opt = AdamW(params, lr=1e-2, impl="reference", **kwargs)
    _run(opt, params, 1)
    return opt, opt.state_dict()


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [((6, 4), (4, 6)), ((100,), (10,)), ((4,), (10,))],
    ids=["same-numel", "larger-state", "smaller-state"],
)
def test_a_saved_state_of_another_shape_than_its_parameter_is_refused_at_load(saved, loaded):
    _, state = _stepped(
        [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(saved))]
    )
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(loaded))]
    opt = AdamW(params, lr=1e-2)
    shapes = rf"{re.escape(str(saved))}.*{re.escape(str(loaded))}"
    with pytest.raises(ValueError, match=rf"parameter 1's exp_avg has shape {shapes}"):
        opt.load_state_dict(state)
    assert not opt.state  # nothing was loaded


@pytest.mark.parametrize("impl", ["reference", "compiled", "native"])
def test_a_state_of_another_shape_set_by_hand_is_refused_before_any_change(impl):
    params = [torch.nn.Parameter(torch.zeros(6, 4)), torch.nn.Parameter(torch.zeros(4, 6))]
    opt = AdamW(params, lr=1e-2, impl=impl)
    _run(opt, params, 1)
    state = opt.state[params[1]]
    state["exp_avg_sq"] = state["exp_avg_sq"].reshape(6, 4).clone()  # same numel
    before = [_bits(t).clone() for p in params for t in [p, *opt.state[p].values()]]
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(
        RuntimeError, match=r"parameter 1 \(shape \(4, 6\)\).*exp_avg_sq has shape \(6, 4\)"
    ):
        opt.step()
    after = [_bits(t) for p in params for t in [p, *opt.state[p].values()]]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)  # parameters, states and step counts as they were


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_a_state_the_update_cannot_use_is_refused_before_the_step_counts_advance(impl):
    params = [torch.nn.Parameter(torch.zeros(8))]
    opt = AdamW(params, lr=1e-2, impl=impl)
    _run(opt, params, 1)
    opt.state[params[0]]["master"] = torch.zeros(8)  # master weights of an fp32 parameter
    before = [_bits(t).clone() for t in [params[0], *opt.state[params[0]].values()]]
    params[0].grad = torch.ones(8)
    with pytest.raises(RuntimeError, match=r"parameter 0 .* is torch.float32 and has master"):
        opt.step()
    after = [_bits(t) for t in [params[0], *opt.state[params[0]].values()]]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    assert opt.state[params[0]]["step"].item() == 1


# (saved with, loaded into, the loaded state's entries and their dtypes, the warning)
CONVERSIONS = {
    "mixed-to-sr": (
        {"master_weights": True},
        {},
        {"exp_avg": torch.float32, "master": None},
        "dropped master weights",
    ),
    "mixed-to-kahan": (
        {"master_weights": True},
        {"kahan_sum": True},
        {"master": None, "compensation": torch.bfloat16},
        "dropped master weights.*zero Kahan compensation",
    ),
    "sr-to-mixed": (
        {},
        {"master_weights": True},
        {"exp_avg": torch.bfloat16, "master": torch.float32},
        "fp32 master weights from the parameters",
    ),
    "kahan-to-sr": ({"kahan_sum": True}, {}, {"compensation": None}, "dropped Kahan"),
    "sr-to-fp32-states": (
        {},
        {"state_dtype": torch.float32},
        {"exp_avg": torch.float32, "exp_avg_sq": torch.float32},
        "exp_avg and exp_avg_sq cast to torch.float32",
    ),
}


@pytest.mark.parametrize("case", list(CONVERSIONS))
def test_a_state_dict_of_another_precision_mode_is_converted_to_the_constructors(case):
    saved_with, loaded_into, entries, warning = CONVERSIONS[case]
    params = _params(torch.bfloat16)
    _, state = _stepped(params, **saved_with)
    runs = []
    for impl in ("reference", "native"):
        loaded = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = AdamW(loaded, lr=1e-2, impl=impl, **loaded_into)
        with pytest.warns(UserWarning, match=warning) as record:
            opt.load_state_dict(copy.deepcopy(state))
        assert len(record) == 1
        for p in loaded:
            for name, dtype in entries.items():
                assert (opt.state[p][name].dtype if name in opt.state[p] else None) == dtype
            if "master" in opt.state[p] and not saved_with.get("master_weights"):
                assert torch.equal(opt.state[p]["master"], p.detach().float())
            if "compensation" in opt.state[p]:
                assert not opt.state[p]["compensation"].any()
        _run(opt, loaded, 2, start=1)
        runs.append([_bits(t).clone() for p in loaded for t in [p, *opt.state[p].values()]])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)  # the converted state steps alike on both paths


def test_master_weights_loaded_for_fp32_parameters_are_dropped_and_the_step_runs():
    _, state = _stepped(
        [torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))], master_weights=True
    )
    params = [torch.nn.Parameter(torch.zeros(8))]
    opt = AdamW(params, lr=1e-2)
    with pytest.warns(UserWarning, match="dropped master weights"):
        opt.load_state_dict(state)
    params[0].grad = torch.ones(8)
    opt.step()
    assert sorted(opt.state[params[0]]) == ["exp_avg", "exp_avg_sq", "step"]


def test_a_state_dict_of_the_same_mode_loads_without_a_warning():
    params = _params(torch.bfloat16)
    _, state = _stepped(params, kahan_sum=True)
    opt = AdamW(params, kahan_sum=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(state)


def test_add_param_group_refuses_float16_and_float64_parameters():
    opt = AdamW([torch.nn.Parameter(torch.zeros(2))])
    for dtype in (torch.float16, torch.float64):
        bad = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
        with pytest.raises(TypeError, match=rf"parameter 1 of param group 1 .* is {dtype}"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4)), bad]})
        assert len(opt.param_groups) == 1  # the group was not added


def test_a_seed_that_is_not_an_integer_is_refused_before_any_step():
    with pytest.raises(TypeError, match=r"seed of param group 0 must be an integer, got 1.0"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], seed=1.0)
    opt = AdamW([torch.nn.Parameter(torch.zeros(2))], seed=3)
    with pytest.raises(TypeError, match=r"seed of param group 1 must be an integer, got '7'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))], "seed": "7"})
    assert len(opt.param_groups) == 1  # the group was not added


def test_a_torch_adamw_state_dict_loads_with_the_constructors_seed_and_steps_on():
    ours, theirs = _params(torch.float32), _params(torch.float32)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(theirs, **kw)
    _run(torch_opt, theirs, 3)
    with torch.no_grad():
        for a, b in zip(ours, theirs, strict=True):
            a.copy_(b)
    opt = AdamW(ours, seed=7, **kw)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert opt.param_groups[0]["seed"] == 7
    _run(opt, ours, 3, start=3)
    _run(torch_opt, theirs, 3, start=3)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_state_dict_without_state_loads_as_no_state():
    """As torch's optimizers do: no empty entries, so the optimizer still reads as one
    without state (a checkpointer gives such an optimizer state to read into)."""
    opt = AdamW(_params(torch.float32), lr=1e-2)
    opt.load_state_dict(opt.state_dict())
    assert not opt.state


@pytest.mark.parametrize("option", ["maximize", "amsgrad"])
def test_torch_s_maximize_and_amsgrad_are_refused_not_ignored(option):
    """A param group or a ``torch.optim.AdamW`` state dict asking for an update this AdamW
    does not make is refused; nothing is added or loaded."""
    params = _params(torch.float32)
    opt = AdamW(params[:1], lr=1e-2)
    with pytest.raises(ValueError, match=rf"param group 1 sets {option}=True, which this"):
        opt.add_param_group({"params": params[1:], option: True})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": params[1:], option: False})  # as torch's state dicts hold
    torch_opt = torch.optim.AdamW(_params(torch.float32), lr=1e-2, **{option: True})
    with pytest.raises(ValueError, match=rf"group 0 sets {option}=True.*nothing was loaded"):
        AdamW(_params(torch.float32), lr=1e-2).load_state_dict(torch_opt.state_dict())


def test_torch_s_l2_weight_decay_is_refused_not_run_as_decoupled_decay():
    """``decoupled_weight_decay=False`` (torch's L2 decay, which ``torch.optim.AdamW`` and
    ``torch.optim.Adam`` honour) is refused in a param group, at construction and by
    ``add_param_group``; a loaded ``torch.optim.Adam`` state dict takes AdamW's decoupled
    decay, as ``torch.optim.AdamW``'s load does; ``True``, AdamW's decay, is accepted."""
    params = _params(torch.float32)
    with pytest.raises(ValueError, match=r"param group 0 sets decoupled_weight_decay=False"):
        AdamW([{"params": params[:1], "decoupled_weight_decay": False}], lr=1e-2)
    opt = AdamW(params[:1], lr=1e-2)
    with pytest.raises(ValueError, match=r"param group 1 sets decoupled_weight_decay=False"):
        opt.add_param_group({"params": params[1:], "decoupled_weight_decay": False})
    assert len(opt.param_groups) == 1
    adam = torch.optim.Adam(_params(torch.float32), lr=1e-2, weight_decay=0.5)
    saved = adam.state_dict()
    loaded, reference = AdamW(_params(torch.float32), lr=1e-2), torch.optim.AdamW(params, lr=1e-2)
    loaded.load_state_dict(saved)
    reference.load_state_dict(saved)
    assert loaded.param_groups[0]["decoupled_weight_decay"] is True
    assert reference.param_groups[0]["decoupled_weight_decay"] is True
    assert saved["param_groups"][0]["decoupled_weight_decay"] is False  # the caller's, as it was

    # True is AdamW's own decay: the update is torch.optim.AdamW's
    ours, theirs = _params(torch.float32), _params(torch.float32)
    kw = dict(lr=1e-1, weight_decay=0.5)
    _run(AdamW([{"params": ours, "decoupled_weight_decay": True}], **kw), ours, 5)
    _run(torch.optim.AdamW(theirs, **kw), theirs, 5)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_the_step_count_and_the_rounding_keys_stop_at_2_to_the_24_as_documented(impl):
    """The float32 step count, from which the rounding keys are derived, is exact up to
    2**24 and stops there: from then on the same update rounds the same way every step."""
    p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opt = AdamW([p], lr=1e-3, betas=(0.0, 0.0), weight_decay=0.0, impl=impl)
    p.grad = torch.ones_like(p)
    opt.step()

    def rounded_from(count):
        opt.state[p]["step"].fill_(count)
        results = []
        for _ in range(2):
            with torch.no_grad():
                p.fill_(1.0)  # the same value and gradient every step
            p.grad = torch.ones_like(p)
            opt.step()
            results.append((p.detach().clone(), opt.state[p]["step"].item()))
        return results

    (first, count1), (second, count2) = rounded_from(1000.0)
    assert (count1, count2) == (1001.0, 1002.0) and not torch.equal(first, second)
    (first, count1), (second, count2) = rounded_from(2.0**24 - 1)
    assert (count1, count2) == (2.0**24, 2.0**24)
    assert torch.equal(first, second)
    assert "2**24" in (Path(__file__).parents[1] / "README.md").read_text()
