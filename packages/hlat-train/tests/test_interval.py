"""``checkpoint.every = "auto"``: Daly's interval (checked against the formula worked by
hand and against a brute-force search of the same cost model), and a real run whose
checkpoints follow the intervals it logs."""

from __future__ import annotations

import math

import pytest
from train_helpers import tiny_config

from hlat_train import ConfigError, Trainer, read_metrics
from hlat_train.interval import daly_interval, expected_utilisation, plan_interval
from hlat_train.validation import validate


def test_daly_interval_matches_the_formula_and_young_for_small_stalls():
    # d = 30 s, M = 6 h: sqrt(2 * 30 * 21600) = 1138.42; d / 2M = 30 / 43200
    r = 30 / 43200
    assert daly_interval(30, 21600) == pytest.approx(
        1138.4199 * (1 + math.sqrt(r) / 3 + r / 9) - 30, rel=1e-6
    )
    assert daly_interval(1, 1e6) == pytest.approx(math.sqrt(2 * 1 * 1e6), rel=1e-3)  # Young
    assert daly_interval(100, 40) == 40  # a stall longer than 2 MTBF: checkpoint every MTBF


def test_the_interval_is_near_the_best_of_the_utilisation_model():
    stall, restart, mtbf = 20.0, 300.0, 12 * 3600.0
    best = max(range(60, 20000, 5), key=lambda t: expected_utilisation(t, stall, restart, mtbf))
    chosen = daly_interval(stall, mtbf)
    assert abs(chosen - best) / best < 0.02
    assert expected_utilisation(chosen, stall, restart, mtbf) == pytest.approx(
        expected_utilisation(best, stall, restart, mtbf), abs=1e-4
    )


def test_an_async_save_waits_for_its_write_before_the_next():
    planned = plan_interval(stall_s=0.5, write_s=120.0, step_s=2.0, restart_s=60, mtbf_hours=1)
    assert planned.interval_s == 120.0 and planned.every == 60
    quick = plan_interval(stall_s=0.5, write_s=1.0, step_s=2.0, restart_s=60, mtbf_hours=1)
    assert quick.every == round(daly_interval(0.5, 3600) / 2.0)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("--checkpoint.every=often", "a number of steps or 'auto'"),
        ("--checkpoint.every=0", "at least 1"),
        ("--checkpoint.mtbf_hours=0", "mtbf_hours must be a finite number > 0"),
        ("--checkpoint.preempt_budget=-1", "preempt_budget must be at least 0"),
    ],
)
def test_bad_interval_settings_are_refused(corpus, tmp_path, override, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(tiny_config(corpus, tmp_path, override), 1)


@pytest.mark.slow
def test_a_run_with_an_automatic_interval_saves_where_its_log_says(corpus, tmp_path):
    # Note: an MTBF of 3.6 ms makes Young/Daly's interval a few steps of the tiny model
    # whatever the machine's load does to its step and save times, so several plans follow
    mtbf_hours = 1e-6
    config = tiny_config(
        corpus,
        tmp_path,
        "--checkpoint.every=auto",
        "--checkpoint.async_save=false",
        "--checkpoint.keep_last=100",
        f"--checkpoint.mtbf_hours={mtbf_hours}",
        "--logging.every=10",
        steps=90,
    )
    assert config.checkpoint.every == "auto"
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.close()
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    saved = [r["step"] for r in records if r["kind"] == "checkpoint"]
    plans = [r for r in records if r["kind"] == "checkpoint_interval"]
    assert saved[0] == 50  # the first save, before anything is measured
    assert plans and plans[0]["step"] == 50
    for plan in plans:
        assert 0 <= plan["utilisation"] <= 1 and plan["stall_s"] > 0 and plan["restart_s"] > 0
        assert plan["every"] == max(
            1, round(daly_interval(plan["stall_s"], mtbf_hours * 3600) / plan["step_s"])
        )
    # the saves are exactly the chain the plans announced, then the final step
    chain = [50]
    by_step = {plan["step"]: plan["every"] for plan in plans}
    while chain[-1] in by_step and chain[-1] + by_step[chain[-1]] < 90:
        chain.append(chain[-1] + by_step[chain[-1]])
    assert saved == [*chain, 90]
    assert len(saved) >= 3, f"no planned save before the end: {plans}"


def test_plan_reports_the_interval_rule_of_the_preset():
    from hlat_train import TrainConfig
    from hlat_train.plan import checkpoint_interval_note

    note = checkpoint_interval_note(TrainConfig.preset("hlat-7b", []))
    minutes = daly_interval(30, 12 * 3600) / 60
    assert "auto" in note and "mtbf_hours 12" in note and f"30 s -> {minutes:.0f} min" in note
    fixed = checkpoint_interval_note(TrainConfig.preset("tiny-check", []))
    assert fixed == "checkpoint.every: every 10 steps (fixed)"
