"""One rank of a tensor-parallel throughput run, launched by bench_tensor_parallel.py.

Usage: tp_worker.py OUT.json TP SP STEPS. Trains the `tiny` Llama (no activation
checkpointing, fp32) on random tokens; rank 0 writes tokens/s over the timed steps and the
collectives one step issues (bytes per rank, by kind) to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from hlat_model import Llama, LlamaConfig, cross_entropy_loss
from hlat_optim import clip_grad_norm_
from hlat_parallel import (
    init_parallel,
    loss_parallel,
    parallelize,
    shard_optimizer,
)
from hlat_parallel.comm import CollectiveLog

BATCH, SEQ, WARMUP = 4, 256, 2


def main() -> None:
    out, tp, sp, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    dims = init_parallel(tp=tp, sp=sp)
    torch.manual_seed(0)
    config = LlamaConfig.preset("tiny")
    model = parallelize(Llama(config), dims, Llama(config).parallel_plan())
    optimizer = shard_optimizer(torch.optim.AdamW, model.parameters(), dims, lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1))

    def step() -> None:
        with loss_parallel(dims):
            loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        clip_grad_norm_(model.parameters(), 1.0, **dims.norm_groups())
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(WARMUP):
        step()
    with CollectiveLog() as log:
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    if dims.rank == 0:
        result = {
            "tokens_per_s": steps * BATCH * SEQ / elapsed,
            "seconds_per_step": elapsed / steps,
            "counts": dict(log.counts()),
            "bytes_per_rank": log.bytes_per_rank(),
            "config": {"batch": BATCH, "seq": SEQ, "dim": config.dim, "layers": config.n_layers},
        }
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
