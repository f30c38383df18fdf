"""Single-process training: the loop, metrics, checkpoints, auto-resume, SIGTERM."""

from __future__ import annotations

import gc
import json
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from train_helpers import tiny_config, wait_for_step, write_config

from hlat_ckpt import MANIFEST_NAME, Checkpointer, consolidate
from hlat_train import ConfigError, Trainer, read_metrics


def _fit(config):
    trainer = Trainer(config)
    try:
        return trainer, trainer.fit()
    finally:
        trainer.close()


def test_training_lowers_loss_writes_metrics_and_checkpoints(corpus, tmp_path):
    _, summary = _fit(tiny_config(corpus, tmp_path, "--logging.plot=true", steps=12))
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 13))
    assert summary["step"] == 12 and summary["resumed_from"] is None
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    for key in ("grad_norm", "param_norm", "lr", "tokens_per_s", "mfu", "memory_gib"):
        assert all(r[key] > 0 for r in train[1:]), key
    assert train[-1]["tokens"] == 12 * 2 * 64
    assert [r["lr"] for r in train[:3]] == pytest.approx([0.0, 1.5e-3, 3e-3])  # 2-step warmup
    assert [r["step"] for r in records if r["kind"] == "valid"] == [2, 4, 6, 8, 10, 12]
    assert (tmp_path / "training.png").stat().st_size > 1000
    kept = [c.step for c in Checkpointer(str(tmp_path / "checkpoints"), async_save=False).list()]
    assert kept == [10, 12]  # keep_last = 2 of the tiny-check preset
    # every save is recorded: what it blocked the loop for, its write time and its size
    saves = [r for r in records if r["kind"] == "checkpoint"]
    assert [r["step"] for r in saves] == [2, 4, 6, 8, 10, 12]
    manifest = json.loads(
        (tmp_path / "checkpoints" / "step_0000000012" / MANIFEST_NAME).read_text()
    )
    assert saves[-1]["bytes"] == sum(manifest["files"].values())
    assert saves[-1]["files"] == len(manifest["files"]) >= 2
    for r in saves:
        assert r["async_save"] is False and r["stall_s"] == r["save_s"] > 0  # synchronous
        assert 0 < r["checksum_s"] < r["write_s"] <= r["save_s"] and r["bytes"] > 0


@pytest.mark.parametrize("every", [3, 0])
def test_the_garbage_collector_runs_every_gc_every_steps_and_is_restored(corpus, tmp_path, every):
    """train.gc_every = 3: no automatic collection within the loop (the collector is off),
    young-generation collections after steps 3 and 6, full ones before the saves of steps 4
    and 6. 0: Python collects on its own throughout. Either way it is on after the run."""
    config = tiny_config(corpus, tmp_path, f"--train.gc_every={every}", "--checkpoint.every=4")
    trainer = Trainer(config)
    seen: list[tuple[int, int, bool]] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":  # the state exists once set-up has built it
            step = trainer.state.step if hasattr(trainer, "state") else -1
            seen.append((step, info["generation"], gc.isenabled()))

    gc.callbacks.append(record)
    try:
        summary = trainer.fit()
    finally:
        gc.callbacks.remove(record)
        trainer.close()
    assert summary["step"] == 6 and gc.isenabled() and gc.get_freeze_count() == 0
    while_off = [(step, generation) for step, generation, enabled in seen if not enabled]
    if every:
        assert while_off == [(3, 1), (4, 2), (6, 1), (6, 2)]
    else:
        assert seen and not while_off


@pytest.mark.parametrize("where", ["loop", "end"])
def test_a_run_that_fails_restores_the_garbage_collector(corpus, tmp_path, monkeypatch, where):
    """A run that ends by an exception gives the collector back on and unfrozen, for a
    program that embeds the trainer and goes on: one raised in the loop (a loss spike with
    no rollback left), or by the loop's clean-up (the stop flag's last all-reduce, as with a
    stopped peer)."""
    spike = [
        "--spike.policy=rollback",
        "--spike.min_history=3",
        "--spike.inject_at=[5]",
        "--spike.max_rollbacks=0",
    ]
    config = tiny_config(
        corpus, tmp_path, "--train.gc_every=2", *(spike if where == "loop" else [])
    )
    trainer = Trainer(config)
    expected = "loss spike at step 5 after 0 rollbacks"
    if where == "end":
        expected = "the stop flag's all-reduce failed"

        def stop_flag_fails() -> None:
            raise RuntimeError(expected)

        monkeypatch.setattr(trainer, "_finish_stop_flag", stop_flag_fails)
    try:
        with pytest.raises(RuntimeError, match=expected):
            trainer.fit()
    finally:
        trainer.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_rerun_resumes_from_newest_checkpoint_and_continues_identically(corpus, tmp_path):
    horizon = "--optim.decay_steps=6"  # the same LR schedule whatever train.steps says
    _fit(tiny_config(corpus, tmp_path / "full", horizon, steps=6))
    _fit(tiny_config(corpus, tmp_path / "split", horizon, steps=4))
    _, resumed = _fit(tiny_config(corpus, tmp_path / "split", horizon, steps=6))
    assert resumed["resumed_from"] == 4
    a = read_metrics(str(tmp_path / "full" / "metrics.jsonl"))
    b = read_metrics(str(tmp_path / "split" / "metrics.jsonl"))
    assert [r["loss"] for r in a if "loss" in r] == [r["loss"] for r in b if "loss" in r]
    assert len([r for r in b if r["kind"] == "train"]) == 6
    pa = consolidate(str(tmp_path / "full" / "checkpoints"))["model"]
    pb = consolidate(str(tmp_path / "split" / "checkpoints"))["model"]
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    _, again = _fit(tiny_config(corpus, tmp_path / "split", horizon, steps=6))
    assert again["resumed_from"] == 6 and again["step"] == 6


def test_a_resumed_run_follows_the_optimizer_settings_of_the_command_that_resumed_it(
    corpus, tmp_path, capfd
):
    # 4 steps at lr 3e-3 on a 4-step horizon, then resumed to 8 steps at lr 1e-4 and weight
    # decay 0: the rest of the run is the fresh 8-step schedule's, from step 5
    _fit(tiny_config(corpus, tmp_path / "split", steps=4))
    capfd.readouterr()
    changed = ("--optim.lr=1e-4", "--optim.weight_decay=0.0")
    trainer, resumed = _fit(tiny_config(corpus, tmp_path / "split", *changed, steps=8))
    _fit(tiny_config(corpus, tmp_path / "fresh", *changed, steps=8))
    assert resumed["resumed_from"] == 4
    logged = capfd.readouterr().err
    assert "the config's optimizer settings replace the checkpoint's" in logged
    assert "schedule total_steps 4 -> 8" in logged and "peak lr 0.003 -> 0.0001" in logged
    assert "weight_decay 0.1 -> 0.0" in logged

    def rates(run):
        records = read_metrics(str(tmp_path / run / "metrics.jsonl"))
        return [r["lr"] for r in records if r["kind"] == "train" and r["step"] > 4]

    assert rates("split") == pytest.approx(rates("fresh"))
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.0] * len(
        trainer.optimizer.param_groups
    )


def test_a_resume_into_another_network_is_refused_before_any_work_and_changes_nothing(
    corpus, tmp_path, capfd
):
    _fit(tiny_config(corpus, tmp_path, steps=4))  # 4 heads, RoPE base 10000, dim 64

    def files():
        return {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    before = files()
    own = tmp_path / "checkpoints" / "step_0000000004" / "hlat-train-config.toml"
    assert "n_heads = 4" in own.read_text()  # the config step 4 was trained with
    # n_heads and rope_theta keep every tensor's shape; dim does not
    for change, value in (("n_heads", "8"), ("rope_theta", "500000.0"), ("dim", "128")):
        override = f"--model.{change}={value}"
        with pytest.raises(ConfigError, match=rf"model\.{change} is {value}, but checkpoint "):
            _fit(tiny_config(corpus, tmp_path, override, steps=6))
        assert files() == before, change
    # an optimizer that keeps other state (fp32 master weights) than the checkpoint's
    with pytest.raises(
        ConfigError, match=r"optim\.precision is mixed, but checkpoint step 4 under .* in fp32"
    ):
        _fit(tiny_config(corpus, tmp_path, "--optim.precision=mixed", steps=6))
    assert files() == before
    # a checkpoint without its own config (hlat-train before 0.24) is compared with the root's,
    # which those versions rewrote at every start: a difference is a warning
    own.unlink()
    capfd.readouterr()
    _, summary = _fit(tiny_config(corpus, tmp_path, "--model.n_heads=8", steps=4))
    assert summary["resumed_from"] == 4
    assert re.search(
        r"warning: model\.n_heads is 8, but the run's saved config \(.*checkpoints/"
        r"hlat-train-config.toml\) says 4; checkpoint step 4 has no config of its own",
        capfd.readouterr().err,
    )
    # a change of precision resumes, and says so
    _, summary = _fit(tiny_config(corpus, tmp_path, "--optim.precision=bf16-sr", steps=6))
    assert summary["resumed_from"] == 4
    assert "optim.precision fp32 -> bf16-sr: checkpoint step 4 was trained in fp32" in (
        capfd.readouterr().err
    )


def test_a_run_that_starts_over_in_a_used_checkpoint_dir_saves_its_own_steps(
    corpus, tmp_path, capfd
):
    from hlat_train.spike import GUARD_FILE, write_guard_file

    checkpoints = tmp_path / "checkpoints"
    _fit(tiny_config(corpus, tmp_path, steps=4))
    write_guard_file(str(checkpoints), [0, 1], 1, 3)  # the older run's spike guard
    capfd.readouterr()
    # the same steps again, from scratch: saved beside the older run's, which go
    _, summary = _fit(tiny_config(corpus, tmp_path, "--checkpoint.resume=false", steps=4))
    err = capfd.readouterr().err
    assert summary["resumed_from"] is None
    assert re.search(
        r"checkpoint.resume is false: the \d+ checkpoint\(s\) under .* \(newest step 4\)", err
    )
    # not merged in (it would be logged), and removed once the run had a checkpoint
    assert "spike guard:" not in err and not (checkpoints / GUARD_FILE).exists()
    assert f"removed the older run's {GUARD_FILE}" in err
    steps = sorted(p.name for p in checkpoints.glob("step_*"))
    assert steps and all("-" in name for name in steps), steps  # the new lineage's only
    # the run that started over resumes its own newest checkpoint
    _, summary = _fit(tiny_config(corpus, tmp_path, steps=5))
    assert summary["resumed_from"] == 4
    # a run whose committed saves are never handed over to the loop (as when fit raises
    # before the hand-over; stubbed out here): close removes the file
    write_guard_file(str(checkpoints), [0, 1], 1, 3)
    trainer = Trainer(tiny_config(corpus, tmp_path, "--checkpoint.resume=false", steps=2))
    trainer._record_configs = lambda: None  # no hand-over
    try:
        trainer.fit()
        assert (checkpoints / GUARD_FILE).exists()  # kept while the run had no hand-over
    finally:
        trainer.close()
    assert not (checkpoints / GUARD_FILE).exists()


def test_train_records_leave_out_the_time_of_checkpoint_saves_and_validation(
    corpus, tmp_path, monkeypatch
):
    # validation after step 2 made to take 1.5 s, and a save: the record of step 3 (steps
    # are logged one by one) times step 3 alone, a small fraction of that
    validate_once = Trainer._validate

    def slow_validation(self, step, progress):
        time.sleep(1.5)
        return validate_once(self, step, progress)

    monkeypatch.setattr(Trainer, "_validate", slow_validation)
    _fit(tiny_config(corpus, tmp_path, steps=4))
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    step_s = {r["step"]: r["step_s"] for r in records if r["kind"] == "train"}
    assert [r["step"] for r in records if r["kind"] == "valid"] == [2, 4]
    assert [r["step"] for r in records if r["kind"] == "checkpoint"] == [2, 4]
    assert 0 < step_s[3] < 0.5, step_s


def test_the_step_a_time_limit_stops_at_is_logged_as_it_is_saved(corpus, tmp_path):
    # logging.every far past the stop: the stopped step's record comes from the stop alone
    config = tiny_config(
        corpus,
        tmp_path,
        "--checkpoint.every=1000",
        "--logging.every=1000",
        "--model.compile=false",
        "--train.time_limit=2",
        steps=5000,
    )
    _, summary = _fit(config)
    assert summary["out_of_time"] and 0 < summary["step"] < 1000
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records if r["kind"] == "train"] == [summary["step"]]
    steps = [c.step for c in Checkpointer(str(tmp_path / "checkpoints"), async_save=False).list()]
    assert steps == [summary["step"]]


def test_sigterm_saves_a_checkpoint_and_exits_143(corpus, tmp_path):
    # Note: a long horizon that the signal cuts short; model.compile = false keeps "auto" from
    # compiling it on CPUs with native bf16 (these tests are about signals)
    config = tiny_config(
        corpus, tmp_path, "--checkpoint.every=1000", "--model.compile=false", steps=5000
    )
    path = write_config(config, tmp_path / "run.toml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hlat_train", "train", "--config", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_step(tmp_path / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output
    last = read_metrics(str(tmp_path / "metrics.jsonl"))[-1]["step"]
    steps = [c.step for c in Checkpointer(str(tmp_path / "checkpoints"), async_save=False).list()]
    assert 3 <= last < 5000 and steps == [last]
    assert "SIGTERM" in output
    assert json.loads(output.strip().splitlines()[-1])["preempted"] is True


@pytest.mark.parametrize("budget", ["1e-6", "600"], ids=["no-time-left", "ample"])
def test_sigterm_saves_only_if_the_measured_save_fits_the_preemption_budget(
    corpus, tmp_path, budget
):
    config = tiny_config(
        corpus,
        tmp_path,
        "--checkpoint.every=2",
        "--checkpoint.async_save=false",
        f"--checkpoint.preempt_budget={budget}",
        "--model.compile=false",  # as above
        steps=5000,
    )
    path = write_config(config, tmp_path / "run.toml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hlat_train", "train", "--config", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_step(tmp_path / "metrics.jsonl", 3, proc)  # a save of step 2 was measured
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    last = max(r["step"] for r in records if r["kind"] == "train")
    saves = [r for r in records if r["kind"] == "checkpoint"]
    newest = Checkpointer(str(tmp_path / "checkpoints"), async_save=False).list()[-1].step
    if budget == "600":
        assert newest == last and "exiting without saving" not in output
    else:
        assert newest == max(s["step"] for s in saves) < last
        assert _names_the_lost_steps(output, last, newest)


def _names_the_lost_steps(output: str, last: int, newest: int) -> bool:
    """The log names the step not saved and the steps lost since the newest checkpoint."""
    return (
        f"exiting without saving step {last}" in output
        and f"Lost: the {last - newest} step(s) since the checkpoint of step {newest}" in output
    )


def test_bf16_kahan_mode_keeps_a_compensation_per_parameter(corpus, tmp_path):
    trainer = Trainer(tiny_config(corpus, tmp_path, "--optim.precision=bf16-kahan", steps=4))
    try:
        summary = trainer.fit()
        opt = trainer.optimizer
        assert opt.kahan_sum and opt.stochastic_rounding and not opt.master_weights
        compensations = [opt.state[p]["compensation"] for p in trainer.model.parameters()]
        assert all(c.dtype == torch.bfloat16 for c in compensations)
        assert any(c.abs().sum() > 0 for c in compensations)  # the rounding error is kept
    finally:
        trainer.close()
    assert summary["last_loss"] < summary["first_loss"]


def test_bf16_stochastic_rounding_mode_trains_bf16_weights(corpus, tmp_path):
    trainer = Trainer(tiny_config(corpus, tmp_path, "--optim.precision=bf16-sr", steps=6))
    try:
        summary = trainer.fit()
        dtypes = {p.dtype for p in trainer.model.parameters()}
        assert dtypes == {torch.bfloat16}
        assert trainer.optimizer.stochastic_rounding and not trainer.optimizer.master_weights
    finally:
        trainer.close()
    assert summary["last_loss"] < summary["first_loss"]


def test_sharded_init_builds_on_meta_and_initialises_in_place(corpus, tmp_path):
    trainer = Trainer(tiny_config(corpus, tmp_path, "--train.init=sharded", steps=4))
    try:
        summary = trainer.fit()
        weights = trainer.model.layers[0].attention.qkv_proj.weight
        assert weights.device.type == "cpu" and 0.015 < float(weights.std()) < 0.025
    finally:
        trainer.close()
    assert summary["last_loss"] < summary["first_loss"]


def test_async_saves_record_a_stall_and_their_background_write(corpus, tmp_path):
    _fit(tiny_config(corpus, tmp_path, "--checkpoint.async_save=true", steps=4))
    saves = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if r["kind"] == "checkpoint"]
    assert [r["step"] for r in saves] == [2, 4]
    for r in saves:
        assert r["async_save"] is True and r["bytes"] > 0
        # the loop was blocked for the staging only; the write ran after save() returned
        assert 0 <= r["wait_s"] <= r["stall_s"] and r["stall_s"] + r["write_s"] <= r["save_s"]
        # each checkpoint holds the config it was trained with, written once it committed
        saved = tmp_path / "checkpoints" / f"step_{r['step']:010d}" / "hlat-train-config.toml"
        assert (
            saved.read_text() == (tmp_path / "checkpoints" / "hlat-train-config.toml").read_text()
        )
