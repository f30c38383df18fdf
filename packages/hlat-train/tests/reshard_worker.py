"""Load a run's newest checkpoint into the layout its config describes and save it again.

Usage: reshard_worker.py CONFIG DEST, in one process or under torchrun. The config's
``train.steps`` is the checkpoint's step, so ``fit()`` resumes and trains nothing; the
state, now in this run's layout, is saved to DEST by a new checkpointer.
"""

from __future__ import annotations

import os
import sys

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
    main(*sys.argv[1:])
    # Note: the work is saved and the process group destroyed; end before the interpreter's
    # finalization, where torch's threads of a destroyed group now and then abort a finished
    # rank (SIGABRT, "terminate called without an active exception"); hlat-train's CLI ends
    # the same way
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
