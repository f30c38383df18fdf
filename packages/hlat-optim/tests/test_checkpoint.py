"""Resume through torch.distributed.checkpoint files, the way a trainer checkpoints."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hlat_optim import AdamW, cosine_with_warmup


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)).to(torch.bfloat16)


def _train(model, opt, sched, steps, start):
    g = torch.Generator().manual_seed(1)
    for i in range(start + steps):
        x = torch.randn(4, 16, generator=g).bfloat16()
        if i < start:
            continue
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process on purpose
@pytest.mark.parametrize("kwargs", [{}, {"master_weights": True}], ids=["bf16-sr", "mixed"])
def test_dcp_checkpoint_resume_is_bit_exact(tmp_path, kwargs):
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, seed=7, impl="reference", **kwargs)
    sched = cosine_with_warmup(opt, warmup_steps=2, total_steps=20)
    _train(model, opt, sched, 4, start=0)
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=tmp_path,
    )
    sched_state = sched.state_dict()
    _train(model, opt, sched, 4, start=4)

    resumed = _model()
    opt2 = AdamW(resumed.parameters(), lr=1e-2, seed=0, impl="reference", **kwargs)
    sched2 = cosine_with_warmup(opt2, warmup_steps=2, total_steps=20)
    state = {
        "model": get_model_state_dict(resumed),
        "optim": get_optimizer_state_dict(resumed, opt2),
    }
    dcp.load(state, checkpoint_id=tmp_path)
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, opt2, state["optim"])
    sched2.load_state_dict(sched_state)
    _train(resumed, opt2, sched2, 4, start=4)

    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        for name, value in opt.state[a].items():
            assert torch.equal(opt2.state[b][name], value), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process on purpose
def test_a_checkpoint_without_master_weights_resumes_into_master_weights_as_documented(tmp_path):
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, seed=7)
    sched = cosine_with_warmup(opt, warmup_steps=2, total_steps=20)
    _train(model, opt, sched, 4, start=0)
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=tmp_path,
    )

    torch.manual_seed(1)  # weights unlike the checkpoint's until it is loaded
    resumed = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32))
    resumed = resumed.to(torch.bfloat16)
    opt2 = AdamW(resumed.parameters(), lr=1e-2, master_weights=True)
    state = {
        "model": get_model_state_dict(resumed),
        "optim": get_optimizer_state_dict(resumed, opt2),
    }
    # the README's order: no master weights asked of the checkpoint, the model set first
    optim = state["optim"]
    optim["state"] = {
        key: {name: value for name, value in entry.items() if name != "master"}
        for key, entry in optim["state"].items()
    }
    dcp.load(state, checkpoint_id=tmp_path)
    set_model_state_dict(resumed, state["model"])
    with pytest.warns(UserWarning, match="made fp32 master weights from the parameters"):
        set_optimizer_state_dict(resumed, opt2, state["optim"])

    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt2.state[b]["master"], b.detach().float())
        for name, value in opt.state[a].items():
            assert torch.equal(opt2.state[b][name], value), name
    # the next step is the saved run's update, rounded to nearest instead of stochastically
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    for m, o in ((model, opt), (resumed, opt2)):
        m(x).float().square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=2**-7, atol=0)
