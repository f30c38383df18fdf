"""ZeRO-1 (``parallel.dp_shard = "zero1"``) through the trainer: a run resumed from its
checkpoint continues as the uninterrupted run does. The trainer builds the optimizer before
it loads the checkpoint, so the step after the load must update the loaded weights."""

from __future__ import annotations

import pytest
import torch
from train_helpers import fit, tiny_config

from hlat_ckpt import consolidate
from hlat_train import read_metrics

HORIZON = "--optim.decay_steps=6"  # the same LR schedule whatever train.steps says
ZERO1 = "--parallel.dp_shard=zero1"


def _losses(out) -> list[float]:
    records = read_metrics(str(out / "metrics.jsonl"))
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.mark.parametrize("precision", ["fp32", "bf16-sr"])
def test_a_zero1_run_resumed_from_its_checkpoint_continues_identically(corpus, tmp_path, precision):
    settings = (HORIZON, ZERO1, f"--optim.precision={precision}")
    full = fit(tiny_config(corpus, tmp_path / "full", *settings, steps=6))
    fit(tiny_config(corpus, tmp_path / "split", *settings, steps=4))
    resumed = fit(tiny_config(corpus, tmp_path / "split", *settings, steps=6))
    assert full["resumed_from"] is None and resumed["resumed_from"] == 4
    assert _losses(tmp_path / "split") == _losses(tmp_path / "full")
    a = consolidate(str(tmp_path / "full" / "checkpoints"))["model"]
    b = consolidate(str(tmp_path / "split" / "checkpoints"))["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
