"""Observability on a real run: W&B (offline) with the config and a resume into the same run,
torch.profiler traces of chosen steps, memory snapshots where the device has them, and the
compute time of each logged step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import tiny_config

from hlat_train import ConfigError, Trainer, read_metrics
from hlat_train.validation import validate


def _fit(config) -> dict:
    trainer = Trainer(config)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def test_wandb_profiler_and_compute_time_on_a_run_that_resumes(
    corpus, tmp_path, monkeypatch, capsys
):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    extra = (
        "--logging.wandb=true",
        "--logging.wandb_project=hlat-test",
        "--logging.profile_steps=[2, 3]",
        "--logging.memory_snapshot_step=2",
    )
    _fit(tiny_config(corpus, out, *extra, steps=4))
    run_id = (out / "wandb_run_id").read_text().strip()
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    logged = b"".join(p.read_bytes() for p in runs[0].glob("run-*.wandb"))
    # the metrics and the whole config reach the run (W&B's records carry them as JSON text)
    for needle in (b"tokens_per_s", b"grad_norm", b"compute_s", b"valid/loss", b"precision"):
        assert needle in logged, needle
    assert run_id.encode() in logged

    # the profiler traced steps 2 and 3 only, as a Chrome trace of real operators
    traces = sorted((out / "profile").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)
    assert {"step 2", "step 3"} <= names and "step 1" not in names and "step 4" not in names

    # a CPU has no allocator history: the run says so and goes on
    assert "memory snapshots need a CUDA device" in capsys.readouterr().err
    assert not (out / "memory").exists()

    records = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["kind"] == "train"]
    assert all(r["compute_s"] > 0 for r in records)

    # a resumed run logs into the same W&B run
    _fit(tiny_config(corpus, out, *extra[:2], steps=6))
    assert (out / "wandb_run_id").read_text().strip() == run_id
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("--logging.profile_steps=[3, 2]", "first <= last"),
        ("--logging.profile_steps=[0]", "first <= last"),
        ("--logging.profile_steps=[1, 2, 3]", r"\[first, last\]"),
        ("--logging.memory_snapshot_step=-1", "at least 0"),
    ],
)
def test_bad_observability_settings_are_refused(corpus, tmp_path, override, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(tiny_config(corpus, tmp_path / "run", override), 1)
    assert not (tmp_path / "run").exists()


def test_a_run_without_wandb_installed_is_refused_before_any_work(corpus, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match="pip install 'hlat-train\\[wandb\\]'"):
        validate(tiny_config(corpus, tmp_path / "run", "--logging.wandb=true"), 1)
    assert not Path(tmp_path / "run").exists()
