"""tools/fault_campaign.py run for real: a shortened campaign (2 faults) on a 2-process
torchrun job must recover from both and end bit-identical to an uninterrupted run; another
with a SIGSTOPped rank (ended by the other rank's hang watchdog) and a NaN loss."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "fault_campaign.py"
DATA = ROOT / "tests" / "data" / "fault_campaign"
CRASH_KINDS = "kill-rank,kill-during-save,sigterm,corrupt-newest"

sys.path.insert(0, str(ROOT / "tools"))
from campaign import harness, measure, report  # noqa: E402

# every test here, its quick checks of the report included: the campaign's session runs them
pytestmark = pytest.mark.faults


def _run_quick(out: Path, seed: int, kinds: str) -> tuple[dict, Path]:
    doc = out.parent / "reliability.md"
    args = [
        "--quick",
        "--faults",
        "2",
        "--steps",
        "60",
        "--seed",
        str(seed),
        "--kinds",
        kinds,
        "--out",
        str(out),
        "--doc",
        str(doc),
    ]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "final state bit-identical: yes" in done.stdout
    return json.loads((out / "summary.json").read_text()), out


@pytest.fixture(scope="module")
def quick_campaign(tmp_path_factory) -> tuple[dict, Path]:
    return _run_quick(tmp_path_factory.mktemp("campaign") / "out", 3, CRASH_KINDS)


@pytest.fixture(scope="module")
def hang_nan_campaign(tmp_path_factory) -> tuple[dict, Path]:
    return _run_quick(tmp_path_factory.mktemp("campaign-hang") / "out", 3, "hang-rank,nan")


def test_campaign_with_two_faults_ends_bit_identical_to_an_uninterrupted_run(quick_campaign):
    summary, out = quick_campaign
    final = summary["final"]
    assert final["bit_identical"] and final["mismatches"] == []
    assert final["tensors_compared"] > 10  # model and optimizer tensors, not an empty walk
    assert final["loss_trajectory_identical"]
    assert (out / "timeline.png").stat().st_size > 10_000
    assert (out / "sensitivity.png").stat().st_size > 10_000
    assert (out.parent / "reliability" / "sensitivity.png").stat().st_size > 10_000
    assert "final state bit-identical | **yes**" in (out.parent / "reliability.md").read_text()


def test_campaign_injects_both_faults_and_reports_sane_terms(quick_campaign):
    summary, _ = quick_campaign
    c = summary["campaign"]
    assert c["faults_injected"] == 2
    assert len(c["kinds"]) == 2  # seed 3 draws two different kinds
    assert c["steps_final"] == summary["setup"]["steps"]
    assert 0 < c["productive_s"] < c["wall_s"]
    assert 0 < c["utilisation"] < 1 and 0 < summary["reference"]["utilisation"] < 1
    # restarts hold no productive step: the wall time covers both
    restarts = sum(f["restart_latency_s"] for f in summary["faults"])
    assert c["wall_s"] >= c["productive_s"] + restarts
    for fault in summary["faults"]:
        assert fault["first_step_at"] > fault["at"] > 0
        assert fault["step_at_fault"] > 0
        assert fault["restart_latency_s"] > 0
        assert fault["lost_work_s"] >= 0
        assert fault["resumed_from"] <= fault["step_at_fault"] + 1
    stall = summary["stall"]
    assert all(r["async_s"] > 0 and r["sync_s"] > 0 for r in stall["rows"])
    p = summary["projection_hlat_7b"]
    assert 0 < p["utilisation"] < 1
    assert p["every"] == "auto" and p["mtbf_hours"] == 12.0  # the hlat-7b preset's
    # the stall was measured on hlat's own model and optimizer, and scaled per byte
    assert summary["stall"]["model"].startswith("hlat_model.Llama")
    assert all(r["shape"] and r["async_write_s"] > 0 for r in summary["stall"]["rows"])
    assert p["stall_s"] > summary["stall"]["async_fixed_s"]


def test_a_stopped_rank_is_ended_by_the_watchdog_and_a_nan_is_skipped(hang_nan_campaign):
    summary, out = hang_nan_campaign
    c = summary["campaign"]
    assert summary["final"]["bit_identical"] and summary["final"]["loss_trajectory_identical"]
    assert c["kinds"] == {"hang-rank": 1, "nan": 1}
    hang = next(f for f in summary["faults"] if f["kind"] == "hang-rank")
    nan = next(f for f in summary["faults"] if f["kind"] == "nan")
    # the other rank's watchdog fired once it had made no progress for train.hang_timeout
    timeout = c["hang_timeout_s"]
    waited = re.search(r"made no progress for ([0-9.]+) s", hang["detail"])
    assert waited and float(waited.group(1)) >= timeout
    # it counts from its own last progress, which can come shortly before the SIGSTOP (the
    # healthy rank's step was under way), so the latency from the SIGSTOP can be a little
    # under the timeout; a step of this job takes well under a second
    assert timeout - 1.0 < hang["detection_latency_s"] < timeout + 10
    assert hang["restart_latency_s"] > hang["detection_latency_s"]
    assert "last activity:" in hang["detail"] and "SIGKILLed" in hang["detail"]
    assert hang["first_step_at"] > hang["at"] > 0
    # the NaN step was logged as skipped in the job, with no restart
    assert nan["step_at_fault"] == nan["at_step"] == c["nan_steps"][0]
    assert "action skip" in nan["detail"] and math.isnan(nan["restart_latency_s"])
    assert c["launches"] == 1  # torchrun restarted the workers itself
    assert c["restart_latency_median_s"] == hang["restart_latency_s"]
    doc = (out.parent / "reliability.md").read_text()
    assert "**Hangs.**" in doc and "**Non-finite losses.**" in doc


def test_nan_steps_are_planned_inside_the_run():
    fc = harness
    faults = fc.schedule(6, 1, 100, min_gap=5)
    steps = fc.plan_nan_steps(faults, every=4, steps=150)
    assert steps == [f.at_step for f in faults if f.kind == "nan"]
    assert all(4 + 2 <= s <= 148 for s in steps)
    late = [fc.Fault("nan", 500)]
    assert fc.plan_nan_steps(late, every=4, steps=60) == [58]  # never past the run


def test_schedule_is_seeded_mixes_kinds_and_fills_the_span():
    fc = harness
    a, b = fc.schedule(8, 5, 400, min_gap=6), fc.schedule(8, 5, 400, min_gap=6)
    assert [(f.kind, f.after_steps) for f in a] == [(f.kind, f.after_steps) for f in b]
    assert {f.kind for f in a} == set(fc.KINDS)
    assert all(f.after_steps >= 6 for f in a)
    assert sum(f.after_steps for f in a) == pytest.approx(400, abs=8 * 6)
    assert [f.after_steps for f in fc.schedule(8, 6, 400, min_gap=6)] != [f.after_steps for f in a]
    only = fc.schedule(4, 5, 100, min_gap=6, kinds=("hang-rank", "nan"))
    assert {f.kind for f in only} == {"hang-rank", "nan"}


def test_hlat_7b_projection_uses_the_trainers_interval_and_model():
    from hlat_train.interval import daly_interval, expected_utilisation

    stall = {"async_fixed_s": 0.01, "staging_bandwidth_gb_s": 2.0, "write_gb_s": 0.5}
    p = measure.project_hlat_7b(stall, restart_s=5.0, mtbf_hours=12.0, every="auto")
    per_node = 6.74e9 * 6 / 64
    stall_s = 0.01 + per_node / 2e9
    restart = 5.0 + per_node / 0.5e9 + 60 + 30  # measured, the read, the assumed pieces
    interval = daly_interval(stall_s, 12 * 3600)
    assert p["stall_s"] == pytest.approx(stall_s) and p["restart_total_s"] == pytest.approx(restart)
    assert p["interval_s"] == pytest.approx(interval)
    assert p["utilisation"] == pytest.approx(
        expected_utilisation(interval, stall_s, restart, 43200)
    )
    # a fixed interval in steps: at docs/cluster/cost.md's step time
    fixed = measure.project_hlat_7b(stall, restart_s=5.0, mtbf_hours=12.0, every=1000)
    assert fixed["interval_s"] == pytest.approx(1000 * 4194304 / 1.48e6)
    assert fixed["utilisation"] < p["utilisation"]
    # more failures, less utilisation; the auto interval beats the fixed one at every MTBF
    sens = p["sensitivity"]
    assert sens["auto"] == sorted(sens["auto"]) and len(sens["mtbf_hours"]) == 24
    assert all(a >= f for a, f in zip(sens["auto"], sens["fixed_1000_steps"], strict=True))
    best = max(sens["at_interval"])
    assert p["utilisation"] >= best - 1e-4  # no interval of the grid does better than auto
    # ZeRO-1 staging every replica of the weights: 4 replicas of 13.5 GB per node
    assert p["zero1_every_rank_bytes_per_node"] == pytest.approx(4 * 6.74e9 * 2 + 6.74e9 * 4 / 64)


def test_projection_matches_the_formula_by_hand():
    p = measure.project(restart_s=5.0, stall_s=0.5, mtbf_s=6 * 3600)
    interval = math.sqrt(2 * 0.5 * 21600)  # 147 s
    expected = 1 - (5.0 + interval / 2) / 21600 - 0.5 / interval
    assert p["interval_s"] == pytest.approx(interval)
    assert p["utilisation"] == pytest.approx(expected)
    assert 0.99 < p["utilisation"] < 0.995


@pytest.mark.parametrize(
    ("case", "summary", "before"),
    [
        ("with-before", "summary.json", "summary-before.json"),
        ("without-before", "summary.json", None),
        # hang and NaN paragraphs, no committed saves, a fault not injected, a failed
        # comparison, an unmet stall target, optional keys missing
        ("variant", "summary-variant.json", "summary-before-variant.json"),
        ("variant-without-before", "summary-variant.json", None),
    ],
)
def test_report_renders_the_expected_markdown(tmp_path, case, summary, before):
    """The report from fixed summaries equals, character for character, the expected
    rendering (``expected-*.md``, regenerated and reviewed when the template changes)."""
    s = json.loads((DATA / summary).read_text())
    b = json.loads((DATA / before).read_text()) if before else None
    expected = (DATA / f"expected-{case}.md").read_text()
    assert report.render(s, s["command"], b) == expected
    doc = tmp_path / "docs" / "reliability.md"
    report.write_doc(s, doc, s["command"], b)
    assert doc.read_text() == expected


def test_the_template_has_every_section_the_report_fills():
    names = set(report.templates())
    assert names == {
        "report",
        "fault-row",
        "stall-row",
        "startup-row",
        "in-run",
        "in-run-none",
        "hangs",
        "nans",
        "before-after",
        "assumed-row",
        "companion",
    }
