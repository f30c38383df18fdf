"""Decide on a preemption save with measurements that differ between the ranks.

Usage: preempt_worker.py CONFIG OUT under torchrun with 2 processes. Rank 1 has measured a
save of 1000 s; rank 0 has measured none (its first save not yet committed, as after an
async save whose commit another rank saw first). Each rank writes what it decided to
OUT/rank<r>.
"""

from __future__ import annotations

from pathlib import Path

from train_helpers import run_worker

from hlat_train import TrainConfig, Trainer


def main(config_path: str, out: str) -> None:
    trainer = Trainer(TrainConfig.from_toml(config_path))
    try:
        trainer._setup()
        rank = trainer.dims.rank
        trainer._save_seconds = [1000.0] if rank == 1 else []
        trainer._on_sigterm(15, None)
        fits = trainer._preempt_save_fits(step=5, last_saved=2)
        Path(out, f"rank{rank}").write_text(str(fits))
    finally:
        trainer.close()


if __name__ == "__main__":
    run_worker(main)
