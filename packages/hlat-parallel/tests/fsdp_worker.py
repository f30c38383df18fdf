"""One rank of test_parity's FSDP checks beside the Llama runs, launched with torchrun's
environment on two processes (dp 2).

Usage: fsdp_worker.py WORKDIR. Reads WORKDIR/input.pt (the initial weights of ``Nested``
and ``Pair``, and a batch) written by the test, and writes WORKDIR/rank<r>.pt:

- ``nested``: the whole gradients of ``Nested`` (blocks that hold their own
  ``nn.ModuleList``) parallelized with ``dp_shard="fsdp"``, each rank on its half of the
  batch, and the names of its FSDP units;
- ``fsdp_calls``: what ``CollectiveLog`` records for one forward and backward of ``Pair``
  under FSDP (one unit: its root);
- ``direct_calls``: what it records for ``torch.distributed`` collectives of known size,
  per collective.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from spawn import end_worker
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hlat_parallel import init_parallel, parallelize
from hlat_parallel.comm import CollectiveLog

DIM = 8
N = 8  # elements of each rank's piece in the direct collectives


class Block(nn.Module):
    """A block keeping its layers in its own list, as MoE experts or sub-layers are."""

    def __init__(self) -> None:
        super().__init__()
        self.sub = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.sub:
            h = h + torch.tanh(layer(h))
        return h


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def pair() -> nn.Module:
    """Two layers whose every dimension 0 splits evenly over 2 ranks (FSDP pads nothing)."""
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 2))


def calls(log: CollectiveLog) -> list[tuple[str, int, int]]:
    return [(c.kind, c.payload_bytes, c.group_size) for c in log.calls]


def direct(rank: int) -> dict[str, list[tuple[str, int, int]]]:
    """Each collective on pieces of N fp32 elements per rank (whole tensors of 2 N)."""
    piece = torch.full((N,), float(rank))
    pieces = [torch.empty(N) for _ in range(2)]
    ops = {
        "all_reduce": lambda: dist.all_reduce(piece.clone()),
        "all_gather": lambda: dist.all_gather(pieces, piece),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(2 * N), piece),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(N), torch.ones(2 * N)
        ),
        "gather": lambda: dist.gather(piece, pieces if rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(torch.empty(N), pieces if rank == 0 else None, src=0),
    }
    out = {}
    for name, op in ops.items():
        with CollectiveLog() as log:
            op()
        out[name] = calls(log)
    return out


def main() -> None:
    workdir = Path(sys.argv[1])
    data = torch.load(workdir / "input.pt")
    dims = init_parallel(device="cpu")
    model = Nested()
    model.load_state_dict(data["nested"])
    parallelize(model, dims, {})
    units = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))
    rows = data["x"].shape[0] // dims.dp
    model(data["x"][dims.dp_rank * rows : (dims.dp_rank + 1) * rows]).sum().backward()
    grads = {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for n, p in model.named_parameters()
    }
    small = pair()
    small.load_state_dict(data["pair"])
    parallelize(small, dims, {})
    with CollectiveLog() as log:
        small(torch.randn(4, 16)).sum().backward()
    out = {
        "nested": {"grads": grads, "units": units},
        "fsdp_calls": calls(log),
        "direct_calls": direct(dims.rank),
    }
    torch.save(out, workdir / f"rank{dims.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
