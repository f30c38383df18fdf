"""Helpers shared by the hlat-train tests: the tiny test config and torchrun launching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hlat_train import TrainConfig


def tiny_overrides(corpus: dict[str, str], out_dir: str | Path, steps: int = 6) -> list[str]:
    """A 2-layer, 64-wide Llama on 2 x 64-token micro-batches, fp32, eager AdamW."""
    return [
        f'--data.paths=["{corpus["train"]}"]',
        f'--data.valid_paths=["{corpus["valid"]}"]',
        f'--data.tokenizer="{corpus["tokenizer"]}"',
        f'--train.out_dir="{out_dir}"',
        f"--train.steps={steps}",
        "--train.eval_batches=2",
        "--train.eval_every=0",
        "--train.sample_prompt=''",
        "--optim.impl=reference",
        "--checkpoint.every=2",
        "--checkpoint.async_save=false",
        "--logging.progress=false",
        "--logging.plot=false",
    ]


def tiny_config(
    corpus: dict[str, str], out_dir: str | Path, *extra: str, steps: int = 6
) -> TrainConfig:
    """The tiny-check preset for tests (see :func:`tiny_overrides`)."""
    return TrainConfig.preset("tiny-check", [*tiny_overrides(corpus, out_dir, steps), *extra])


def fit(config: TrainConfig) -> dict:
    """Train ``config`` in this process; the run's summary (the trainer is closed)."""
    from hlat_train import Trainer

    trainer = Trainer(config)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def write_config(config: TrainConfig, path: Path) -> str:
    path.write_text(config.to_toml())
    return str(path)


def torchrun(nproc: int, config_path: str, *args: str, **popen) -> subprocess.Popen:
    """``torchrun --nproc-per-node nproc -m hlat_train train --config config_path``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--standalone",
        *args,
        "-m",
        "hlat_train",
        "train",
        "--config",
        config_path,
    ]
    return subprocess.Popen(cmd, env=env, start_new_session=True, **popen)


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Block until ``metrics`` holds a train record of ``step`` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                if line.strip() and json.loads(line).get("step", 0) >= step:
                    return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before step {step}")
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def run_worker(main) -> None:
    """Run a torchrun worker script's ``main(*argv)`` and end the process.

    Note: the work is saved and the process group destroyed; the process ends before the
    interpreter's finalization, where torch's threads of a destroyed group now and then abort
    a finished rank (SIGABRT, "terminate called without an active exception"); hlat-train's
    CLI ends the same way.
    """
    main(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
