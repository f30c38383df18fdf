import math

import pytest
import torch

from hlat_optim import CosineWithWarmup, cosine_with_warmup


def _lrs(steps, **kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    sched = cosine_with_warmup(opt, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_rises_linearly_from_zero_to_the_peak():
    lrs = _lrs(30, warmup_steps=10, total_steps=20)
    assert lrs[0] == 0.0
    assert lrs[5] == pytest.approx(3e-4 * 5 / 10)
    assert lrs[10] == pytest.approx(3e-4)


def test_cosine_decays_to_min_ratio_and_stays_flat():
    lrs = _lrs(40, warmup_steps=10, total_steps=30, min_lr_ratio=0.1)
    mid = 3e-5 + (3e-4 - 3e-5) * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert lrs[20] == pytest.approx(mid)
    quarter = 3e-5 + (3e-4 - 3e-5) * 0.5 * (1 + math.cos(math.pi * 0.25))
    assert lrs[15] == pytest.approx(quarter)
    assert lrs[30] == pytest.approx(3e-5)
    assert lrs[39] == pytest.approx(3e-5)


def test_constant_phase_holds_the_peak_before_decay():
    lrs = _lrs(30, warmup_steps=5, total_steps=25, constant_steps=10)
    assert lrs[5] == lrs[14] == pytest.approx(3e-4)
    assert lrs[16] < 3e-4


def test_hlat_values_reach_3e_4_at_step_2000_and_3e_5_at_the_end():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    lam = cosine_with_warmup(opt, warmup_steps=2000, total_steps=500_000).lr_lambdas[0]
    assert 3e-4 * lam(2000) == pytest.approx(3e-4)
    assert 3e-4 * lam(500_000) == pytest.approx(3e-5)
    assert 3e-4 * lam(1000) == pytest.approx(1.5e-4)


def test_schedule_state_round_trips_through_state_dict():
    params = [torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD(params, lr=1.0)
    sched = cosine_with_warmup(opt, warmup_steps=3, total_steps=10)
    for _ in range(5):
        opt.step()
        sched.step()
    opt2 = torch.optim.SGD(params, lr=1.0)
    sched2 = cosine_with_warmup(opt2, warmup_steps=3, total_steps=10)
    sched2.load_state_dict(sched.state_dict())
    opt2.load_state_dict(opt.state_dict())
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_total_steps_shorter_than_warmup_is_rejected():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="total_steps \\(10\\) is shorter"):
        cosine_with_warmup(opt, warmup_steps=8, total_steps=10, constant_steps=5)


@pytest.mark.parametrize("saved_by", ["this version", "an older version"])
def test_a_resumed_schedule_follows_its_own_configuration_from_the_saved_position(saved_by):
    # 50 steps of a 100-step schedule resumed into a 1000-step one: the 1000-step cosine
    # from step 50 on, as Hugging Face's schedules do
    def schedule(total_steps):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return opt, cosine_with_warmup(opt, 10, total_steps, min_lr_ratio=0.0)

    opt, sched = schedule(100)
    for _ in range(50):
        opt.step()
        sched.step()
    saved = sched.state_dict()
    assert saved["lr_lambdas"] == [{}]  # the position only
    if saved_by == "an older version":
        config = dict(warmup_steps=10, total_steps=100, min_lr_ratio=0.0, constant_steps=0)
        saved["lr_lambdas"] = [config]
    opt2, sched2 = schedule(1000)
    sched2.load_state_dict(saved)
    opt2.step()
    sched2.step()
    assert sched2.last_epoch == 51
    assert sched2.lr_lambdas[0].total_steps == 1000
    assert opt2.param_groups[0]["lr"] == CosineWithWarmup(10, 1000, 0.0, 0)(51)


def test_a_multiplier_pickles_and_one_pickled_before_0_12_still_computes():
    import copy
    import pickle

    fn = CosineWithWarmup(warmup_steps=10, total_steps=100, min_lr_ratio=0.1, constant_steps=5)
    steps = [0, 5, 12, 40, 100, 150]
    for twin in (pickle.loads(pickle.dumps(fn)), copy.deepcopy(fn)):
        assert [twin(s) for s in steps] == [fn(s) for s in steps]
    # what a pickle of a version before 0.12 (configuration in __dict__) gives __setstate__
    old = CosineWithWarmup.__new__(CosineWithWarmup)
    old.__setstate__(
        {"warmup_steps": 10, "total_steps": 100, "min_lr_ratio": 0.1, "constant_steps": 5}
    )
    assert [old(s) for s in steps] == [fn(s) for s in steps]
    assert old.__dict__ == {}
