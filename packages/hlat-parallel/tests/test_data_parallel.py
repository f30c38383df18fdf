"""Data parallelism over two gloo processes with parameter groups and parameters that only
some ranks use, in one job of tests/data_parallel_worker.py, whose ranks compare their
gradients and weights with one process training on both ranks' batches."""

from __future__ import annotations

from pathlib import Path

from spawn import run_ranks

from hlat_parallel.dims import _torch_version

WORKER = Path(__file__).with_name("data_parallel_worker.py")


def test_generator_groups_experts_some_ranks_skip_and_gradients_of_another_dtype():
    """One job of two ranks, each case against one process:

    - weight-decay and no-decay groups whose ``params`` are generators: every group keeps
      its parameters, and one step under FSDP equals one process's (``shard_optimizer``);
    - rank 0 routes its batch to expert 0, rank 1 to expert 1, nobody to expert 2, under
      ``zero1`` and ``none``: after ``sync_gradients`` every gradient is the single-process
      average (a missing gradient counts as zeros), expert 2 keeps ``grad = None``, and a
      step with weight decay leaves it as one process does;
    - bf16 parameters with fp32 gradients (``grad_dtype``, torch 2.13), one gradient on
      rank 0 only: the average is taken in fp32 (in bf16 it loses the low bits), and the
      rank without the gradient gets it in fp32.
    """
    modes = ["groups", "experts-zero1", "experts-none"]
    run_ranks(WORKER, modes + (["grad-dtype"] if _torch_version() >= (2, 13) else []), 2)
