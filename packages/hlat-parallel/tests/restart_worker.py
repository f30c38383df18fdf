"""One rank of a torchrun job restarted once, launched by tests/test_restart.py.

Usage: restart_worker.py OUT_DIR [plain]. Every attempt joins the process group with
``init_parallel`` (or, with ``plain``, torch's own ``init_process_group`` from the
environment) and all-reduces rank + 1. On attempt 0, rank 1 then fails; torchrun
(``--max-restarts 1``) restarts both ranks, which must form a new group and all-reduce.
Each rank writes ``attempt<n>-rank<r>.txt`` with the all-reduced value.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from spawn import end_worker

from hlat_parallel import init_parallel


def main() -> None:
    out = Path(sys.argv[1])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    plain = sys.argv[2:] == ["plain"]
    if attempt == 1:
        # Rank 0 joins first and rank 1 later, so that rank 0 reads whatever rank 1 published
        # last: on a store shared by both attempts, the address of the rank 1 that died.
        # With ``plain`` rank 1 waits long enough for a busy machine: rank 0 fails at once on
        # the dead address (and torchrun then stops rank 1), while a rank 1 that joined
        # before rank 0 read the address would overwrite it and let the group form.
        joining = out / "attempt1-rank0.joining"
        if os.environ["RANK"] == "0":
            joining.touch()
        else:
            while not joining.exists():
                time.sleep(0.05)
            time.sleep(10 if plain else 1)
    # a bounded timeout, so that a failed rendezvous ends the job instead of hanging it
    if plain:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
        rank = dist.get_rank()
    else:
        rank = init_parallel(tp=1, timeout=datetime.timedelta(seconds=30)).rank
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    (out / f"attempt{attempt}-rank{rank}.txt").write_text(f"{total.item():g}\n")
    if attempt == 0 and rank == 1:
        sys.exit("rank 1 fails on purpose on attempt 0")
    dist.barrier()  # on attempt 0 rank 0 waits here until torchrun stops it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
