"""docs/reuse/hf_trainer_hlat_optim.py: hlat-optim inside Hugging Face's Trainer, which saves
and restores its state through its own checkpoints."""

import pytest
import torch

pytest.importorskip("transformers", reason="the example needs transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")


def test_trainer_trains_with_hlat_adamw_and_resumes_its_state_bit_for_bit(tmp_path, reuse_example):
    from hlat_optim import AdamW

    example = reuse_example("hf_trainer_hlat_optim")
    whole = example.train(str(tmp_path / "whole"))
    assert isinstance(whole.optimizer.optimizer, AdamW)  # accelerate wraps, does not replace
    losses = [r["loss"] for r in whole.state.log_history if "loss" in r]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < losses[0] - 0.8
    assert {p.dtype for p in whole.model.parameters()} == {torch.bfloat16}

    resumed = example.train(
        str(tmp_path / "whole"), resume=str(tmp_path / "whole" / "checkpoint-6")
    )
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = whole.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[i][name], sb[i][name]), (i, name)
