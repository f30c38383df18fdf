"""One TP rank of test_neuron_training's initialisation test (gloo, CPU).

The weights NxD splits carry its ``tensor_model_parallel`` attribute; here the plan's
non-norm layers get it, on whole-size weights (``init_sharded_weights`` reads only the
attribute). The norm weights are drawn at random too, so that their agreement over TP comes
from the synchronisation, not from ``reset_parameters`` filling ones.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from spawn import end_worker

from hlat_model import Llama, LlamaConfig
from hlat_parallel import ParallelDims, match_plan
from hlat_parallel.neuron_backend import init_sharded_weights, tp_seed

SEED = 11


def build() -> tuple[Llama, set[str]]:
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("tiny", n_layers=1, vocab_size=512))
    model.to_empty(device="cpu")
    split = set()
    for name, entry in match_plan(model, model.parallel_plan()).items():
        if entry.style != "norm":
            model.get_submodule(name).weight.tensor_model_parallel = True
            split.add(f"{name}.weight")
    return model, split


def init(model: Llama) -> None:
    model.init_weights()
    for name, param in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(param)


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dims = ParallelDims(
        world_size=2, rank=rank, tp=2, dp=1, sp=False, backend="neuron",
        device=torch.device("cpu"), tp_rank=rank, dp_rank=0, tp_group=dist.group.WORLD,
    )  # fmt: skip
    model, split = build()
    init_sharded_weights(model, dims, SEED, init=lambda: init(model))
    after = torch.rand(4)
    expected, _ = build()
    torch.manual_seed(tp_seed(SEED, rank))
    init(expected)
    torch.save(
        {
            "params": {n: p.detach() for n, p in model.named_parameters()},
            "expected": {n: p.detach() for n, p in expected.named_parameters()},
            "split": sorted(split),
            "after": after,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
