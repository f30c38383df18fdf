"""Multi-process runs through torchrun on CPU (gloo): TP=2 and DP=2 against one process, and
a run whose worker is SIGKILLed mid-run, restarted by torchrun and resumed bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import tiny_config, torchrun, wait_for_step, write_config

from hlat_ckpt import consolidate
from hlat_train import Trainer, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.parity]

HORIZON = "--optim.decay_steps=30"  # one LR schedule for runs of any length
PREEMPT = Path(__file__).with_name("preempt_worker.py")


def _losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(str(out_dir / "metrics.jsonl")) if r["kind"] == "train"]


def _launch(corpus, out_dir: Path, nproc: int, *extra: str, steps: int, torchrun_args=()):
    config = tiny_config(corpus, out_dir, HORIZON, *extra, steps=steps)
    path = write_config(config, out_dir.with_suffix(".toml"))
    return torchrun(
        nproc, path, *torchrun_args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    return output


@pytest.fixture(scope="module")
def dp2_reference(corpus, tmp_path_factory) -> Path:
    """An uninterrupted 2-process DP run of 30 steps, async checkpoints every 4."""
    out = tmp_path_factory.mktemp("dp2") / "run"
    _finish(
        _launch(corpus, out, 2, "--checkpoint.every=4", "--checkpoint.async_save=true", steps=30)
    )
    return out


def test_tp2_and_dp2_runs_agree_with_one_process(corpus, tmp_path, dp2_reference):
    trainer = Trainer(tiny_config(corpus, tmp_path / "single", HORIZON, steps=6))
    try:
        trainer.fit()
    finally:
        trainer.close()
    _finish(_launch(corpus, tmp_path / "tp2", 2, "--parallel.tp=2", steps=6))
    single, tp2 = _losses(tmp_path / "single"), _losses(tmp_path / "tp2")
    dp2 = _losses(dp2_reference)[:6]
    # TP splits the same computation: equal up to float reassociation
    assert tp2 == pytest.approx(single, rel=1e-4)
    # DP ranks read disjoint documents (global batch 2 x 2 rows vs 2 rows), so the losses
    # agree as statistics of the same model, not digit for digit
    assert dp2 == pytest.approx(single, rel=0.03)
    assert dp2[-1] < dp2[0] and tp2[-1] < tp2[0]
    # every logged step reports the ranks' compute-time spread (the straggler hint)
    for record in read_metrics(str(tmp_path / "tp2" / "metrics.jsonl")):
        if record["kind"] == "train":
            assert 0 < record["compute_s_min"] <= record["compute_s"] <= record["compute_s_max"]
            assert record["slowest_rank"] in (0, 1)
    full_single = consolidate(str(tmp_path / "single" / "checkpoints"))["model"]
    full_tp2 = consolidate(str(tmp_path / "tp2" / "checkpoints"))["model"]
    for name, value in full_single.items():
        torch.testing.assert_close(full_tp2[name], value, rtol=1e-3, atol=1e-5)


def test_fp32_tp2_with_vocabulary_sharded_logits_agrees_with_one_process_fused_head(
    corpus, tmp_path, monkeypatch
):
    import hlat_model.loss

    # One process in fp32 on the CPU takes the LM head and the loss fused (no logits); TP=2
    # shards the head by vocabulary and takes the loss of the sharded logits.
    chunks = []
    fused = hlat_model.loss._head_loss_in_chunks

    def counting(hidden, *args):
        chunks.append(hidden.shape)
        return fused(hidden, *args)

    monkeypatch.setattr(hlat_model.loss, "_head_loss_in_chunks", counting)
    fp32 = "--optim.precision=fp32"
    trainer = Trainer(tiny_config(corpus, tmp_path / "single", HORIZON, fp32, steps=4))
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert chunks  # the one-process run went through the fused head
    _finish(_launch(corpus, tmp_path / "tp2", 2, "--parallel.tp=2", fp32, steps=4))
    single, tp2 = _losses(tmp_path / "single"), _losses(tmp_path / "tp2")
    assert len(single) == len(tp2) == 4
    # the same sums in another order: fp32 rounding, far under bf16's tolerance above
    assert tp2 == pytest.approx(single, rel=1e-5)
    full_single = consolidate(str(tmp_path / "single" / "checkpoints"))["model"]
    full_tp2 = consolidate(str(tmp_path / "tp2" / "checkpoints"))["model"]
    for name, value in full_single.items():
        torch.testing.assert_close(full_tp2[name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dp_shard", ["zero1", "none"])
def test_zero1_and_unsharded_dp2_match_fsdp_and_resume_under_it(
    corpus, tmp_path, dp2_reference, dp_shard
):
    out = tmp_path / dp_shard
    every = "--checkpoint.every=4"
    output = _finish(_launch(corpus, out, 2, f"--parallel.dp_shard={dp_shard}", every, steps=6))
    assert f"dp 2 sharding {dp_shard}" in output
    fsdp = _losses(dp2_reference)
    # the same batches and arithmetic; only the order of the gradient sums differs
    assert _losses(out) == pytest.approx(fsdp[:6], rel=1e-4)
    # resumed under FSDP from step 6: the optimizer state moves from whole tensors or ZeRO-1
    # slices into FSDP's shards through the checkpoint
    output = _finish(_launch(corpus, out, 2, "--parallel.dp_shard=fsdp", every, steps=10))
    assert "resumed from step 6 of" in output and "dp 2 sharding fsdp" in output
    assert _losses(out) == pytest.approx(fsdp[:10], rel=1e-4)


@pytest.mark.compile
def test_the_compiled_optimizer_on_fsdp_shards_trains_and_resumes_as_the_native_one(
    corpus, tmp_path, dp2_reference
):
    # optim.impl=compiled is what an accelerator runs by default: one flat update per group
    # of FSDP2's DTensor shards, with the optimizer states as views of flat buffers, which
    # the checkpoint saves and the resumed run loads back into new ones.
    out = tmp_path / "compiled"
    compiled = ("--optim.impl=compiled", "--checkpoint.every=4")
    _finish(_launch(corpus, out, 2, *compiled, steps=6))
    fsdp = _losses(dp2_reference)
    # bit-identical updates: the same losses to the last digit
    assert _losses(out) == fsdp[:6]
    output = _finish(_launch(corpus, out, 2, *compiled, steps=10))
    assert "resumed from step 6 of" in output
    assert _losses(out) == fsdp[:10]


def test_tp2_with_sharded_init_trains(corpus, tmp_path):
    # built on the meta device, split over TP, then materialised and initialised per shard:
    # the gradient-placement hooks must follow the new parameter objects
    out = tmp_path / "tp2-sharded"
    _finish(_launch(corpus, out, 2, "--parallel.tp=2", "--train.init=sharded", steps=4))
    losses = _losses(out)
    assert len(losses) == 4 and losses[-1] < losses[0]
    full = consolidate(str(out / "checkpoints"))["model"]
    embedding = next(v for k, v in full.items() if "embed" in k)
    assert 0.01 < float(embedding.float().std()) < 0.05


def test_ranks_agree_on_a_preemption_save_when_only_some_have_measured_one(corpus, tmp_path):
    """Rank 1 has measured a 1000 s save, rank 0 none yet: both join the agreement, and both
    skip the save, which does not fit the 60 s budget."""
    config = tiny_config(corpus, tmp_path / "run", "--checkpoint.preempt_budget=60")
    path = write_config(config, tmp_path / "run.toml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--standalone", str(PREEMPT), path, str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    decided = {p.name: p.read_text() for p in tmp_path.glob("rank*")}
    assert decided == {"rank0": "False", "rank1": "False"}, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 0 reports the slowest rank's estimate
    assert "SIGTERM: a save takes about 1000.0 s but" in done.stderr


def _workers(torchrun_pid: int) -> list[int]:
    with open(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children") as f:
        return [int(pid) for pid in f.read().split()]


@pytest.mark.faults
def test_sigkilled_worker_restarts_via_torchrun_and_resumes_bit_exactly(
    corpus, tmp_path, dp2_reference
):
    out = tmp_path / "killed"
    proc = _launch(
        corpus,
        out,
        2,
        "--checkpoint.every=4",
        "--checkpoint.async_save=true",
        steps=30,
        torchrun_args=("--max-restarts", "1"),
    )
    wait_for_step(out / "metrics.jsonl", 10, proc)
    os.kill(_workers(proc.pid)[-1], signal.SIGKILL)
    killed_at = max(r["step"] for r in read_metrics(str(out / "metrics.jsonl")))
    output = _finish(proc)
    assert killed_at < 30
    assert "resumed from step" in output
    logged = [
        line for line in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in line
    ]
    assert len(logged) > 30  # the steps after the checkpoint ran twice
    assert _losses(out) == _losses(dp2_reference)  # bit for bit
    mine = consolidate(str(out / "checkpoints"))
    reference = consolidate(str(dp2_reference / "checkpoints"))
    _assert_identical(mine["model"], reference["model"], "model")
    _assert_identical(mine["optimizer"], reference["optimizer"], "optimizer")


def _assert_identical(a, b, where: str) -> None:
    if isinstance(b, dict):
        assert set(a) == set(b), where
        for key in b:
            _assert_identical(a[key], b[key], f"{where}.{key}")
    elif torch.is_tensor(b):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_wait_for_step_raises_when_the_run_ends_early(tmp_path):
    proc = subprocess.Popen(["true"])
    time.sleep(0.2)
    with pytest.raises(AssertionError, match="ended"):
        wait_for_step(tmp_path / "missing.jsonl", 1, proc, timeout=5)


def test_a_dp2_run_resumes_on_one_process_and_a_dp1_run_on_two(corpus, tmp_path, dp2_reference):
    """The checkpoint holds every data-parallel rank's loader state, so a run restarted on
    fewer or more processes resumes: the documents no old rank has read are dealt anew."""
    import shutil

    smaller = tmp_path / "dp2-to-dp1"
    shutil.copytree(dp2_reference, smaller)
    trainer = Trainer(tiny_config(corpus, smaller, HORIZON, "--checkpoint.every=4", steps=34))
    try:
        summary = trainer.fit()
        resumed = trainer.loader.state_dict()["resumed_from"]
    finally:
        trainer.close()
    assert summary["resumed_from"] == 30 and summary["step"] == 34
    assert len(resumed["cursors"]) == 2  # where each of the two old ranks had got to
    steps = [
        r["step"] for r in read_metrics(str(smaller / "metrics.jsonl")) if r["kind"] == "train"
    ]
    assert steps[-4:] == [31, 32, 33, 34]

    larger = tmp_path / "dp1-to-dp2"
    trainer = Trainer(tiny_config(corpus, larger, HORIZON, "--checkpoint.every=4", steps=4))
    try:
        trainer.fit()
    finally:
        trainer.close()
    output = _finish(_launch(corpus, larger, 2, "--checkpoint.every=4", steps=8))
    records = read_metrics(str(larger / "metrics.jsonl"))
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 9))
    # steps 5-8 read two micro-batches per step, one on each rank
    tokens = [r["tokens"] for r in records if r["kind"] == "train"]
    assert tokens[4] - tokens[3] == 2 * tokens[0]
    assert "resumed from step 4 of" in output
