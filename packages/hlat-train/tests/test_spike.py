"""The loss-spike guard: detection, and each policy on a real run with an injected spike."""

from __future__ import annotations

import math

import pytest
from train_helpers import tiny_config

from hlat_ckpt import consolidate
from hlat_train import SpikeGuard, Trainer, read_metrics


def test_loss_far_above_the_running_band_is_a_spike():
    guard = SpikeGuard(window=20, k=4.0, min_history=5)
    for loss in (3.0, 3.1, 2.9, 3.05, 2.95, 3.0):
        assert not guard.check(loss, 1.0).spike
        guard.accept(loss)
    assert not guard.check(3.2, 1.0).spike
    verdict = guard.check(4.0, 1.0)
    assert verdict.spike and "above mean" in verdict.reason


def test_non_finite_grad_norm_is_a_spike_even_without_history():
    guard = SpikeGuard(min_history=10)
    assert guard.check(3.0, math.inf).spike
    assert guard.check(math.nan, 1.0).spike
    assert not guard.check(30.0, 1.0).spike  # too little history to judge a loss


def test_guard_window_survives_state_dict_round_trip():
    guard = SpikeGuard(window=4, k=3.0, min_history=2)
    for loss in (1.0, 1.1, 0.9, 1.0, 1.05):
        guard.accept(loss)
    restored = SpikeGuard(window=4, k=3.0, min_history=2)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == {"losses": [1.1, 0.9, 1.0, 1.05]}
    assert restored.check(5.0, 1.0) == guard.check(5.0, 1.0)


def _run(corpus, out, policy: str, steps: int = 8, inject: int = 6):
    config = tiny_config(
        corpus,
        out,
        f"--spike.policy={policy}",
        "--spike.min_history=3",
        f"--spike.inject_at=[{inject}]",
        "--checkpoint.every=4",
        steps=steps,
    )
    trainer = Trainer(config)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    records = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["kind"] == "train"]
    optimizer_steps = consolidate(str(out / "checkpoints"))["optimizer"]["state"]
    updates = {int(s["step"]) for s in optimizer_steps.values()}
    return summary, records, updates


@pytest.mark.slow
def test_warn_policy_reports_the_spike_and_keeps_the_update(corpus, tmp_path):
    _, records, updates = _run(corpus, tmp_path, "warn")
    assert [r["action"] for r in records] == ["update"] * 5 + ["warn"] + ["update"] * 2
    assert updates == {8}


@pytest.mark.slow
def test_skip_policy_drops_the_update_of_the_spiking_step(corpus, tmp_path):
    _, records, updates = _run(corpus, tmp_path, "skip")
    assert records[5]["action"] == "skip" and records[5]["step"] == 6
    assert updates == {7}  # 8 steps, one update skipped


@pytest.mark.slow
def test_rollback_policy_reloads_the_checkpoint_and_skips_the_spiking_batches(corpus, tmp_path):
    baseline = tmp_path / "baseline"
    _, clean, _ = _run(corpus, baseline, "warn", inject=1000)
    summary, records, updates = _run(corpus, tmp_path / "rolled", "rollback")
    assert summary["step"] == 8
    assert updates == {8}  # steps 5 and 6 re-run after the rollback to step 4
    # the steps before the spike replay exactly; step 6 then trains on the next batch
    assert [r["loss"] for r in records[:5]] == [r["loss"] for r in clean[:5]]
    assert records[5]["loss"] != clean[5]["loss"]
    assert all(r["action"] == "update" for r in records)
    lines = (tmp_path / "rolled" / "metrics.jsonl").read_text().count('"kind": "train"')
    assert lines == 8 + 1  # step 5 logged twice: before and after the rollback


@pytest.mark.slow
def test_rollback_without_any_checkpoint_fails_clearly(corpus, tmp_path):
    with pytest.raises(RuntimeError, match="no checkpoint exists yet"):
        _run(corpus, tmp_path, "rollback", inject=4)
