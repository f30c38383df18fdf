"""Load a run's newest checkpoint into the layout its config describes and save it again.

Usage: reshard_worker.py CONFIG DEST, in one process or under torchrun. The config's
``train.steps`` is the checkpoint's step, so ``fit()`` resumes and trains nothing; the
state, now in this run's layout, is saved to DEST by a new checkpointer.
"""

from __future__ import annotations

from train_helpers import run_worker

from hlat_ckpt import Checkpointer
from hlat_train import TrainConfig, Trainer


def main(config_path: str, dest: str) -> None:
    trainer = Trainer(TrainConfig.from_toml(config_path))
    try:
        summary = trainer.fit()
        assert summary["resumed_from"] == trainer.config.train.steps, summary
        resaved = Checkpointer(dest, async_save=False)
        resaved.save(trainer.state.step, trainer.checkpoint_state)
        resaved.close()
    finally:
        trainer.close()


if __name__ == "__main__":
    run_worker(main)
