"""hlat-parallel: tensor, sequence, data (FSDP, ZeRO-1), pipeline and context parallelism from plain
data.

>>> from hlat_parallel import init_parallel, parallelize
"""

from hlat_parallel.apply import DP_SHARD, compile_blocks, parallelize, resolve_dp_shard
from hlat_parallel.context import (
    ContextParallelAttention,
    apply_context_parallel,
    check_context_parallel,
    cp_indices,
    shard_sequence,
    unshard_sequence,
)
from hlat_parallel.device import (
    DeviceError,
    check_device,
    compile_backend_for,
    dist_backend_for,
    pins_memory,
    resolve_device,
)
from hlat_parallel.dims import (
    ParallelConfigError,
    ParallelDims,
    check_parallel_config,
    init_parallel,
)
from hlat_parallel.pipeline import (
    SCHEDULES,
    Pipeline,
    RankModule,
    StageModule,
    StageSplit,
    bubble_fraction,
    build_pipeline,
    build_schedule,
    check_microbatches,
    check_schedule,
    default_virtual,
    rank_module,
    split_layers,
    stage_ids,
    stage_modules,
    stage_plan,
)
from hlat_parallel.plan import PlanEntry, match_plan, parse_plan
from hlat_parallel.torch_backend import loss_parallel
from hlat_parallel.zero import no_grad_sync, shard_optimizer
from hlat_parallel.zero1 import Zero1Optimizer, sync_gradients, zero1_optimizer

__version__ = "0.9.3"

__all__ = [
    "DP_SHARD",
    "SCHEDULES",
    "ContextParallelAttention",
    "DeviceError",
    "ParallelConfigError",
    "ParallelDims",
    "Pipeline",
    "PlanEntry",
    "RankModule",
    "StageModule",
    "StageSplit",
    "Zero1Optimizer",
    "apply_context_parallel",
    "bubble_fraction",
    "build_pipeline",
    "build_schedule",
    "check_context_parallel",
    "check_device",
    "check_microbatches",
    "check_parallel_config",
    "check_schedule",
    "compile_backend_for",
    "compile_blocks",
    "cp_indices",
    "default_virtual",
    "dist_backend_for",
    "init_parallel",
    "loss_parallel",
    "match_plan",
    "no_grad_sync",
    "parallelize",
    "parse_plan",
    "pins_memory",
    "rank_module",
    "resolve_device",
    "resolve_dp_shard",
    "shard_optimizer",
    "shard_sequence",
    "split_layers",
    "stage_ids",
    "stage_modules",
    "stage_plan",
    "sync_gradients",
    "unshard_sequence",
    "zero1_optimizer",
]
