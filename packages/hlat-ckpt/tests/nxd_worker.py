"""One rank of a two-rank job checkpointing with NeuronCheckpointer through
tests/nxd_standin.py (data parallelism 2, an optimizer file per rank, per-rank loader state):
it saves steps 1 and 2, damages rank 1's optimizer file of step 2, resumes and writes what
it loaded to ``<root>/rank<r>.json``.

Run as ``python nxd_worker.py <root>`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from nxd_standin import NxdStandIn, zero1_optimizer_class

from hlat_ckpt.neuron import NeuronCheckpointer


def state(rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    # ZeRO-1's shard: the ranks' optimizer states differ
    optimizer = zero1_optimizer_class(torch.optim.SGD)(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.full((2, 4), float(rank + 1))).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "loader": {"position": 0}}


def momentum(s: dict) -> list[float]:
    return next(iter(s["optimizer"].state.values()))["momentum_buffer"].flatten().tolist()


def main() -> None:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ck = NeuronCheckpointer(root, async_save=True, use_xser=False, nxd=NxdStandIn())
    a = state(rank)
    for step in (1, 2):
        a["loader"]["position"] = 100 * step + rank
        ck.save(step, a)
    ck.wait()
    saved = momentum(a)
    dist.barrier()
    if rank == 1:
        path = os.path.join(root, "step_0000000002", "optim", "dp_rank_01_tp_rank_00_pp_rank_00.pt")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    b = state(5)
    b["optimizer"].state.clear()
    resumed = NeuronCheckpointer(root, use_xser=False, nxd=NxdStandIn())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed_step = resumed.load_latest(b)
    out = {
        "step": resumed_step,
        "position": b["loader"]["position"],
        "momentum_matches_own": momentum(b) == saved,
        "warnings": [str(w.message) for w in caught],
        "steps_listed": [i.step for i in resumed.list()],
        "world_size": resumed.list()[0].world_size,
    }
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Note: the work is saved and the process group destroyed; end before the interpreter's
    # finalization, where torch's threads of a destroyed group now and then abort a finished
    # rank (SIGABRT, "terminate called without an active exception"); hlat-train's CLI ends
    # the same way
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
