"""The grouped step: one update call per device and dtype group, no scalar read on the host,
and the device-side skip, on every path (CPU tensors; the compiled path through inductor)."""

import copy
import io
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hlat_optim.adamw as adamw_module
from hlat_optim import AdamW

sys.path.insert(0, str(Path(__file__).parent))
from optim_bits import assert_same as _assert_same
from optim_bits import bits as _bits
from optim_bits import snapshot as _snapshot

SHAPES = [(48, 32), (32,), (7, 5)]
IMPLS = ["reference", "native", "compiled"]
# Precision modes for a model of bf16 and fp32 parameters: the options apply to the bf16
# ones, the fp32 ones are plain fp32 AdamW in every mode.
MODES = {
    "bf16-sr": {},
    "mixed": {"master_weights": True},
    "bf16-kahan": {"kahan_sum": True},
}


def _model(scale=1, seed=0):
    """bf16 and fp32 parameters of SHAPES (``scale`` of each), in two param groups with
    different hyperparameters that both hold tensors of each dtype."""
    g = torch.Generator().manual_seed(seed)
    bf16, fp32 = [], []
    for _ in range(scale):
        for shape in SHAPES:
            bf16.append(torch.nn.Parameter(torch.randn(shape, generator=g).bfloat16()))
            fp32.append(torch.nn.Parameter(torch.randn(shape, generator=g)))
    params = [p for pair in zip(bf16, fp32, strict=True) for p in pair]
    half = len(params) // 2
    groups = [
        {"params": params[:half]},
        {"params": params[half:], "lr": 3e-3, "weight_decay": 0.0},
    ]
    return params, groups


def _optimizer(groups, impl, mode, **kwargs):
    return AdamW(groups, lr=1e-2, weight_decay=0.1, seed=5, impl=impl, **MODES[mode], **kwargs)


def _gradients(params, step, nonfinite=False):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        grad = torch.randn(p.shape, generator=g)
        if nonfinite:
            grad.view(-1)[0] = float("nan")
            grad.view(-1)[-1] = float("inf")
        p.grad = grad.to(p.dtype)


def _run(opt, params, steps, start=0, **step_kwargs):
    for step in range(start, start + steps):
        _gradients(params, step)
        opt.step(**step_kwargs)


@pytest.mark.parametrize("mode", list(MODES))
def test_grouped_compiled_step_is_bit_identical_to_reference_and_native(mode):
    runs = {}
    for impl in IMPLS:
        params, groups = _model()
        opt = _optimizer(groups, impl, mode)
        _run(opt, params, 4)
        runs[impl] = _snapshot(opt, params)
    _assert_same(runs["compiled"], runs["reference"])
    _assert_same(runs["native"], runs["reference"])


def _wrap_calls(monkeypatch, backend):
    """Records the number of elements of each call of the compiled flat update (tensors
    aligned to blocks) and the tensors each table describes, calling the real functions
    unless ``dry["on"]``."""
    compiled = adamw_module._compiled_update(backend)
    calls, tables, dry = [], [], {"on": False}

    def counting_update(*args):
        calls.append(args[0].numel())
        if not dry["on"]:
            compiled(*args)

    build = adamw_module._flat_table

    def counting_table(hyper, keys, device):
        table = build(hyper, keys, device)
        tables.append((len(keys) - 1, table.device))  # less the one no tensor reads
        return table

    monkeypatch.setitem(adamw_module._compiled, (backend, "cpu"), counting_update)
    monkeypatch.setattr(adamw_module, "_flat_table", counting_table)
    return calls, tables, dry


class _Ops(TorchDispatchMode):
    """Counts the dispatched ops that compute or copy: every op but views (``view``,
    ``detach``, ``split``: no kernel on any device)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.namespace == "aten":
            self.count += 1
        return func(*args, **(kwargs or {}))


def _aligned(numel):
    return -(-numel // adamw_module.FLAT_BLOCK) * adamw_module.FLAT_BLOCK


def test_a_compiled_step_makes_one_call_per_group_whatever_the_number_of_tensors(monkeypatch):
    # Note: through torch.compile's "eager" backend, which runs the traced graph as is: the
    # calls do not depend on the backend, and inductor's results are tested above.
    calls, tables, dry = _wrap_calls(monkeypatch, "eager")
    ops = {}
    for scale in (2, 4, 16):
        params, groups = _model(scale)
        opt = _optimizer(groups, "compiled", "bf16-sr", compile_backend="eager")
        _run(opt, params, 2)
        calls.clear(), tables.clear()
        _run(opt, params, 1, start=2)
        # two param groups, each of bf16 and fp32 tensors: four calls, each on one flat
        # buffer of all its tensors, and one table for each
        expected = [
            [
                sum(_aligned(p.numel()) for p in g["params"] if p.dtype == dtype),
                sum(p.dtype == dtype for p in g["params"]),
            ]
            for g in groups
            for dtype in (torch.bfloat16, torch.float32)
        ]
        assert len(groups[0]["params"]) == 3 * scale
        assert sorted(calls) == sorted(numel for numel, _ in expected)
        assert sorted(n for n, _ in tables) == sorted(n for _, n in expected)
        assert {device for _, device in tables} == {torch.device("cpu")}
        # The ops dispatched around the calls. Note: the compiled call itself is left out
        # (dynamo does not run under a Python dispatch mode).
        _gradients(params, 3)
        dry["on"] = True
        with _Ops() as counted:
            opt.step()
        dry["on"] = False
        ops[scale] = counted.count
    # they do not grow with the number of tensors either
    assert ops[2] == ops[4] == ops[16], ops


@pytest.mark.parametrize("mode", list(MODES))
def test_groups_larger_than_a_bucket_are_updated_in_calls_of_consecutive_tensors(monkeypatch, mode):
    # Note: inductor, whose float32 square root is correctly rounded as the reference's;
    # the "eager" backend's is not in every torch build.
    calls, _, _ = _wrap_calls(monkeypatch, "inductor")
    # buckets of at most 4 blocks, unless one tensor has more: the 48 x 32 tensors take 2
    # blocks each, the others 1
    monkeypatch.setattr(adamw_module, "FLAT_BUCKET", 4 * adamw_module.FLAT_BLOCK)
    runs = {}
    for impl in ("reference", "compiled"):
        params, groups = _model(4)
        opt = _optimizer(groups, impl, mode)
        _run(opt, params, 3)
        runs[impl] = _snapshot(opt, params)
    _assert_same(runs["compiled"], runs["reference"])
    # every call holds at most 4 blocks, and the calls cover each group's tensors
    per_step = len(calls) // 3
    assert max(calls) <= 4 * adamw_module.FLAT_BLOCK
    assert sum(calls[:per_step]) == sum(_aligned(p.numel()) for p in params)
    assert per_step > 4  # more than one call per group


def test_one_compiled_graph_serves_groups_of_any_size(monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(adamw_module, "_compiled", {})
    torch._dynamo.reset()
    counters.clear()
    for scale in (2, 4):
        params, groups = _model(scale)
        opt = _optimizer(groups, "compiled", "bf16-sr")  # inductor
        _run(opt, params, 2)
        reference_params, reference_groups = _model(scale)
        _run(_optimizer(reference_groups, "reference", "bf16-sr"), reference_params, 2)
        for a, b in zip(params, reference_params, strict=True):
            assert torch.equal(_bits(a), _bits(b))
    # one graph for the bf16 groups, one for the fp32 groups, whatever their sizes
    assert counters["stats"]["unique_graphs"] == 2


class _ScalarReads(TorchDispatchMode):
    """Counts dispatched scalar reads (``.item()``, ``float(tensor)``): each one waits for
    the device that holds the tensor."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _prepared(impl):
    """An optimizer one step in (kernels built, graphs compiled), with a tensor lr, and
    gradients for the next step."""
    params, groups = _model()
    groups[1]["lr"] = torch.tensor(3e-3)
    opt = _optimizer(groups, impl, "bf16-sr")
    _run(opt, params, 1)
    _run(opt, params, 1, start=1, skip=torch.tensor(False))
    _gradients(params, 2)
    return opt


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_a_step_dispatches_no_scalar_read(impl):
    opt = _prepared(impl)
    with _ScalarReads() as reads:
        float(torch.tensor(1.0))  # the counter sees a read
        assert reads.count == 1
        opt.step()
        opt.step(skip=torch.tensor(False))
    assert reads.count == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_a_step_makes_no_scalar_read_inside_or_outside_compiled_code(impl):
    # Note: the profiler, as torch.compile refuses to trace under a Python dispatch mode;
    # it records every dispatched op, those of the compiled code included.
    opt = _prepared(impl)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
        opt.step(skip=torch.tensor(False))
        float(torch.tensor(1.0))  # the profiler sees a read
    names = [e.name for e in prof.events()]
    assert names.count("aten::_local_scalar_dense") == 1


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_skipped_step_keeps_every_tensor_bit_for_bit_even_with_nonfinite_gradients(impl, mode):
    params, groups = _model()
    opt = _optimizer(groups, impl, mode)
    _run(opt, params, 1)
    before = [_bits(t) for p in params for t in [p, *opt.state[p].values()] if t.dim()]
    for nonfinite in (False, True):
        _gradients(params, 1, nonfinite=nonfinite)
        opt.step(skip=torch.tensor(True))
    after = [_bits(t) for p in params for t in [p, *opt.state[p].values()] if t.dim()]
    _assert_same(after, before)
    # the step counts still advance: bias correction counts attempted steps
    assert all(opt.state[p]["step"].item() == 3 for p in params)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_with_skip_false_equals_a_plain_step(impl, mode):
    runs = []
    for skip in (None, torch.tensor(False)):
        params, groups = _model()
        opt = _optimizer(groups, impl, mode)
        _run(opt, params, 3, skip=skip)
        runs.append(_snapshot(opt, params))
    _assert_same(*runs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_clip_coefficient_gives_the_step_after_clipping_in_place_bit_for_bit(impl, mode):
    """``step(clip_coef=c)`` against ``clip_grad_norm_`` (the gradients multiplied in place
    by the same coefficient, in their own dtype) then ``step()``, on every path, over steps
    that clip (coefficients under 1, rounded to bf16 for bf16 gradients) and one that does
    not (1); the compiled path's later steps run its steady form."""
    from hlat_optim import clip_coefficient, clip_grad_norm_, global_norm

    runs = []
    for fused in (False, True):
        params, groups = _model()
        opt = _optimizer(groups, impl, mode)
        for step, max_norm in enumerate((0.3, 1.7, 1e6, 0.05)):
            _gradients(params, step)
            if fused:
                before = [p.grad.clone() for p in params]
                coef = clip_coefficient(global_norm(params, [p.grad for p in params]), max_norm)
                opt.step(clip_coef=coef)
                if impl == "native":  # the kernel reads the gradients, leaving them as they were
                    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))
            else:
                clip_grad_norm_(params, max_norm)
                opt.step()
        runs.append(_snapshot(opt, params))
    _assert_same(*runs)


def test_clip_coef_must_be_a_0d_float_tensor_and_on_the_cpu_for_cpu_parameters():
    params, groups = _model()
    opt = _optimizer(groups, "native", "bf16-sr")
    _gradients(params, 0)
    with pytest.raises(TypeError, match=r"clip_coef must be a 0-d floating-point tensor, got a"):
        opt.step(clip_coef=torch.tensor([0.5]))
    with pytest.raises(TypeError, match=r"got float"):
        opt.step(clip_coef=0.5)
    assert not opt.state
    with pytest.raises(ValueError, match=r"clip_coef is on meta but parameter 0 is on the CPU"):
        opt.step(clip_coef=torch.tensor(0.5, device="meta"))
    assert all(not state for state in opt.state.values())


@pytest.mark.parametrize("mode", list(MODES))
def test_grouped_resume_from_state_dict_is_bit_identical_to_an_uninterrupted_run(mode):
    params, groups = _model()
    opt = _optimizer(groups, "compiled", mode)
    _run(opt, params, 3)
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    _run(opt, params, 3, start=3)

    buf.seek(0)
    saved = torch.load(buf)
    resumed, groups = _model(seed=1)  # other values, overwritten from the checkpoint
    with torch.no_grad():
        for p, value in zip(resumed, saved["params"], strict=True):
            p.copy_(value)
    opt2 = AdamW(groups, impl="compiled", **MODES[mode])  # seed and lr from the checkpoint
    opt2.load_state_dict(saved["opt"])
    _run(opt2, resumed, 3, start=3)
    _assert_same(_snapshot(opt2, resumed), _snapshot(opt, params))


def test_a_step_count_saved_in_another_form_loads_as_a_cpu_float32_count():
    params, groups = _model()
    opt = _optimizer(groups, "reference", "bf16-sr")
    _run(opt, params, 2)
    expected = _snapshot(opt, params)
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["step"] = 2  # a plain number
    state["state"][1]["step"] = torch.tensor(2, dtype=torch.int64)
    opt.load_state_dict(state)
    for p in params:
        step = opt.state[p]["step"]
        assert (step.dtype, step.device.type, step.dim()) == (torch.float32, "cpu", 0)
    _assert_same(_snapshot(opt, params), expected)


def test_skip_must_be_a_0d_bool_tensor():
    params, groups = _model()
    opt = _optimizer(groups, "reference", "bf16-sr")
    _gradients(params, 0)
    with pytest.raises(TypeError, match=r"skip must be a 0-d torch.bool tensor, got a torch.int64"):
        opt.step(skip=torch.tensor(1))
    with pytest.raises(TypeError, match=r"got a torch.bool tensor of shape \(1,\)"):
        opt.step(skip=torch.tensor([True]))
    with pytest.raises(TypeError, match=r"got bool"):
        opt.step(skip=True)
    assert not opt.state  # nothing was touched


def test_skip_on_another_device_than_cpu_parameters_is_rejected_before_any_change():
    params, groups = _model()
    opt = _optimizer(groups, "native", "bf16-sr")
    _run(opt, params, 1)
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=r"skip is on meta but parameter 0 is on the CPU"):
        opt.step(skip=torch.tensor(True, device="meta"))
    _assert_same(_snapshot(opt, params), before)


# Graphs compiled through the "hlat-recording" backend: inductor, with a record of each graph.
_RECORDED = []


def _recording_inductor(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    _RECORDED.append(len(example_inputs))
    return compile_fx(gm, example_inputs)


def test_compile_backend_chooses_the_torch_compile_backend():
    if "hlat-recording" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_recording_inductor, name="hlat-recording")
    _RECORDED.clear()
    runs = []
    for impl, backend in (("compiled", "hlat-recording"), ("reference", None)):
        params, groups = _model()
        opt = _optimizer(groups, impl, "bf16-sr", compile_backend=backend)
        _run(opt, params, 2)
        runs.append(_snapshot(opt, params))
    assert len(_RECORDED) == 2  # one graph per group
    _assert_same(*runs)

    params, groups = _model()
    _gradients(params, 0)
    opt = _optimizer(groups, "compiled", "bf16-sr", compile_backend="no-such-backend")
    with pytest.raises(Exception, match="no-such-backend"):
        opt.step()
    with pytest.raises(ValueError, match=r"compile_backend must be the name of a torch.compile"):
        _optimizer(groups, "compiled", "bf16-sr", compile_backend="")


def _storages(opt, params):
    return {
        opt.state[p][name].untyped_storage().data_ptr()
        for p in params
        for name in ("exp_avg", "exp_avg_sq")
    }


@pytest.mark.parametrize("mode", list(MODES))
def test_a_parameter_without_a_gradient_in_some_steps_is_updated_as_by_the_reference(mode):
    runs = {}
    for impl in ("reference", "compiled"):
        params, groups = _model(2)
        opt = _optimizer(groups, impl, mode)
        for step in range(5):
            _gradients(params, step)
            if step in (2, 3):
                params[0].grad = None  # this step leaves the first parameter out
            if step == 3:
                params[5].grad = None
            opt.step()
            if impl == "compiled":
                # the states of a step's tensors share one buffer per param group, dtype and
                # step count (the tensors that missed steps count fewer); the tensors left
                # out keep states of their own, in no shared buffer
                stepped = [p for p in params if p.grad is not None]
                left_out = [p for p in params if p.grad is None]
                kinds = {
                    (i, p.dtype, opt.state[p]["step"].item())
                    for i, g in enumerate(groups)
                    for p in g["params"]
                    if p.grad is not None
                }
                assert len(_storages(opt, stepped)) == 2 * len(kinds)
                for p in left_out:
                    for name in ("exp_avg", "exp_avg_sq"):
                        state = opt.state[p][name]
                        assert state.untyped_storage().nbytes() == state.nbytes
        runs[impl] = _snapshot(opt, params)
    _assert_same(runs["compiled"], runs["reference"])


def test_flat_states_are_views_of_one_buffer_per_state_and_save_and_load_as_tensors():
    params, groups = _model(2)
    opt = _optimizer(groups, "compiled", "mixed")
    _run(opt, params, 2)
    bf16 = [p for p in groups[0]["params"] if p.dtype == torch.bfloat16]
    # exp_avg, exp_avg_sq and master weights: one buffer each for these parameters
    assert len({opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in bf16}) == 1
    assert len({opt.state[p]["master"].untyped_storage().data_ptr() for p in bf16}) == 1
    for p in bf16:
        assert opt.state[p]["exp_avg"].shape == p.shape
    # a state dict loaded into a new optimizer is copied into new flat buffers on its first
    # step, and the run goes on as the uninterrupted one
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt2 = _optimizer(groups, "compiled", "mixed")
    opt2.load_state_dict(torch.load(buf))
    assert opt2.state[bf16[0]]["exp_avg"].untyped_storage().data_ptr() not in _storages(opt, bf16)
    reference = copy.deepcopy(opt.state_dict())
    _gradients(params, 2)
    before = [p.detach().clone() for p in params]
    opt.step()
    after = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, b in zip(params, before, strict=True):
            p.copy_(b)
    opt2.step()
    for p, a in zip(params, after, strict=True):
        assert torch.equal(_bits(p), _bits(a))
    assert len({opt2.state[p]["exp_avg"].untyped_storage().data_ptr() for p in bf16}) == 1
    assert reference["state"][0]["exp_avg"].shape == params[0].shape
