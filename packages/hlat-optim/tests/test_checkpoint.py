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
