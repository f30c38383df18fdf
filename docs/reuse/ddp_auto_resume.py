"""hlat-ckpt in a plain PyTorch DDP loop: kill a worker, run the same command again, and it
continues from the newest checkpoint.

    pip install hlat-ckpt
    torchrun --nproc-per-node 2 docs/reuse/ddp_auto_resume.py OUT_DIR [STEPS]

Everything hlat-ckpt needs from the loop is the ``state`` dict and three calls.
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hlat_ckpt import Checkpointer


# --- user code: 24 lines ---------------------------------------------------------------------
def main(out: str, steps: int) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    progress = {"step": 0}
    state = {"model": model.module, "optimizer": optimizer, "progress": progress}
    ckpt = Checkpointer(f"{out}/checkpoints", keep_last=2, async_save=True)
    ckpt.load_latest(state)  # auto-resume: the newest complete checkpoint, if any
    while progress["step"] < steps:
        step = progress["step"] + 1
        data = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x = torch.randn(16, 32, generator=data)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        progress["step"] = step
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % 5 == 0:
            ckpt.save(step, state)  # returns once the state is in host memory
    ckpt.close()  # waits for the last write
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
