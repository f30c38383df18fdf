"""One rank of the pipeline benchmark (tests: benchmarks/test_bench_pipeline.py).

Usage: pp_worker.py OUT M STEPS, as rank 0 or 1 of a 2-process gloo job (torchrun's
environment). For every schedule of ``hlat_parallel.SCHEDULES`` it builds a PP2 pipeline of
the same Llama with M micro-batches and measures

* the step: wall time of ``schedule.step`` between two barriers (median of STEPS, after one
  warm-up step);
* the busy time of each rank: the forward and backward of its own stage modules over the
  same M micro-batches, one after another in this process with no communication (inputs
  of the right shapes: token ids on the first stage, a hidden state elsewhere);

then, on the same model and global batch, a DP2 step (each rank the whole model on M/2
micro-batches, gradients all-reduced) and a single-process step on rank 0 (all M
micro-batches, one thread, while rank 1 waits). Rank 0 writes OUT (JSON).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from hlat_model import Llama, LlamaConfig, block_inputs, cross_entropy_loss
from hlat_parallel import SCHEDULES, bubble_fraction, build_pipeline

CONFIG = dict(
    vocab_size=1024, dim=256, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=688, max_seq_len=128
)
MICRO_BATCH, SEQ = 2, 128


def timed(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(out: str, m: int, steps: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig.preset("tiny", **CONFIG)
    model = Llama(config)
    tokens = torch.randint(0, config.vocab_size, (m * MICRO_BATCH, SEQ + 1))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand(m * MICRO_BATCH, SEQ)

    def block_args(h, position_ids):
        return block_inputs(config, position_ids)

    results: dict = {"config": {**CONFIG, "micro_batch": MICRO_BATCH, "seq": SEQ, "m": m}}
    for name in SCHEDULES:
        pipe = build_pipeline(
            copy.deepcopy(model),
            schedule=name,
            n_microbatches=m,
            loss_fn=cross_entropy_loss,
            block_args=block_args,
        )

        def step(pipe=pipe):
            kwargs: dict = {"position_ids": positions}
            if pipe.has_last_stage:
                kwargs.update(target=labels, losses=[])
            pipe.schedule.step(*([ids] if pipe.has_first_stage else []), **kwargs)
            for p in pipe.parameters():
                p.grad = None

        def busy(pipe=pipe):
            for module in pipe.modules:
                for i in range(m):
                    rows = slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH)
                    pos = positions[rows]
                    if module.split.first:
                        x = ids[rows]
                    else:
                        x = torch.randn(MICRO_BATCH, SEQ, config.dim, requires_grad=True)
                    y = module(x, position_ids=pos)
                    if module.split.last:
                        (cross_entropy_loss(y, labels[rows]) / m).backward()
                    else:
                        y.backward(torch.randn_like(y))
            for p in pipe.parameters():
                p.grad = None

        step_s = timed(step, steps)
        busy_s = timed(busy, steps)
        virtual = len(pipe.modules)
        per_rank = [None, None]
        dist.all_gather_object(per_rank, {"step_s": step_s, "busy_s": busy_s})
        results[name] = {
            "virtual": virtual,
            "theory": bubble_fraction(name, 2, m, virtual),
            "ranks": per_rank,
        }

    # DP2: the whole model per rank on half the micro-batches, gradients all-reduced
    dp_model = copy.deepcopy(model)
    half = slice(rank * m // 2 * MICRO_BATCH, (rank + 1) * m // 2 * MICRO_BATCH)

    def dp_step():
        for i in range(m // 2):
            rows = slice(half.start + i * MICRO_BATCH, half.start + (i + 1) * MICRO_BATCH)
            (cross_entropy_loss(dp_model(ids[rows]), labels[rows]) / m).backward()
        for p in dp_model.parameters():
            dist.all_reduce(p.grad)
            p.grad = None

    results["DP2"] = {"step_s": timed(dp_step, steps)}

    single_model = copy.deepcopy(model)

    def single_step():
        if rank == 0:
            for i in range(m):
                rows = slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH)
                (cross_entropy_loss(single_model(ids[rows]), labels[rows]) / m).backward()
            for p in single_model.parameters():
                p.grad = None

    results["single"] = {"step_s": timed(single_step, steps)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
