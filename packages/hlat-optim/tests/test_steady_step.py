"""The compiled path's later steps: they reuse the first step's work while nothing it depends
on changes, and any change between steps is stepped exactly as the eager reference steps it
(CPU tensors, the compiled path through inductor)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from hlat_optim import AdamW
from hlat_optim.adamw import _step_key, _step_keys

sys.path.insert(0, str(Path(__file__).parent))
from optim_bits import assert_same as _assert_same
from optim_bits import snapshot as _snapshot

SHAPES = [(48, 32), (32,), (7, 5)]


def _model(seed=0):
    """bf16 and fp32 parameters in two param groups with different hyperparameters."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(2):
        for shape in SHAPES:
            params.append(torch.nn.Parameter(torch.randn(shape, generator=g).bfloat16()))
            params.append(torch.nn.Parameter(torch.randn(shape, generator=g)))
    groups = [
        {"params": params[:6]},
        {"params": params[6:], "lr": 3e-3, "weight_decay": 0.0},
    ]
    return params, groups


def _gradients(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _count_full_steps(monkeypatch):
    """Counts the parameters the full path of ``step()`` prepares (``AdamW._locals``)."""
    calls = []
    original = AdamW._locals

    def counting(self, p, state, index):
        calls.append(index)
        return original(self, p, state, index)

    monkeypatch.setattr(AdamW, "_locals", counting)
    return calls


@pytest.mark.parametrize("options", [{}, {"master_weights": True}, {"kahan_sum": True}])
def test_later_compiled_steps_reuse_the_first_steps_work_and_equal_the_reference(
    monkeypatch, options
):
    prepared = _count_full_steps(monkeypatch)
    runs = {}
    for impl in ("reference", "compiled"):
        params, groups = _model()
        opt = AdamW(groups, lr=1e-2, weight_decay=0.1, seed=5, impl=impl, **options)
        for step in range(4):
            prepared.clear()
            _gradients(params, step)
            opt.step(skip=torch.tensor(step == 2))
            if impl == "compiled":
                # the first step prepares every parameter, the later ones none
                assert len(prepared) == (len(params) if step == 0 else 0), step
        runs[impl] = _snapshot(opt, params)
    _assert_same(runs["compiled"], runs["reference"])


def _replace_data(opt, params, new):
    with torch.no_grad():
        params[2].data = params[2].data.clone()  # same values, other memory


def _replace_state(opt, params, new):
    state = opt.state[params[0]]
    state["exp_avg"] = state["exp_avg"].clone()


def _change_step_count(opt, params, new):
    opt.state[params[3]]["step"].add_(5.0)


def _drop_gradient(opt, params, new):
    params[1].grad = None


def _reload_state(opt, params, new):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _add_param_group(opt, params, new):
    opt.add_param_group({"params": [new], "lr": 2e-3})
    params.append(new)


def _change_lr(opt, params, new):
    opt.param_groups[0]["lr"] = 5e-3


def _transpose_gradient(opt, params, new):
    params[0].grad = params[0].grad.t().contiguous().t()  # the same values, other strides


CHANGES = {
    "p.data replaced": _replace_data,
    "a state replaced": _replace_state,
    "a step count changed": _change_step_count,
    "a gradient missing": _drop_gradient,
    "the state dict reloaded": _reload_state,
    "a param group added": _add_param_group,
    "lr changed": _change_lr,
    "a gradient in another layout": _transpose_gradient,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_steps_is_stepped_as_by_the_reference(change):
    runs = {}
    for impl in ("reference", "compiled"):
        params, groups = _model()
        new = torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(9)))
        opt = AdamW(groups, lr=1e-2, weight_decay=0.1, seed=5, impl=impl)
        for step in range(5):
            _gradients(params, step)
            if step == 2:
                CHANGES[change](opt, params, new)
            opt.step()
        runs[impl] = _snapshot(opt, params)
    _assert_same(runs["compiled"], runs["reference"])


def test_the_vectorised_rounding_keys_equal_the_per_parameter_ones():
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(0, 1 << 20, (64,), generator=g)
    salts = torch.cat([torch.zeros(32, dtype=torch.int64), torch.randint(0, 1 << 40, (32,))])
    for seed in (0, 7, -5, (1 << 31) - 1, (1 << 32) + 3):
        for step in (1, 2, 1000, 1 << 24):
            keys = _step_keys(seed, step, indices, salts).tolist()
            expected = [
                _step_key(seed, step, i, s)
                for i, s in zip(indices.tolist(), salts.tolist(), strict=True)
            ]
            assert keys == expected
