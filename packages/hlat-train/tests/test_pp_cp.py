"""Pipeline and context parallelism in the trainer, on CPU with gloo through torchrun.

PP2 (two processes, 1F1B), CP2 (two processes), PP2 x CP2 (four processes: FSDP over the
flattened dp x cp mesh, full activation checkpointing), CP2 x TP2 (four processes, sequence
parallel) and PP2 x TP2 (four processes,
sequence parallel, interleaved schedule, packed documents) train the tiny-check model in fp32 and
agree with one process on the same batches; checkpoints reshard: PP2 x TP2 -> one process
-> PP2, bit for bit on the weights and the optimizer state.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import tiny_config, torchrun, write_config

from hlat_ckpt import consolidate
from hlat_parallel.dims import PIPELINE_MIN_TORCH, _torch_version
from hlat_train import ConfigError, Trainer, read_metrics
from hlat_train.validation import validate

pytestmark = [pytest.mark.slow, pytest.mark.parity]
needs_pipeline_torch = pytest.mark.skipif(
    _torch_version() < PIPELINE_MIN_TORCH,
    reason="pipeline parallelism needs torch>={}.{}".format(*PIPELINE_MIN_TORCH),
)

# 2 micro-batches of 2 rows per step: the pipeline's micro-batches
COMMON = ("--optim.decay_steps=30", "--train.global_batch_size=4", "--model.n_layers=4")
STEPS = 4
RESHARD = Path(__file__).with_name("reshard_worker.py")


def _losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(str(out_dir / "metrics.jsonl")) if r["kind"] == "train"]


def _valid(out_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(str(out_dir / "metrics.jsonl")) if r["kind"] == "valid"]


def _run(nproc: int, config, path: Path, *args: str) -> None:
    proc = torchrun(
        nproc,
        write_config(config, path),
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]


def _single(corpus, out: Path, *extra: str) -> Path:
    trainer = Trainer(tiny_config(corpus, out, *COMMON, *extra, steps=STEPS))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return out


def _assert_close_state(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=key, **tol)


@pytest.fixture(scope="module")
def single_plain(corpus, tmp_path_factory) -> Path:
    return _single(corpus, tmp_path_factory.mktemp("single") / "run", "--train.eval_every=2")


@needs_pipeline_torch
def test_pp2_matches_one_process(corpus, tmp_path, single_plain):
    out = tmp_path / "pp2"
    config = tiny_config(
        corpus, out, *COMMON, "--parallel.pp=2", "--train.eval_every=2", steps=STEPS
    )
    _run(2, config, tmp_path / "pp2.toml")
    assert _losses(out) == pytest.approx(_losses(single_plain), rel=1e-5)
    assert _valid(out) == pytest.approx(_valid(single_plain), rel=1e-5)
    ckpt = consolidate(str(out / "checkpoints"))
    ref = consolidate(str(single_plain / "checkpoints"))
    _assert_close_state(ckpt["model"], ref["model"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, ("--parallel.cp=2",)),
        # FSDP over the flattened dp x cp mesh inside each stage, blocks recomputed
        pytest.param(
            4,
            ("--parallel.cp=2", "--parallel.pp=2", "--model.checkpointing=full"),
            marks=needs_pipeline_torch,
        ),
        # ZeRO-1 over the flattened dp x cp mesh: slices of whole parameters, inside each
        # stage under PP
        (2, ("--parallel.cp=2", "--parallel.dp_shard=zero1")),
        pytest.param(
            4,
            ("--parallel.cp=2", "--parallel.pp=2", "--parallel.dp_shard=zero1"),
            marks=needs_pipeline_torch,
        ),
        # tensor parallel heads inside each cp rank's shard of the sequence, sequence
        # parallel norms
        (4, ("--parallel.cp=2", "--parallel.tp=2", "--parallel.sp=true")),
    ],
    ids=["cp2", "pp2-cp2-full-checkpointing", "cp2-zero1", "pp2-cp2-zero1", "cp2-tp2-sp"],
)
def test_context_parallel_runs_match_one_process(corpus, tmp_path, single_plain, nproc, layout):
    out = tmp_path / "run"
    config = tiny_config(corpus, out, *COMMON, *layout, "--train.eval_every=2", steps=STEPS)
    _run(nproc, config, tmp_path / "run.toml")
    assert _losses(out) == pytest.approx(_losses(single_plain), rel=1e-5)
    assert _valid(out) == pytest.approx(_valid(single_plain), rel=1e-5)
    ckpt = consolidate(str(out / "checkpoints"))
    ref = consolidate(str(single_plain / "checkpoints"))
    _assert_close_state(ckpt["model"], ref["model"], rtol=1e-4, atol=1e-6)


@needs_pipeline_torch
def test_pp2_tp2_documents_and_resharding(corpus, tmp_path):
    docs = ("--data.document_mask=true",)
    single = _single(corpus, tmp_path / "single", *docs)
    out = tmp_path / "pp2tp2"
    layout = (
        "--parallel.pp=2",
        "--parallel.tp=2",
        "--parallel.sp=true",
        "--parallel.pp_schedule=Interleaved1F1B",
        "--parallel.pp_split=[0,2,1,1]",  # an embedding-only first stage
    )
    _run(4, tiny_config(corpus, out, *COMMON, *docs, *layout, steps=STEPS), tmp_path / "a.toml")
    assert _losses(out) == pytest.approx(_losses(single), rel=1e-5)
    saved = consolidate(str(out / "checkpoints"))
    _assert_close_state(
        saved["model"], consolidate(str(single / "checkpoints"))["model"], rtol=1e-4, atol=1e-6
    )

    # PP2 x TP2 -> one process: loaded, then saved again in its own layout
    one = tmp_path / "one"
    shutil.copytree(out / "checkpoints", one / "source")
    config = tiny_config(corpus, one, *COMMON, *docs, steps=STEPS)
    config.checkpoint.dir = str(one / "source")
    path = write_config(config, tmp_path / "one.toml")
    subprocess.run(
        [sys.executable, str(RESHARD), path, str(one / "resaved")], check=True, timeout=300
    )
    _assert_bitwise(consolidate(str(one / "resaved")), saved)

    # one process -> PP2 (1F1B, the balanced split)
    back = tmp_path / "back"
    config = tiny_config(corpus, back, *COMMON, *docs, "--parallel.pp=2", steps=STEPS)
    config.checkpoint.dir = str(one / "resaved")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--standalone", str(RESHARD), write_config(config, tmp_path / "back.toml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, str(back / "resaved")], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    _assert_bitwise(consolidate(str(back / "resaved")), saved)


def _assert_bitwise(got: dict, want: dict) -> None:
    for entry in ("model", "optimizer"):
        flat_got, flat_want = _flatten(got[entry]), _flatten(want[entry])
        assert flat_got.keys() == flat_want.keys(), entry
        for key, value in flat_want.items():
            assert torch.equal(flat_got[key], value), f"{entry}: {key}"


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix: tree} if isinstance(tree, torch.Tensor) else {}


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (("--parallel.pp=2", "--parallel.pp_schedule=1F2B"), "is not one of"),
        (("--parallel.pp=2", "--train.global_batch_size=2"), "at least as many micro-batches"),
        (("--parallel.pp=2", "--parallel.pp_microbatches=4"), "gradient-accumulation"),
        (("--parallel.pp=2", "--parallel.pp_split=[1,2]"), "sum to 4"),
        (("--parallel.pp_split=[2,2]",), "parallel.pp is 1"),
        (("--parallel.cp=2", "--data.document_mask=true"), "document masking"),
        (("--parallel.pp=2", "--parallel.backend=neuron"), "native torch backend"),
        (("--parallel.pp=3",), "not divisible by pp x cp x tp"),
    ],
)
def test_bad_pipeline_settings_are_refused_by_validation(corpus, tmp_path, overrides, needle):
    config = tiny_config(corpus, tmp_path / "run", *COMMON, *overrides)
    world = 2 if "--parallel.pp=3" not in overrides else 4
    with pytest.raises(ConfigError, match=needle):
        validate(config, world)


@pytest.mark.oldtorch
@pytest.mark.skipif(
    _torch_version() >= PIPELINE_MIN_TORCH, reason="runs on a torch older than the pipeline needs"
)
def test_an_older_torch_refuses_a_pipeline_before_any_work(corpus, tmp_path, monkeypatch):
    config = tiny_config(corpus, tmp_path / "run", *COMMON, "--parallel.pp=2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="needs torch>="):
        Trainer(config)
    assert not (tmp_path / "run").exists()
