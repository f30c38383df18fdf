"""Data parallelism over two gloo processes with parameter groups and parameters that only
some ranks use: each case runs tests/data_parallel_worker.py, whose ranks compare their
gradients and weights with one process training on both ranks' batches."""

from __future__ import annotations

from pathlib import Path

import pytest
from spawn import run_ranks

from hlat_parallel.dims import _torch_version

WORKER = Path(__file__).with_name("data_parallel_worker.py")


def test_shard_optimizer_keeps_parameter_groups_given_as_generators_and_trains():
    """Weight-decay and no-decay groups whose ``params`` are generators: every group keeps
    its parameters, and one step under FSDP equals one process's."""
    run_ranks(WORKER, ["groups"], 2)


@pytest.mark.parametrize("dp_shard", ["zero1", "none"])
def test_experts_used_by_some_ranks_average_like_one_process(dp_shard):
    """Rank 0 routes its batch to expert 0, rank 1 to expert 1, nobody to expert 2: after
    ``sync_gradients`` every gradient is the single-process average (a missing gradient
    counts as zeros), expert 2 keeps ``grad = None``, and a step with weight decay leaves it
    as one process does."""
    run_ranks(WORKER, [f"experts-{dp_shard}"], 2)


@pytest.mark.skipif(
    _torch_version() < (2, 13), reason="a parameter's grad_dtype is new in torch 2.13"
)
def test_gradients_of_another_dtype_than_their_parameters_are_summed_in_theirs():
    """bf16 parameters with fp32 gradients (``grad_dtype``), one gradient on rank 0 only:
    the average is taken in fp32 (in bf16 it loses the low bits), and the rank without the
    gradient gets it in fp32."""
    run_ranks(WORKER, ["grad-dtype"], 2)
