"""Crash safety: a trainer checkpointing in a loop is killed with SIGKILL at random moments;
after every kill the newest checkpoint that resume finds is complete and loads."""

import os
import random
import signal
import time

import pytest
import torch
from ckpt_helpers import ForkParent
from ckpt_workers import save_forever, warm_up_saving

from hlat_ckpt import Checkpointer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.faults,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]
KILLS = 12


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_after_every_sigkill_resume_finds_a_complete_checkpoint(tmp_path, async_save):
    rng = random.Random(1234 + async_save)
    reader = Checkpointer(tmp_path, save_rng=False)
    newest = 0
    interrupted = 0  # kills that left a partial save behind
    # Children are forked (fast restarts: torch is already imported), from a clean process.
    with ForkParent(save_forever, str(tmp_path), async_save, warm_up=warm_up_saving) as parent:
        for kill in range(KILLS):
            pid = parent.fork()
            time.sleep(0.6 if kill == 0 else rng.uniform(0.02, 0.4))
            os.kill(pid, signal.SIGKILL)
            assert parent.exitcode() == -signal.SIGKILL
            interrupted += any(p.name.endswith(".tmp") for p in tmp_path.iterdir())

            model = torch.nn.Linear(256, 256)
            progress: dict = {}
            step = reader.load_latest({"model": model, "progress": progress})
            assert step is not None, f"no complete checkpoint after kill {kill}"
            assert step >= newest, "resume went back past a checkpoint that had committed"
            assert progress == {"step": step}
            assert torch.all(model.weight == step) and torch.all(model.bias == step)
            newest = step
    assert newest > KILLS  # the loop made progress across restarts
    assert interrupted > 0  # some kills did land in the middle of a save
