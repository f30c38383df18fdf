"""The loss-spike guard: detection, and each policy on a real run with an injected spike."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from train_helpers import tiny_config

from hlat_ckpt import consolidate
from hlat_train import SpikeGuard, Trainer, read_metrics
from hlat_train.spike import GUARD_FILE


def _t(x: float) -> torch.Tensor:
    return torch.tensor(x)


def test_loss_far_above_the_running_band_is_a_spike():
    guard = SpikeGuard(window=20, k=4.0, min_history=5)
    for loss in (3.0, 3.1, 2.9, 3.05, 2.95, 3.0):
        assert not guard.check(_t(loss), _t(1.0))
        guard.accept(_t(loss))
    assert not guard.check(_t(3.2), _t(1.0))
    assert guard.check(_t(4.0), _t(1.0))
    assert 3.0 < guard.limit() < 4.0


def test_non_finite_loss_or_grad_norm_is_a_spike_even_without_history():
    guard = SpikeGuard(min_history=10)
    assert guard.check(_t(3.0), _t(math.inf))
    assert guard.check(_t(math.nan), _t(1.0))
    assert not guard.check(_t(30.0), _t(1.0))  # too little history to judge a loss


def test_the_verdict_is_a_device_tensor_and_a_spike_is_kept_out_of_the_window():
    guard = SpikeGuard(window=4, k=3.0, min_history=2)
    for loss in (1.0, 1.1, 0.9):
        guard.accept(_t(loss))
    verdict = guard.check(_t(50.0), _t(1.0))
    assert verdict.dtype == torch.bool and verdict.dim() == 0 and verdict
    guard.accept(_t(50.0), ~verdict)  # rejected: the window does not move
    assert guard.state_dict()["losses"] == pytest.approx([1.0, 1.1, 0.9])


def _level_shift(guard: SpikeGuard, burst: int, steps: int = 300) -> list[bool]:
    """Verdicts of ``steps`` losses after 200 at 2.0 +- 0.01: ``burst`` of them at 2.15,
    then back to 2.0 (``burst = steps``: the level stays at 2.15)."""
    gen = torch.Generator().manual_seed(0)
    verdicts = []
    for i in range(200 + steps):
        level = 2.15 if 200 <= i < 200 + burst else 2.0
        loss = _t(level + 0.01 * float(torch.randn((), generator=gen)))
        spike = guard.check(loss, _t(1.0))
        guard.accept(loss, ~spike)
        if i >= 200:
            verdicts.append(bool(spike))
    return verdicts


def test_a_lasting_new_loss_level_is_learned_instead_of_flagged_forever():
    guard = SpikeGuard(window=50, k=6.0, min_history=10, new_level_after=10)
    verdicts = _level_shift(guard, burst=300)
    assert all(verdicts[:10])  # the first new_level_after steps of the new level are flagged
    assert sum(verdicts) < 25 and not any(verdicts[25:]), verdicts
    assert guard.limit() > 2.15  # the band has moved to the new level
    never = SpikeGuard(window=50, k=6.0, min_history=10, new_level_after=0)
    assert all(_level_shift(never, burst=300))


def test_a_burst_shorter_than_new_level_after_stays_out_of_the_window():
    guard = SpikeGuard(window=50, k=6.0, min_history=2, new_level_after=10)
    verdicts = _level_shift(guard, burst=9, steps=20)
    assert verdicts[:9] == [True] * 9 and not any(verdicts[9:])
    assert max(guard.state_dict()["losses"]) < 2.1  # no loss of the burst was kept
    assert guard.state_dict()["streak"] == 0


def test_only_losses_above_the_band_count_toward_a_new_level():
    guard = SpikeGuard(window=8, k=3.0, min_history=2, new_level_after=3)
    for loss in (1.0, 1.1, 0.9, 1.0):
        guard.accept(_t(loss))
    # non-finite losses, and finite ones with a non-finite gradient norm: spikes that never
    # enter the window, nor make a following spike part of a new level
    for loss, norm in ((math.nan, 1.0), (1.0, math.inf), (1.05, math.nan)):
        verdict = guard.check(_t(loss), _t(norm))
        assert verdict
        guard.accept(_t(loss), ~verdict)
    verdict = guard.check(_t(50.0), _t(1.0))
    guard.accept(_t(50.0), ~verdict)
    assert guard.state_dict()["losses"] == pytest.approx([1.0, 1.1, 0.9, 1.0])
    assert guard.state_dict()["streak"] == 1


def test_guard_window_survives_state_dict_round_trip():
    guard = SpikeGuard(window=4, k=3.0, min_history=2)
    for loss in (1.0, 1.1, 0.9, 1.0, 1.05):
        guard.accept(_t(loss))
    restored = SpikeGuard(window=4, k=3.0, min_history=2)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    assert restored.state_dict()["losses"] == pytest.approx([1.1, 0.9, 1.0, 1.05])
    for loss in (1.2, 5.0, 1.0):
        assert bool(restored.check(_t(loss), _t(1.0))) == bool(guard.check(_t(loss), _t(1.0)))
        restored.accept(_t(loss))
        guard.accept(_t(loss))


def _run(corpus, out, policy: str, steps: int = 8, inject: int = 6):
    config = tiny_config(
        corpus,
        out,
        f"--spike.policy={policy}",
        "--spike.min_history=3",
        f"--spike.inject_at=[{inject}]",
        "--checkpoint.every=4",
        "--optim.decay_steps=8",  # the same LR schedule whatever train.steps says
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
def test_with_the_progress_bar_off_spikes_and_validation_losses_go_to_the_log(
    corpus, tmp_path, capfd
):
    _run(corpus, tmp_path, "warn")  # logging.progress = false, validation at each save (4, 8)
    logged = capfd.readouterr().err
    assert "hlat-train: step 6: 1 loss spike(s) since the last log" in logged
    for step in (4, 8):
        assert re.search(rf"hlat-train: step {step}: validation loss \d+\.\d{{4}}\n", logged)


@pytest.mark.slow
def test_skip_policy_drops_the_update_of_the_spiking_step(corpus, tmp_path):
    _, records, updates = _run(corpus, tmp_path / "skip", "skip", steps=6, inject=6)
    assert records[5]["action"] == "skip" and records[5]["step"] == 6
    assert records[5]["skipped"] == 1 and records[4]["skipped"] == 0
    assert updates == {6}  # the step counts advance on a skipped step (bias correction)
    _run(corpus, tmp_path / "clean", "warn", steps=5, inject=1000)
    skipped = consolidate(str(tmp_path / "skip" / "checkpoints"))["model"]
    clean = consolidate(str(tmp_path / "clean" / "checkpoints"))["model"]
    # the weights after the skipped step 6 are exactly those after step 5
    assert skipped.keys() == clean.keys()
    assert all(torch.equal(skipped[k], clean[k]) for k in clean)


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


@pytest.mark.slow
def test_a_crash_after_a_rollback_keeps_the_bad_batches_and_the_spent_rollbacks(
    corpus, tmp_path, monkeypatch
):
    from hlat_ckpt import Checkpointer

    original = Checkpointer.save

    def dies_at_step_8(self, step, state):
        if step == 8:
            raise KeyboardInterrupt("the node died before the next checkpoint")
        return original(self, step, state)

    monkeypatch.setattr(Checkpointer, "save", dies_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        _run(corpus, tmp_path, "rollback")  # rolls back from the spike at 6 to step 4
    monkeypatch.setattr(Checkpointer, "save", original)
    side = json.loads((tmp_path / "checkpoints" / GUARD_FILE).read_text())
    assert side["rollbacks"] == 1 and side["last_spike_step"] == 6
    assert side["bad_micro_batches"] == [5]  # step 6's one micro-batch (counted from 0)

    # the restarted run resumes from step 4 (which knows nothing of the rollback) and gets
    # the rollback state from the side file: the budget of 1 is spent, so the same spike
    # now stops the run instead of rolling back again
    config = tiny_config(
        corpus,
        tmp_path,
        "--spike.policy=rollback",
        "--spike.min_history=3",
        "--spike.inject_at=[6]",
        "--spike.max_rollbacks=1",
        "--checkpoint.every=4",
        "--optim.decay_steps=8",
        steps=8,
    )
    trainer = Trainer(config)
    try:
        with pytest.raises(RuntimeError, match="after 1 rollbacks"):
            trainer.fit()
        assert 5 in trainer.state.bad_micro_batches  # restored: never trained on again
    finally:
        trainer.close()
