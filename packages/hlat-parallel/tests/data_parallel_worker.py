"""One rank of a two-process data-parallel job, launched by tests/test_data_parallel.py with
torchrun's environment; each mode checks its results against one process on this rank and
exits non-zero when they differ.

Usage: data_parallel_worker.py MODE..., each MODE one of (run in the order given, in one
process group)

- ``groups``: FSDP (``dp_shard="fsdp"``), ``shard_optimizer`` given weight-decay and
  no-decay parameter groups whose ``params`` are generators, as they are usually built from
  ``named_parameters()``; one AdamW step.
- ``experts-zero1``, ``experts-none``: a shared layer and three experts; rank 0's batch
  goes to expert 0, rank 1's to expert 1, no batch to expert 2. ``sync_gradients`` and one
  AdamW step (ZeRO-1 or a plain one over whole parameters).
- ``grad-dtype``: bf16 parameters with fp32 gradients (``grad_dtype``), one gradient held by
  rank 0 only; ``sync_gradients``.

The single-process reference is the same model trained on both ranks' batches, its loss
the mean of the two ranks' losses (what data parallelism averages).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from spawn import end_worker
from torch import nn
from torch.distributed.tensor import DTensor

from hlat_parallel import init_parallel, parallelize, shard_optimizer, sync_gradients
from hlat_parallel import zero1_optimizer as zero1

LR, DECAY = 1e-2, 0.1


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def batch(rank: int) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))


def check_close(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


class Experts(nn.Module):
    """A shared layer, then the expert a batch is routed to."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.experts[expert](torch.relu(self.shared(x)))


def decay_groups(model: nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": (p for n, p in named if n.endswith("weight")), "weight_decay": DECAY},
        {"params": (p for n, p in named if n.endswith("bias")), "weight_decay": 0.0},
    ]


def groups(dims) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    parallelize(model, dims, {})
    optimizer = shard_optimizer(torch.optim.AdamW, decay_groups(model), dims, lr=LR)
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]
    model(batch(dims.dp_rank)).square().mean().backward()
    optimizer.step()

    expected = torch.optim.AdamW(decay_groups(reference), lr=LR)
    loss = sum(reference(batch(r)).square().mean() for r in range(dims.dp))
    (loss / dims.dp).backward()
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    expected.step()
    for (name, param), (_, ref) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert not torch.equal(ref.detach(), start[name]), name
        check_close(name, full(param), ref.detach())


def experts(dims, dp_shard: str) -> None:
    torch.manual_seed(0)
    model = Experts()
    reference = copy.deepcopy(model)
    parallelize(model, dims, {}, dp_shard=dp_shard)
    if dp_shard == "zero1":
        optimizer = zero1(torch.optim.AdamW, model.parameters(), dims, lr=LR, weight_decay=DECAY)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    model(batch(dims.dp_rank), expert=dims.dp_rank).square().mean().backward()
    sync_gradients(model, dims)

    loss = sum(reference(batch(r), expert=r).square().mean() for r in range(dims.dp))
    (loss / dims.dp).backward()
    for (name, param), (_, ref) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        if ref.grad is None:  # expert 2: no rank had a gradient, the optimizer skips it
            assert param.grad is None, f"{name}: a gradient where no rank computed one"
        else:
            assert param.grad is not None, f"{name}: no gradient after sync_gradients"
            check_close(f"{name}.grad", full(param.grad), ref.grad)
    optimizer.step()
    torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=DECAY).step()
    for (name, param), (_, ref) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        check_close(name, full(param), ref.detach())


def grad_dtype(dims) -> None:
    """bf16 parameters whose gradients are fp32 (``grad_dtype``): summed in fp32, and made
    in fp32 on the rank that had none."""
    layer = nn.Linear(4, 4).to(torch.bfloat16)
    layer.weight.grad_dtype = torch.float32
    layer.bias.grad_dtype = torch.float32
    # 1 + 2^-12 is below bf16's resolution at 1: an average taken in bf16 gives 1
    layer.weight.grad = torch.full((4, 4), 1 + 2**-12 if dims.dp_rank == 0 else 1.0)
    if dims.dp_rank == 0:
        layer.bias.grad = torch.full((4,), 1 + 2**-11)
    sync_gradients(layer, dims)
    assert layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, torch.full((4, 4), 1 + 2**-13))
    assert torch.equal(layer.bias.grad, torch.full((4,), (1 + 2**-11) / 2))


def main() -> None:
    dims = init_parallel()
    assert dims.dp == 2
    for mode in sys.argv[1:]:
        if mode == "groups":
            groups(dims)
        elif mode == "grad-dtype":
            grad_dtype(dims)
        else:
            experts(dims, mode.removeprefix("experts-"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
