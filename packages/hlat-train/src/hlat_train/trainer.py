"""`Trainer(config).fit()`: the training loop, flat enough to read from top to bottom."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hlat_train import neuron
from hlat_train.compiling import resolve_compile
from hlat_train.config import ConfigError, TrainConfig
from hlat_train.host_memory import resolve_host_malloc
from hlat_train.interval import AUTO, FIRST_SAVE_STEPS, plan_interval
from hlat_train.metrics import (
    MetricsWriter,
    Progress,
    _synchronize,
    device_peak_tflops,
    memory_gib,
    plot_metrics,
    read_metrics,
)
from hlat_train.neuron import apply_neuron_env, mark_step
from hlat_train.precision import resolve_precision
from hlat_train.spike import (
    GUARD_FILE,
    SpikeGuard,
    read_guard_file,
    remove_guard_file,
    write_guard_file,
)
from hlat_train.validation import validate
from hlat_train.watchdog import HangWatchdog, process_group_timeout
from hlat_train.watchdog import describe as describe_watchdog

PEAK_CACHE_NAME = "peak_tflops.json"  # in train.out_dir: the measured peak, for restarts
# fields of hlat_model.LlamaConfig that a resume may change: how the model runs, and its
# initialisation (which a checkpoint replaces); every other field defines the network
NOT_ARCHITECTURE = (
    "max_seq_len",
    "checkpointing",
    "attention",
    "sequence_first",
    "init_std",
    "scaled_init",
)
# what the optimizer keeps beyond AdamW's moments in each precision mode that keeps more:
# optimizer state loads into an optimizer of the same kind only (hlat_ckpt refuses others)
_OPTIMIZER_STATE = {"mixed": "fp32 master weights", "bf16-kahan": "a Kahan compensation"}


def _schedule_settings(fn: Any) -> dict[str, Any]:
    """The configuration of a learning-rate multiplier (``hlat_optim.CosineWithWarmup``'s
    slots)."""
    names = [n for n in getattr(type(fn), "__slots__", ()) if n != "__dict__"]
    return {n: getattr(fn, n) for n in names}


class TrainState:
    """Counters that are not in the model, optimizer, scheduler or loader: checkpointed."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens = 0
        self.micro_batches = 0
        self.bad_micro_batches: list[int] = []
        self.rollbacks = 0
        self.guard: SpikeGuard | None = None
        # the LR schedule's configuration this run trains with; on load, the saved one's
        self.schedule: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint."""
        return {
            "step": self.step,
            "tokens": self.tokens,
            "micro_batches": self.micro_batches,
            "bad_micro_batches": list(self.bad_micro_batches),
            "rollbacks": self.rollbacks,
            "guard": self.guard.state_dict() if self.guard else {},
            "schedule": [dict(s) for s in self.schedule],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters."""
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.micro_batches = int(state["micro_batches"])
        self.bad_micro_batches = [int(x) for x in state["bad_micro_batches"]]
        self.rollbacks = int(state["rollbacks"])
        if self.guard is not None and state["guard"]:
            self.guard.load_state_dict(state["guard"])
        # absent from checkpoints of hlat-train before 0.24, whose scheduler state held it
        self.schedule = [dict(s) for s in state.get("schedule", [])]


class GlobalLoaderState:
    """The data loader's checkpoint entry: the merged state of every data-parallel rank
    (``hlat_data.merge_states``), the same on each rank.

    Note: a checkpoint that holds each rank's own loader state can only be resumed at the
    same dp. The merged one resumes at any dp: with the same dp each rank takes its own
    cursor, with another dp ``PackedLoader.load_state_dict`` deals the documents of the
    current epoch that no old rank has read to the new ranks. Merging costs one
    ``all_gather_object`` over the dp group per save, on the host.
    """

    def __init__(self, loader: Any, group: Any) -> None:
        self.loader = loader
        self.group = group

    def state_dict(self) -> dict[str, Any]:
        from hlat_data import merge_states

        own = self.loader.state_dict()
        if self.group is None or dist.get_world_size(self.group) == 1:
            return merge_states([own])
        states: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(states, own, group=self.group)
        return merge_states(states)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class _Collector:
    """``train.gc_every``: Python's automatic garbage collection off for the loop, a
    young-generation collection (``gc.collect(1)``, as torchtitan's ``gc_freq``) after
    every ``every`` steps on every rank, and a full one before each checkpoint save (a
    pause already), so that what outlives the young collections is not kept for the whole
    run. What set-up left is collected once and frozen (``gc.freeze``) unless the process
    froze objects itself, so that those full collections skip the set-up's objects (the
    model, the libraries: about 130 ms a collection in the demo otherwise). :meth:`close`
    restores the collector's state. ``every`` 0: nothing changes."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._was_enabled = gc.isenabled()
        self._froze = every > 0 and gc.get_freeze_count() == 0
        if every > 0:
            gc.collect()
            if self._froze:
                gc.freeze()
            gc.disable()

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def collect(self) -> None:
        gc.collect(1)

    def before_save(self) -> None:
        if self.every > 0:
            gc.collect()

    def close(self) -> None:
        if self._froze:
            gc.unfreeze()
        if self.every > 0 and self._was_enabled:
            gc.enable()


class _Window:
    """What happened between two reads of the device: how many steps spiked and skipped
    their update and the first that spiked (device counters), the micro-batches of each step
    and the wall time (host), less the time spent in validation and checkpoint saves."""

    def __init__(self, device: torch.device, step: int) -> None:
        self.start_step = step
        self.start_time = time.perf_counter()
        self.paused_s = 0.0  # validation and save stalls: not part of any step's time
        self.spikes = torch.zeros((), dtype=torch.long, device=device)
        self.skipped = torch.zeros((), dtype=torch.long, device=device)
        self.first_spike = torch.zeros((), dtype=torch.long, device=device)  # 0: none
        self.batches: dict[int, list[int]] = {}

    def add(self, step: int, used: list[int], spike: torch.Tensor, skip: torch.Tensor) -> None:
        """Record one step (no host read)."""
        self.batches[step] = used
        self.first_spike = torch.where(spike & (self.first_spike == 0), step, self.first_spike)
        self.spikes += spike
        self.skipped += skip


def _stage_block_args(
    llama_config: Any,
    h: torch.Tensor,
    position_ids: torch.Tensor,
    doc_lens: torch.Tensor | None = None,
) -> tuple[Any, ...]:
    """The blocks' extra inputs on a pipeline stage, from the step's keyword arguments."""
    from hlat_model import block_inputs

    return block_inputs(llama_config, position_ids, doc_lens)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class Trainer:
    """Pre-trains the Llama that ``config`` describes, on every process torchrun started.

    ``Trainer(config)`` validates everything (config, files, parallel layout against the
    launched world size) before any process group exists; :meth:`fit` builds the pieces and
    runs: batch -> forward -> loss -> backward (x gradient accumulation) -> clip ->
    spike guard -> optimizer -> scheduler -> metrics -> validation -> checkpoint.

    It resumes from the newest complete checkpoint under ``checkpoint.dir``, saves a
    checkpoint and returns when the process receives SIGTERM (preemption), and leaves
    restarts after crashes to ``torchrun --max-restarts``.
    """

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local = os.environ.get("LOCAL_WORLD_SIZE")
        self.llama_config = validate(
            config, self.world_size, local_world_size=int(local) if local else None
        )
        if config.parallel.pp > 1:
            from hlat_parallel.dims import check_pipeline_torch

            try:  # this torch must run the pipeline; a plan for a cluster need not
                check_pipeline_torch()
            except ValueError as error:
                raise ConfigError(str(error)) from None
        self.preempted = False
        self.out_of_time = False
        self._sigterm_at: float | None = None
        self._created = time.monotonic()
        self._restart_s = math.nan  # construction to the end of this process's first step
        self._last_stats: Any = None  # the newest committed save's SaveStats
        self._save_seconds: list[float] = []  # the last three measured saves (save_s)
        self._deadline = math.inf
        self._last_index = -1
        self._spike_injections = set(config.spike.inject_at)
        self._nan_injections = set(config.spike.inject_nan_at)
        self._watchdog = HangWatchdog(-1.0, 0)  # fit() starts the configured one
        self._pending: tuple[Any, torch.Tensor] | None = None

    # --- setup -----------------------------------------------------------------------------

    def _compute_device_type(self) -> str:
        """The type of the device this run will compute on, known before any device is set
        up (``train.host_malloc = "auto"`` needs it first): ``xla`` on the NxD backend."""
        from hlat_parallel.device import accelerator

        if self.config.parallel.backend == "neuron":
            return "xla"
        spec = self.config.train.device
        if spec == "auto":
            found = accelerator()
            return found.type if found is not None else "cpu"
        return spec.split(":")[0]

    def _setup(self) -> None:
        from hlat_ckpt import Checkpointer
        from hlat_data import Tokenizer
        from hlat_model import (
            Llama,
            amx_attention_reason,
            bf16_flash_attention_reason,
            fp32_flash_attention_reason,
            fused_cpu_kernels_reason,
        )
        from hlat_optim import cosine_with_warmup
        from hlat_parallel import init_parallel, parallelize, pins_memory, resolve_dp_shard

        c = self.config
        # Note: before the process group and the model, so a refused policy stops the run
        # before any work, and the first large blocks already follow it
        try:
            host_malloc = resolve_host_malloc(c.train.host_malloc, self._compute_device_type())
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if c.parallel.backend == "neuron" and c.optim.precision == "auto":
            c.optim.precision = "bf16-sr"  # trn1's NeuronCores multiply bf16 (hlat_train.precision)
        if c.parallel.backend == "neuron":
            multi_node = self.world_size > int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
            apply_neuron_env(c.neuron, c.optim.precision, multi_node)
        backend: Any = c.parallel.backend
        # Note: torch's own collective timeout (30 min on gloo, 10 min on NCCL by default)
        # must not fire before the hang watchdog (train.hang_timeout): it would end a rank
        # that waits while another compiles its first step (the watchdog allows 30 min for
        # it), or report a hang with a less clear error (no rank, step or stacks of the
        # hung region). It must not be infinite either: it is the backstop for a rank
        # whose watchdog cannot run. So the process group waits the longest limit the
        # watchdog can apply plus a margin (hlat_train.watchdog.process_group_timeout);
        # without a watchdog, torch's default. The device mesh's sub-groups (tp, dp, ... on
        # layouts with several dimensions) keep torch's default, which torch does not let
        # a mesh inherit.
        pg_seconds = process_group_timeout(c.train.hang_timeout)
        self._pg_timeout = None if pg_seconds is None else datetime.timedelta(seconds=pg_seconds)
        # Note: init_parallel creates the process group on a store namespace of this
        # torchrun attempt, so workers restarted by --max-restarts rendezvous afresh.
        self.dims = dims = init_parallel(
            c.parallel.tp,
            c.parallel.sp,
            backend,
            pp=c.parallel.pp,
            cp=c.parallel.cp,
            device=c.train.device,
            dist_backend=c.parallel.dist_backend,
            timeout=self._pg_timeout,
        )
        self.rank0 = dims.rank == 0
        # Note: W&B starts its run here, before the model is built, so that one that cannot
        # (no credentials) stops the run at once; the run gets its config once resolved
        self._wandb: Any = None
        if self.rank0 and c.logging.wandb:
            from hlat_train.observe import WandbLogger

            self._wandb = WandbLogger(
                c.train.out_dir, c.logging.wandb_project, c.logging.wandb_name
            )
        self.device = device = dims.device
        self.dp_shard = resolve_dp_shard(c.parallel.dp_shard, dims.backend)

        self._log(
            f"parallel backend {dims.backend} ({dims.backend_reason}); device {device}, "
            f"process group {dims.dist_backend or 'none'}, {dims.world_size} process(es); "
            f"dp {dims.dp} sharding {self.dp_shard}"
        )
        self._log(
            describe_watchdog(c.train.hang_timeout)
            + (f"; process-group timeout {pg_seconds:g} s" if pg_seconds is not None else "")
        )
        # Note: "auto" is resolved in the run's config itself, so that everything after this
        # (model dtype, optimizer, metrics, plan notes, saved config) sees the mode it runs.
        asked = c.optim.precision
        choice = resolve_precision(asked, device)
        c.optim.precision = choice.mode
        self._log(choice.describe(asked))
        self._log(host_malloc.describe())
        compiled = resolve_compile(c.model.compile, c, device, world_size=self.world_size)
        self._log(compiled.describe(c.model.compile))
        c.model.compile = self.compile_blocks = compiled.on
        if device.type == "cpu":
            why = fused_cpu_kernels_reason()
            state = "on" if why is None else f"off, torch's operators instead ({why})"
            self._log(
                f"fused CPU kernels (RMSNorm, SwiGLU, RoPE, attention softmax, loss): {state}"
            )
            products = "AMX tiles" if amx_attention_reason() is None else "AVX512-BF16"
            for kernel, why in (
                (
                    f"bf16 flash attention (causal bf16, {products})",
                    bf16_flash_attention_reason(),
                ),
                (
                    "fp32 flash attention (causal fp32, AVX-512 or AVX2)",
                    fp32_flash_attention_reason(),
                ),
            ):
                self._log(f"{kernel}: {'on' if why is None else f'off ({why})'}")
        self._pin = pins_memory(device)
        self._control = None
        if self.world_size > 1:
            # Note: the stop flag travels on a host-side gloo group, so agreeing on it never
            # waits for the accelerator; on CPU runs the default group is already gloo.
            self._control = (
                dist.group.WORLD
                if dims.dist_backend == "gloo"
                else dist.new_group(backend="gloo", timeout=self._pg_timeout)
            )

        self.grad_accum = c.grad_accum(dims.dp)
        torch.manual_seed(c.train.seed)
        dtype = torch.float32 if c.optim.precision == "fp32" else torch.bfloat16
        with torch.device("meta"):
            llama = Llama(self.llama_config)
        sharded = c.train.init == "sharded" or (
            c.train.init == "auto" and llama.num_params() > 2_000_000_000
        )
        self.pipeline: Any = None
        model: torch.nn.Module
        if dims.pp > 1:
            model = self._build_pipeline(llama if sharded else None, dtype)
        elif sharded:
            # split first, then materialise and initialise only this rank's shards
            model = parallelize(
                llama.to(dtype),
                dims,
                llama.parallel_plan(),
                compile=self.compile_blocks,
                dp_shard=self.dp_shard,
            )
            model.to_empty(device=device)
            if dims.backend == "neuron":
                neuron.neuron_init_weights(model, dims, c.train.seed)
            else:
                llama.init_weights()
        else:
            # Note: every rank builds the whole model from the same seed and keeps its
            # shard, so any parallel layout starts from the same weights (and TP/DP
            # losses can be compared with one process)
            llama = Llama(self.llama_config).to(device, dtype)
            model = parallelize(
                llama,
                dims,
                llama.parallel_plan(),
                compile=self.compile_blocks,
                dp_shard=self.dp_shard,
            )
        if dims.cp > 1 and self.pipeline is None:
            from hlat_parallel import apply_context_parallel

            apply_context_parallel(model, dims.cp_mesh)
        self.model = model
        if c.model.init_from_hf:
            from hlat_model.hf_load import load_hf_weights

            read = load_hf_weights(model, c.model.init_from_hf, self.llama_config)
            self._log(
                f"weights from {c.model.init_from_hf} ({read / 1e6:.1f} M elements read by "
                "this rank; a checkpoint to resume from replaces them)"
            )
        # the modules that run (the pipeline stages, or the model) for FSDP's bookkeeping
        self.model_parts = self.pipeline.modules if self.pipeline is not None else [model]
        # values read from the device mean nothing while neuron_parallel_compile collects graphs
        self._extracting = dims.backend == "neuron" and neuron.extracting_graphs()
        if self._extracting:
            self._log(
                "neuron_parallel_compile is collecting graphs: nothing runs on the devices, "
                "and the losses, norms and spike verdicts read back are not acted on"
            )
        if dims.backend == "neuron":
            self._log(f"precision {neuron.describe_precision(c.optim.precision)}")
            self.optimizer = neuron.neuron_optimizer(c, model, dims)
        else:
            self.optimizer = self._optimizer(model, dims)
        self.scheduler = cosine_with_warmup(
            self.optimizer,
            warmup_steps=c.optim.warmup_steps,
            total_steps=c.optim.decay_steps or c.train.steps,
            min_lr_ratio=c.optim.min_lr_ratio,
            constant_steps=c.optim.constant_steps,
        )
        # the config's optimizer settings, which a checkpoint's must not replace on resume
        self._configured = (
            [_schedule_settings(fn) for fn in self.scheduler.lr_lambdas],
            list(self.scheduler.base_lrs),
            [
                {k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                for g in self.optimizer.param_groups
            ],
        )
        self.tokenizer = Tokenizer.from_file(
            c.data.tokenizer, num_threads=c.data.tokenizer_threads or None
        )
        self.loader = self._train_loader(dims)
        self._data_can_end = bool(c.data.sources) and all(
            s.epochs is not None or s.max_tokens is not None for s in c.data.sources
        )
        self.state = TrainState()
        self.state.schedule = [dict(s) for s in self._configured[0]]
        self.state.guard = SpikeGuard(
            c.spike.window,
            c.spike.k,
            c.spike.min_history,
            device,
            new_level_after=c.spike.new_level_after,
        )
        self.checkpointer: Any = (
            neuron.neuron_checkpointer(c, dims)
            if dims.backend == "neuron"
            else Checkpointer(
                c.checkpoint_dir,
                keep_last=c.checkpoint.keep_last,
                async_save=c.checkpoint.async_save,
                layout={
                    "tp": dims.tp,
                    "dp": dims.dp,
                    "sp": dims.sp,
                    "pp": dims.pp,
                    "cp": dims.cp,
                },
                verify_checksums=c.checkpoint.verify_checksums,
                rank_state_from=self._rank_state_from,
            )
        )
        self._unrecorded: list[int] = []  # committed steps whose directory lacks the config
        self._older_guard = False  # an older run's spike-guard file to remove (resume = false)
        self.checkpoint_state = {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            # the trn1 path keeps each rank's own loader state (resumes at its own dp only):
            # NxD's dp group is not one to gather host objects on
            "loader": (
                self.loader
                if dims.backend == "neuron"
                else GlobalLoaderState(self.loader, dims.dp_group if dims.dp > 1 else None)
            ),
            "trainer": self.state,
        }
        sinks: list[Any] = []
        if self._wandb is not None:
            self._wandb.update_config(dataclasses.asdict(c))
            sinks.append(self._wandb)
        self.writer = (
            MetricsWriter(c.train.out_dir, c.logging.jsonl, c.logging.tensorboard, sinks)
            if self.rank0
            else None
        )
        # Note: only rank 0 writes metrics, so only rank 0 measures a peak (once per run on
        # a CPU; restarts read it from out_dir) and the other ranks leave MFU undefined.
        if c.logging.peak_tflops:
            self.peak_tflops, self.peak_source = c.logging.peak_tflops, "logging.peak_tflops"
        elif self.rank0:
            cache = os.path.join(c.train.out_dir, PEAK_CACHE_NAME)
            self.peak_tflops, self.peak_source = device_peak_tflops(device, dims.backend, cache)
        else:
            self.peak_tflops, self.peak_source = math.nan, "rank 0 only"
        from hlat_model import flops_per_token

        self.flops_per_token = flops_per_token(self.llama_config, c.data.seq_len)

    def _build_pipeline(self, meta_model: Any, dtype: torch.dtype) -> torch.nn.Module:
        """Split the model into this rank's pipeline stages, parallelize each with the model's
        plan (TP/SP, then FSDP over dp x cp) and build the schedule; return the stages as one
        module under the model's own names (for the optimizer and the checkpoint).

        ``meta_model`` (sharded initialisation): the model on the meta device; each stage is
        materialised after it is split and initialised in place. Otherwise the whole model
        is built from the seed first, so every layout starts from the same weights.
        """
        from functools import partial

        from hlat_model import Llama, cross_entropy_loss
        from hlat_parallel import (
            StageModule,
            build_pipeline,
            match_plan,
            parallelize,
            stage_plan,
        )

        c, dims = self.config, self.dims
        model = meta_model if meta_model is not None else Llama(self.llama_config)
        model = model.to(self.device if meta_model is None else "meta", dtype)
        plan = model.parallel_plan()
        match_plan(model, plan)  # every pattern names a module of the whole model

        def prepare(stage: StageModule) -> None:
            parallelize(
                stage,
                dims,
                stage_plan(plan, stage),
                compile=self.compile_blocks,
                dp_shard=self.dp_shard,
            )
            if dims.cp > 1 and stage.split.layers:
                from hlat_parallel import apply_context_parallel

                apply_context_parallel(stage, dims.cp_mesh)
            if meta_model is not None:
                stage.to_empty(device=self.device)

        self.pipeline = build_pipeline(
            model,
            schedule=c.parallel.pp_schedule,
            n_microbatches=self.grad_accum,
            loss_fn=cross_entropy_loss,
            group=dims.pp_mesh,
            device=self.device,
            virtual=c.parallel.pp_virtual or None,
            split=c.parallel.pp_split or None,
            block_args=partial(_stage_block_args, self.llama_config),
            checkpoint_blocks=self.llama_config.checkpointing == "full",
            prepare=prepare,
        )
        if meta_model is not None:
            # the blocks of other ranks stay on the meta device, where initialising is a no-op
            model.init_weights()
        described = ", ".join(
            f"stage {s.index}: {'embedding + ' if s.first else ''}{len(s.layers)} block(s)"
            f"{' + head' if s.last else ''}"
            for s in self.pipeline.splits
        )
        self._log(
            f"pipeline {c.parallel.pp_schedule} over pp {dims.pp}, {self.grad_accum} "
            f"micro-batches per step; {described}"
        )
        return self.pipeline.rank_module()

    def _rank_state_from(self, saved: Any, saved_world: int) -> int:
        """The rank of a checkpoint whose loader, scheduler, counters and RNG this rank loads.

        Its own in the same layout. Saved at another pp, cp or tp but the same dp, the
        first rank of the same data-parallel replica there (every rank of a replica reads
        the same data), so a run resumes after changing its model-parallel layout. Saved at
        another dp, rank 0's: the loader entry holds every data-parallel rank's state
        (:class:`GlobalLoaderState`), and the scheduler and counters are the same on every
        rank. (A checkpoint of each rank's own loader state, from hlat-train before 0.7,
        resumes at its own dp only; the loader says so.)
        """
        dims = self.dims
        mine = {"tp": dims.tp, "dp": dims.dp, "pp": dims.pp, "cp": dims.cp}
        layout = {k: int(saved.get(k, 1)) for k in mine}
        if layout == mine and saved_world == dims.world_size:
            return dims.rank
        if layout["dp"] != dims.dp:
            return 0
        # mesh ("pp", "dp", "cp", "tp"): pp 0, this dp rank, cp 0, tp 0
        return dims.dp_rank * layout["cp"] * layout["tp"]

    def _optimizer(self, model: torch.nn.Module, dims: Any) -> torch.optim.Optimizer:
        """hlat-optim's AdamW in the configured precision mode, its state sharded over DP
        as ``parallel.dp_shard`` says (with the parameters under FSDP, alone under ZeRO-1,
        not at all under ``none``)."""
        from hlat_optim import AdamW
        from hlat_parallel import shard_optimizer, zero1_optimizer

        o = self.config.optim
        build: Any = {
            "fsdp": shard_optimizer,
            "zero1": zero1_optimizer,
            "none": lambda cls, params, _dims, **kw: cls(params, **kw),
        }[self.dp_shard]
        return build(
            AdamW,
            model.parameters(),
            dims,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            # bf16-kahan: Kahan-compensated parameters, states with stochastic rounding
            stochastic_rounding=o.precision in ("bf16-sr", "bf16-kahan"),
            master_weights=o.precision == "mixed",
            kahan_sum=o.precision == "bf16-kahan",
            seed=self.config.train.seed,
            impl=o.impl,
        )

    def _log(self, text: str) -> None:
        if self.rank0:
            print(f"hlat-train: {text}", file=sys.stderr, flush=True)

    # --- the loop --------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train up to ``train.steps`` (from the newest checkpoint when there is one).

        Returns a summary: ``step`` reached, ``resumed_from``, ``preempted``, ``first_loss``
        and ``last_loss`` of this process's run (NaN when it trained no step: resumed at
        ``train.steps``), and the output paths.

        Note: a step reads nothing from the device. Loss, gradient norm and the spike
        verdict stay device tensors; the spike guard's verdict reaches the optimizer as a
        device-side skip. They are read on the host only on logged steps (every
        ``logging.every``), before a checkpoint and at the end. The ranks agree on stopping
        (SIGTERM, time limit) through a host-side all-reduce that is one step behind.

        A hang watchdog (``train.hang_timeout``, :mod:`hlat_train.watchdog`) runs from the
        start of set-up to the end: the loop tells it when each step and each region of a
        step begins, and a rank that stays in one region too long (a stopped peer, a hung
        collective) prints where it was and exits, so torchrun restarts the job.
        """
        # Note: RANK from torchrun's environment, as the process group does not exist yet
        self._watchdog = HangWatchdog(
            self.config.train.hang_timeout, int(os.environ.get("RANK", "0"))
        ).start()
        try:
            return self._fit(self._watchdog)
        finally:
            self._watchdog.close()

    def _fit(self, watchdog: HangWatchdog) -> dict[str, Any]:
        """:meth:`fit`, its progress reported to ``watchdog``."""
        c = self.config
        watchdog.activity("set-up (process group, model, data)", region="startup")
        self._setup()
        watchdog.activity("checkpoint load", region="startup")
        resumed = None
        if c.checkpoint.resume:
            # the newest checkpoint's model is checked before anything is read; an older one
            # loaded instead (the newest failed its checks) is checked once loaded
            checked = self._check_trained_model(None)
            resumed = self.checkpointer.load_latest(self.checkpoint_state)
            if resumed is not None and resumed != checked:
                self._check_trained_model(resumed)
        else:
            self._start_over()
        if resumed is not None:
            self._log(f"resumed from step {resumed} of {c.checkpoint_dir}")
            if resumed >= c.train.steps:
                self._log(
                    f"train.steps is {c.train.steps}: nothing left to train (raise train.steps "
                    "to train on from this checkpoint)"
                )
            self._apply_configured_optimizer(resumed)
        if self.rank0:
            from hlat_train.export import save_run_files

            # Note: after the checks above, so a refused resume leaves the run's files as
            # they were
            save_run_files(c, c.checkpoint_dir)
        if c.checkpoint.resume:
            self._restore_guard_file()
        start = self.state.step
        previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        # with the bar off, its lines (spikes, validation losses) go to the log
        progress = Progress(c.train.steps, start, c.logging.progress and self.rank0, self._log)
        batches = self._batches()
        tokens_per_step = c.data.seq_len * c.data.micro_batch_size * self.grad_accum * self.dims.dp
        first_loss: torch.Tensor | None = None
        last_loss: torch.Tensor | None = None
        if c.train.time_limit:
            self._deadline = time.monotonic() + c.train.time_limit
        last_saved = start if resumed is not None else -1
        skip_final_save = False  # SIGTERM with no time left for a save
        auto_every = c.checkpoint.every == AUTO
        next_save = start + FIRST_SAVE_STEPS  # with checkpoint.every = "auto"
        since = (start, time.monotonic())  # (step, time) the current interval began

        def checkpoint_step(step: int) -> bool:
            if auto_every:
                return step >= next_save
            return step % int(c.checkpoint.every) == 0

        window = _Window(self.device, start)
        from hlat_train.observe import MemorySnapshot, StepProfiler

        profiler = StepProfiler(
            c.train.out_dir, self.dims.rank, c.logging.profile_steps, self.device
        )
        snapshot = MemorySnapshot(
            c.train.out_dir, self.dims.rank, c.logging.memory_snapshot_step, self.device
        )
        if snapshot.note:
            self._log(snapshot.note)
        collector = _Collector(c.train.gc_every)
        try:
            out_of_data = False
            while self.state.step < c.train.steps:
                step = self.state.step + 1
                watchdog.beat(step, "forward/backward")
                drawn = self._draw_step(batches)
                if drawn is None:
                    # the data has ended, on every rank at this step: the steps since the last
                    # read of the device are read, logged (a rollback may act) and saved below,
                    # as at the last step
                    out_of_data, step, stop, compute_s = True, self.state.step, False, math.nan
                    watchdog.activity("end of the data (read, log, save of the last step)")
                    if window.start_step >= step:  # none since the last read
                        break
                else:
                    profiler.begin(step)
                    step_start = time.perf_counter()
                    logged = step % c.logging.every == 0 or step == c.train.steps

                    # forward and backward over the micro-batches of one optimizer step
                    micro_batches, used = drawn
                    loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
                    if self.pipeline is not None:
                        loss_sum += self._pipeline_step(micro_batches, train=True)
                    for micro in range(self.grad_accum if self.pipeline is None else 0):
                        last_micro = micro == self.grad_accum - 1
                        loss = self._forward_backward(micro_batches[micro], last_micro)
                        loss_sum += loss.detach()
                    compute_s = math.nan
                    if logged:  # this step's device work, timed on the steps that read the device
                        if self.dims.backend == "torch":  # XLA runs the step at mark_step instead
                            _synchronize(self.device)
                        compute_s = time.perf_counter() - step_start
                    watchdog.activity("loss all-reduce")
                    loss_value = self._mean_over_dp(loss_sum)
                    if step in self._spike_injections:  # a drill: see SpikeConfig.inject_at
                        self._spike_injections.discard(step)
                        loss_value = loss_value * 100.0
                    if step in self._nan_injections:  # a drill: see SpikeConfig.inject_nan_at
                        self._nan_injections.discard(step)
                        loss_value = loss_value * math.nan

                    watchdog.activity("optimizer step")
                    grad_norm, spike, skip = self._update(loss_value)
                    if self.state.guard is not None:
                        self.state.guard.accept(loss_value, ~spike)
                    self.optimizer.zero_grad(set_to_none=True)
                    lr = float(self.scheduler.get_last_lr()[0])  # the rate this step used
                    self.scheduler.step()
                    mark_step()
                    self.state.step = step
                    self.state.tokens += tokens_per_step
                    window.add(step, used, spike, skip)
                    if first_loss is None:
                        first_loss = loss_value
                    last_loss = loss_value

                    watchdog.activity("stop-flag all-reduce")
                    stop = self._stop_requested(step == c.train.steps)
                    if collector.due(step):
                        watchdog.activity("garbage collection")
                        collector.collect()
                if math.isnan(self._restart_s):
                    self._restart_s = time.monotonic() - self._created
                fresh = not out_of_data  # this pass ran a step
                save = (fresh and (checkpoint_step(step) or step == c.train.steps or stop)) or (
                    out_of_data and step > last_saved
                )
                if stop and self.preempted and not self._preempt_save_fits(step, last_saved):
                    save, skip_final_save = False, True
                # the step a stop (SIGTERM, time limit) ends at is logged when it is saved
                # (without time left for the save, the loop ends without reading the device)
                log = (
                    step % c.logging.every == 0
                    or step == c.train.steps
                    or out_of_data
                    or (stop and save)
                )
                if log or save:
                    watchdog.activity("metrics (device read, all-reduces)")
                    # The device is read here, once. The verdicts since the last read come
                    # first, so a rollback never saves or logs a state past a spike.
                    seen = self._read(window, loss_value, grad_norm, spike, skip, log)
                    if (
                        seen["first_spike"]
                        and c.spike.policy == "rollback"
                        and not self._extracting
                    ):
                        first = int(seen["first_spike"])
                        watchdog.activity("spike rollback (checkpoint load)", region="startup")
                        batches = self._rollback(first, window.batches[first], batches)
                        window = _Window(self.device, self.state.step)
                        # the checkpoint loaded may be older than the last save (one past a
                        # damaged checkpoint): the steps after it are unsaved again
                        last_saved = min(last_saved, self.state.step)
                        out_of_data = False  # the data is read again from the checkpoint's place
                        continue
                if log:
                    record = self._metrics(step, seen, lr, window, tokens_per_step, compute_s)
                    if self.writer:
                        self.writer.write(record)
                    progress.update(
                        step,
                        f"loss {record['loss']:.3f} lr {record['lr']:.2e} "
                        f"{record['tokens_per_s']:.0f} tok/s",
                    )
                    if record["spikes"]:
                        band = (
                            f"; the band is now loss <= {self.state.guard.limit():.4f}"
                            if self.state.guard is not None
                            else ""
                        )
                        progress.write(
                            f"step {step}: {record['spikes']} loss spike(s) since the last log, "
                            f"{record['skipped']} update(s) skipped (policy {c.spike.policy})"
                            f"{band}"
                        )
                    window = _Window(self.device, step)
                paused = time.perf_counter()
                if fresh and c.train.eval_every and step % c.train.eval_every == 0:
                    watchdog.activity("validation", region="long")
                    self._validate(step, progress)
                if save:
                    if not c.train.eval_every and c.data.held_out_sets() and checkpoint_step(step):
                        watchdog.activity("validation", region="long")
                        self._validate(step, progress)
                    watchdog.activity("checkpoint save", region="long")
                    collector.before_save()
                    self.checkpointer.save(step, self.checkpoint_state)
                    last_saved = step
                self._log_saves()
                self._record_configs()  # a synchronous save's, committed by now
                window.paused_s += time.perf_counter() - paused
                if save and auto_every and fresh and not stop and step < c.train.steps:
                    watchdog.activity("checkpoint interval all-reduce", region="long")
                    step_s = (time.monotonic() - since[1]) / max(1, step - since[0])
                    next_save = step + self._auto_interval(step, step_s)
                    since = (step, time.monotonic())
                if c.logging.profile_steps or c.logging.memory_snapshot_step:
                    watchdog.activity("profiler and memory snapshot", region="long")
                if fresh:
                    profiler.end(step)
                    snapshot.after(step)
                if out_of_data:
                    break
                if stop:
                    reason = "time limit" if self.out_of_time else "SIGTERM"
                    saved = "no save (see above)" if skip_final_save else f"saved step {step}"
                    self._log(f"{reason}: {saved}, exiting")
                    break
            if out_of_data:
                self._log(
                    f"the training data ran out after step {self.state.step} of train.steps "
                    f"{c.train.steps}: every source of the mixture reached its epochs or "
                    "max_tokens cap (data.sources); the last step is saved. To train "
                    "on, raise a cap or add a source and run again with "
                    "data.mixture_change = 'continue'"
                )
            if self.state.step > last_saved and self.state.step > 0 and not skip_final_save:
                watchdog.activity("checkpoint save (final)", region="long")
                collector.before_save()
                self.checkpointer.save(self.state.step, self.checkpoint_state)
            watchdog.activity("checkpoint wait (final)", region="long")
            self.checkpointer.wait()
            self._log_saves()
            self._record_configs()
        except torch.OutOfMemoryError:
            snapshot.on_oom()
            raise
        finally:
            collector.close()  # first: what follows may raise (a stopped peer's all-reduce)
            watchdog.activity("end of the run (profiler, stop flag, metrics)", region="long")
            profiler.close()
            self._finish_stop_flag()
            progress.close()
            signal.signal(signal.SIGTERM, previous_handler)
        summary = {
            "step": self.state.step,
            "resumed_from": resumed,
            "preempted": self.preempted,
            "out_of_time": self.out_of_time,
            "out_of_data": out_of_data,
            "first_loss": math.nan if first_loss is None else float(first_loss),
            "last_loss": math.nan if last_loss is None else float(last_loss),
            "out_dir": c.train.out_dir,
            "checkpoint_dir": c.checkpoint_dir,
        }
        if self.writer:
            self.writer.close()
            if c.logging.plot and c.logging.jsonl:
                plot = os.path.join(c.train.out_dir, "training.png")
                if plot_metrics(read_metrics(self.writer.path), plot):
                    summary["plot"] = plot
        return summary

    # --- pieces of a step ------------------------------------------------------------------

    def _draw_step(self, batches: Iterator[Any]) -> tuple[list[Any], list[int]] | None:
        """The micro-batches of the next step and their indices, or ``None`` where the data
        has ended: on every rank alike, so that no rank leaves the loop while others wait in
        a collective.

        Note: only a mixture whose every source is capped can end (``data.sources`` with
        ``epochs`` or ``max_tokens``), and its ranks end after different numbers of batches;
        there the ranks agree each step with an all-reduce (MIN) of one host integer on the
        gloo control group, which never waits for the device. Other data never ends.
        """
        micro_batches: list[Any] = []
        used: list[int] = []
        for _ in range(self.grad_accum):
            batch = next(batches, None)
            if batch is None:
                break
            micro_batches.append(batch)
            used.append(self._last_index)
        have = len(micro_batches) == self.grad_accum
        if self._data_can_end and self._control is not None:
            flag = torch.tensor([int(have)], dtype=torch.int32)
            dist.all_reduce(flag, dist.ReduceOp.MIN, self._control)
            have = bool(flag.tolist()[0])
        return (micro_batches, used) if have else None

    def _batches(self) -> Iterator[Any]:
        """Micro-batches, skipping the ones a rollback marked bad; counts what it consumes."""
        for batch in self.loader:
            index = self.state.micro_batches
            self.state.micro_batches += 1
            if index in self.state.bad_micro_batches:
                continue
            self._last_index = index
            yield batch

    def _to_device(self, array: Any) -> torch.Tensor:
        """A batch array as a long tensor on the device, copied from page-locked memory
        without blocking where the device supports it (see ``hlat_parallel.pins_memory``)."""
        host = torch.from_numpy(array).to(torch.long)
        if self._pin:
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)

    def _forward_backward(self, batch: Any, sync: bool) -> torch.Tensor:
        from hlat_parallel import loss_parallel, no_grad_sync

        # Note: gradients are only reduced across data-parallel ranks on the last micro-step
        no_sync = contextlib.nullcontext() if sync else no_grad_sync(self.model)
        with no_sync, loss_parallel(self.dims):
            kwargs: dict[str, torch.Tensor] = {}
            if self.config.data.document_mask:
                ids = self._to_device(batch.input_ids)
                kwargs["position_ids"] = self._to_device(batch.position_ids)
                kwargs["doc_lens"] = self._to_device(batch.doc_lens)
            elif self.dims.cp > 1:
                ids = self._tokens(batch.input_ids)
                kwargs["position_ids"] = self._cp_positions(ids.shape[0])
            else:
                ids = self._to_device(batch.input_ids)
            labels = self._tokens(batch.labels)
            if self.dims.backend == "neuron":
                loss = neuron.neuron_loss(self.model(ids, **kwargs), labels)
            else:
                # the model's own loss: the LM head and the loss fused where that pays
                # (``hlat_model.linear_cross_entropy``), else through the logits
                loss = self.model(ids, labels=labels, **kwargs)
            loss = loss / self.grad_accum
            loss.backward()
        return _full(loss)

    def _pipeline_step(self, micro_batches: list[Any], train: bool) -> torch.Tensor:
        """One pipeline schedule step over ``micro_batches`` (forward and backward, or
        forward only); the mean loss, known on the last stage and summed over "pp" so every
        rank has it (a 0-d fp32 device tensor, nothing read on the host).

        Note: the schedule divides the gradients by the number of micro-batches, as the
        loop without a pipeline divides each micro-batch's loss.
        """
        from hlat_parallel import loss_parallel

        pipe, c = self.pipeline, self.config
        ids = self._tokens(np.concatenate([b.input_ids for b in micro_batches]))
        kwargs: dict[str, Any] = {}
        if self.dims.cp > 1:
            kwargs["position_ids"] = self._cp_positions(ids.shape[0])
        elif c.data.document_mask:
            kwargs["position_ids"] = self._to_device(
                np.concatenate([b.position_ids for b in micro_batches])
            )
            width = max(b.doc_lens.shape[1] for b in micro_batches)
            kwargs["doc_lens"] = self._to_device(
                np.concatenate(
                    [
                        np.pad(b.doc_lens, ((0, 0), (0, width - b.doc_lens.shape[1])))
                        for b in micro_batches
                    ]
                )
            )
        else:
            kwargs["position_ids"] = torch.arange(c.data.seq_len, device=self.device).expand(
                ids.shape[0], c.data.seq_len
            )
        losses: list[torch.Tensor] = []
        if pipe.has_last_stage:
            kwargs.update(
                target=self._tokens(np.concatenate([b.labels for b in micro_batches])),
                losses=losses,
            )
        args = (ids,) if pipe.has_first_stage else ()
        with loss_parallel(self.dims):
            if train:
                pipe.schedule.step(*args, return_outputs=False, **kwargs)
            else:
                pipe.schedule.eval(*args, **kwargs)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            loss = torch.stack([_full(x).detach().float() for x in losses]).mean()
        dist.all_reduce(loss, group=self.dims.pp_group)
        return loss

    def _log_saves(self) -> None:
        """A ``"checkpoint"`` metrics record for each save committed since the last call
        (an async save's once its background write is done): ``stall_s`` the training loop
        was blocked in ``save()`` (of which ``wait_s`` waiting for the previous save),
        ``write_s`` writing, checksumming (``checksum_s``) and committing (in the background
        for ``async_save``), ``save_s`` from the call to the commit, the ``bytes`` and
        ``files`` of the whole checkpoint, and ``rank_bytes`` rank 0 staged and wrote (its
        shards and its share of the replicated tensors)."""
        for s in self.checkpointer.pop_save_stats():
            self._save_seconds = [*self._save_seconds[-2:], s.save_s]
            self._last_stats = s
            self._unrecorded.append(s.step)
            if self.writer:
                self.writer.write(
                    {
                        "kind": "checkpoint",
                        "step": s.step,
                        "async_save": s.async_save,
                        "stall_s": s.stall_s,
                        "wait_s": s.wait_s,
                        "write_s": s.write_s,
                        "checksum_s": s.checksum_s,
                        "save_s": s.save_s,
                        "bytes": s.bytes,
                        "files": s.files,
                        "rank_bytes": getattr(s, "rank_bytes", 0),
                    }
                )

    def _mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks holding different tokens: data-parallel replicas and,
        under context parallelism, the shards of each sequence (equal token counts)."""
        if self.dims.dp_cp > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.dims.dp_cp_group)
            value /= self.dims.dp_cp
        return value

    def _tokens(self, array: Any) -> torch.Tensor:
        """A [B, S] batch array on the device; this rank's tokens of each row under context
        parallelism (``hlat_parallel.shard_sequence``)."""
        tokens = self._to_device(array)
        if self.dims.cp > 1:
            from hlat_parallel import shard_sequence

            tokens = shard_sequence(tokens, self.dims.cp, self.dims.cp_rank, dim=1)
        return tokens

    def _cp_positions(self, rows: int) -> torch.Tensor:
        """Global positions of this rank's tokens under context parallelism, [rows, S / cp]."""
        from hlat_parallel import cp_indices

        seq_len = self.config.data.seq_len
        positions = cp_indices(seq_len, self.dims.cp, self.dims.cp_rank, device=self.device)
        return positions.expand(rows, -1)

    def _update(self, loss: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        """Clip, judge and step the optimizer: (grad norm, spike, skip) as device tensors.

        Note: NxD's ZeRO-1 (trn1) computes and clips the gradient norm inside ``step()`` and
        takes no skip flag, so there the guard judges the loss alone and the verdict is read
        on the host before the step (one XLA graph execution per step): under every policy a
        non-finite loss must not reach the weights, and ``skip`` and ``rollback`` also drop
        a spike's update (:func:`~hlat_train.neuron.neuron_step`).
        """
        from hlat_optim import clip_coefficient, global_norm
        from hlat_parallel import sync_gradients

        if self.dims.backend == "neuron":
            spike, skip = self._judge(loss, torch.zeros_like(loss))
            skipped = neuron.neuron_step(self.optimizer, skip, self._extracting)
            # ZeRO-1 computes the norm inside step(): a skipped step has none of its own (the
            # optimizer still holds the previous step's)
            norm = None if skipped else neuron.neuron_grad_norm(self.optimizer)
            grad_norm = norm if norm is not None else torch.full_like(loss, math.nan)
            return grad_norm, spike, torch.full_like(spike, skipped)
        for part in self.model_parts:  # zero1 and none: average the gradients over dp
            sync_gradients(part, self.dims)
        max_norm = self.config.optim.clip or math.inf
        with_grad = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in with_grad]
        grad_norm = global_norm(with_grad, grads, **self.dims.norm_groups())
        spike, skip = self._judge(loss, grad_norm)
        # Note: clipping's multiply goes into the update (AdamW's clip_coef: on the CPU kernel
        # no pass over the gradients of its own), the same numbers as clip_grad_norm_.
        coef = clip_coefficient(grad_norm, max_norm) if max_norm < math.inf else None
        self.optimizer.step(skip=skip, clip_coef=coef)  # type: ignore[call-overload]
        return grad_norm, spike, skip

    def _judge(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[Any, Any]:
        """(spike, skip) of this step as device booleans.

        A non-finite loss or gradient norm always skips the update, whatever the policy;
        ``skip`` and ``rollback`` also skip the update of a loss spike (``rollback`` then
        goes back to the last checkpoint when the verdict is read, see
        :class:`~hlat_train.config.SpikeConfig`).
        """
        policy = self.config.spike.policy
        bad = ~(loss.isfinite() & grad_norm.isfinite())
        if policy == "off" or self.state.guard is None:
            return bad, bad
        spike = self.state.guard.check(loss, grad_norm)
        return spike, spike if policy in ("skip", "rollback") else bad

    def _read(
        self,
        window: _Window,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        spike: torch.Tensor,
        skip: torch.Tensor,
        log: bool,
    ) -> dict[str, float]:
        """Everything the host needs from the device at a logged or checkpoint step, in one
        transfer."""
        from hlat_optim import global_norm

        values = {
            "first_spike": window.first_spike,
            "loss": loss,
            "grad_norm": grad_norm,
            "spike": spike,
            "skip": skip,
            "spikes": window.spikes,
            "skipped": window.skipped,
        }
        if log and self.config.logging.param_norm:
            values["param_norm"] = global_norm(self.model.parameters(), **self.dims.norm_groups())
        stacked = torch.stack([v.detach().to(self.device, torch.float64) for v in values.values()])
        return dict(zip(values, stacked.cpu().tolist(), strict=True))

    def _metrics(
        self,
        step: int,
        seen: dict[str, float],
        lr: float,
        window: _Window,
        tokens: int,
        compute_s: float,
    ) -> dict[str, Any]:
        """The ``"train"`` record of a logged step; throughput over the steps since the last
        logged one (the device was just read, so their work is done). ``compute_s``: this
        rank's forward and backward of this step; with several ranks, their spread (a
        collective every rank joins)."""
        steps = max(step - window.start_step, 1)
        seconds = (time.perf_counter() - window.start_time - window.paused_s) / steps
        tokens_per_s = tokens / seconds
        achieved = self.flops_per_token * tokens_per_s / self.world_size
        action = "skip" if seen["skip"] else "warn" if seen["spike"] else "update"
        record = {
            "kind": "train",
            "step": step,
            "loss": seen["loss"],
            "grad_norm": seen["grad_norm"],
            "lr": lr,
            "tokens": self.state.tokens,
            "tokens_per_s": tokens_per_s,
            "mfu": achieved / (self.peak_tflops * 1e12),
            "memory_gib": memory_gib(self.device),
            "step_s": seconds,
            "action": action,
            "spikes": int(seen["spikes"]),
            "skipped": int(seen["skipped"]),
        }
        if "param_norm" in seen:
            record["param_norm"] = seen["param_norm"]
        record["compute_s"] = compute_s
        bad = getattr(self.loader, "bad_records", 0)
        if bad:
            record["bad_records"] = bad  # skipped so far on this rank (data.on_bad_record)
        if hasattr(self.loader, "composition"):
            # a mixture: this rank's realised token share and epoch per source
            for name, entry in self.loader.composition().items():
                record[f"data/{name}/share"] = entry["share"]
                record[f"data/{name}/epoch"] = entry["epoch"]
        if self.world_size > 1 and self.dims.backend == "torch":
            from hlat_train.observe import rank_compute_spread

            record.update(rank_compute_spread(compute_s, self.device))
        return record

    def _train_loader(self, dims: Any) -> Any:
        """``PackedLoader`` over ``data.paths``, or ``MixedLoader`` over ``data.sources``."""
        from hlat_data import MixedLoader, MixtureSource, PackedLoader

        c = self.config
        common: dict[str, Any] = {
            "dp_rank": dims.dp_rank,
            "dp_size": dims.dp,
            "seed": c.data.seed,
            "add_bos": c.data.add_bos,
            "block_size": c.data.block_size,
            "num_workers": c.data.num_workers,
        }
        shape = (self.tokenizer, c.data.seq_len, c.data.micro_batch_size)
        if not c.data.sources:
            return PackedLoader(self._source(c.data.paths), *shape, **common)
        mixture = [
            MixtureSource(s.name, self._source(s.paths), s.weight, s.epochs, s.max_tokens)
            for s in c.data.sources
        ]
        return MixedLoader(mixture, *shape, on_change=c.data.mixture_change, **common)

    def _source(self, paths: list[str]) -> Any:
        """Arrow/Parquet or JSON lines, by suffix (``hlat_data.open_source``)."""
        from hlat_data import open_source

        c = self.config.data
        return open_source(paths, c.text_column, on_bad_record=c.on_bad_record)

    def _validate(self, step: int, progress: Progress) -> float | None:
        """The validation loss of each held-out set (``DataConfig.held_out_sets``), logged as
        ``"valid"`` records (with ``"source"`` for a mixture source's own); returns the
        first."""
        first = None
        for name, paths in self.config.data.held_out_sets():
            value = self._validation_loss(paths)
            record: dict[str, Any] = {"kind": "valid", "step": step, "loss": value}
            if name:
                record["source"] = name
            if self.writer:
                self.writer.write(record)
            label = f" ({name})" if name else ""
            progress.write(f"step {step}: validation loss{label} {value:.4f}")
            first = value if first is None else first
        return first

    @torch.no_grad()
    def _validation_loss(self, paths: list[str]) -> float:
        """Mean loss over ``train.eval_batches`` held-out micro-batches (the same ones every
        time), averaged over data-parallel ranks."""
        from hlat_data import PackedLoader
        from hlat_parallel import loss_parallel

        c = self.config
        loader = PackedLoader(
            self._source(paths),
            self.tokenizer,
            c.data.seq_len,
            c.data.micro_batch_size,
            dp_rank=self.dims.dp_rank,
            dp_size=self.dims.dp,
            seed=c.data.seed,
            add_bos=c.data.add_bos,
            shuffle=False,
            block_size=1,
        )
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        count = 0
        if self.pipeline is not None:
            # whole pipeline steps of grad_accum micro-batches, at least one
            rounds = max(1, c.train.eval_batches // self.grad_accum)
            group: list[Any] = []
            for batch in loader:
                group.append(batch)
                if len(group) == self.grad_accum:
                    total += self._pipeline_step(group, train=False)
                    count, group = count + 1, []
                    if count == rounds:
                        break
            loader = []  # type: ignore[assignment]
        for batch in loader:
            with loss_parallel(self.dims):
                ids = self._tokens(batch.input_ids)
                labels = self._tokens(batch.labels)
                doc_lens = self._to_device(batch.doc_lens) if c.data.document_mask else None
                positions = self._cp_positions(ids.shape[0]) if self.dims.cp > 1 else None
                loss = self.model(ids, position_ids=positions, doc_lens=doc_lens, labels=labels)
            total += _full(loss).float()
            count += 1
            if count == c.train.eval_batches:
                break
        self._reshard()
        return float(self._mean_over_dp(total / max(count, 1)))

    def _reshard(self) -> None:
        """Free the parameters FSDP gathered for a forward without backward.

        Note: the model is sharded with ``reshard_after_forward=False`` (gather once per
        step); after an evaluation forward the modules would keep the gathered parameters,
        which are not the ones the optimizer and the checkpoint know.
        """
        from torch.distributed.fsdp import FSDPModule

        for part in self.model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _rollback(self, spike_step: int, bad: list[int], batches: Iterator[Any]) -> Iterator[Any]:
        """Reload the newest checkpoint and mark the micro-batches of the spike as bad."""
        c = self.config
        if self.state.rollbacks >= c.spike.max_rollbacks:
            raise RuntimeError(
                f"loss spike at step {spike_step} after {self.state.rollbacks} "
                "rollbacks (spike.max_rollbacks); inspect the data around it or lower the LR; "
                "if the loss has moved to a new level (other data), spike.policy = 'skip' "
                "lets the band follow it (spike.new_level_after)"
            )
        self.checkpointer.wait()
        bad_all = sorted({*self.state.bad_micro_batches, *bad})
        rollbacks = self.state.rollbacks + 1
        batches.close()  # type: ignore[attr-defined]
        restored = self.checkpointer.load_latest(self.checkpoint_state)
        if restored is None:
            # nothing saved yet: start over from the initial weights is not possible here
            raise RuntimeError(
                f"loss spike at step {spike_step} with policy 'rollback' but no "
                f"checkpoint exists yet under {c.checkpoint_dir}; use spike.policy = 'skip' "
                "or checkpoint more often (checkpoint.every)"
            )
        self._apply_configured_optimizer(restored)
        self.state.bad_micro_batches = bad_all
        self.state.rollbacks = rollbacks
        if self.rank0:
            write_guard_file(c.checkpoint_dir, bad_all, rollbacks, spike_step)
            self._older_guard = False  # the file is this run's now
        self._log(
            f"loss spike at step {spike_step}: rolled back to step {restored}; skipping "
            f"micro-batches {bad} from now on"
        )
        return self._batches()

    def _apply_configured_optimizer(self, step: int) -> None:
        """After loading a checkpoint: keep its position on the LR schedule and its optimizer
        state, but the config's schedule (``optim.lr``, ``warmup_steps``, ``constant_steps``,
        ``decay_steps`` or ``train.steps``, ``min_lr_ratio``) and hyperparameters (betas, eps,
        weight decay), which ``load_state_dict`` replaced with the saved ones; log each change.

        So a resumed run follows the command that resumed it: a longer ``train.steps``
        stretches the cosine from where the run is, a lower ``optim.lr`` applies at once.
        """
        lambdas, base_lrs, hypers = self._configured
        sched = self.scheduler
        changes: list[str] = []

        def differ(saved: Any, configured: Any) -> bool:
            as_list = (list, tuple)
            if isinstance(saved, as_list) and isinstance(configured, as_list):
                return list(saved) != list(configured)
            return bool(saved != configured)

        # the saved schedule: the trainer state's, or (checkpoints of hlat-train before 0.24)
        # what the scheduler's state wrote into each multiplier's __dict__, dropped here so
        # it is not saved again; the multipliers keep the configured schedule either way
        saved = self.state.schedule or [
            {k: fn.__dict__.pop(k) for k in configured if k in fn.__dict__}
            for fn, configured in zip(sched.lr_lambdas, lambdas, strict=True)
        ]
        for old, configured in zip(saved, lambdas, strict=False):
            for key, value in configured.items():
                if key in old and differ(old[key], value):
                    changes.append(f"schedule {key} {old[key]} -> {value}")
        self.state.schedule = [dict(s) for s in lambdas]
        for i, (group, base, hyper) in enumerate(
            zip(self.optimizer.param_groups, base_lrs, hypers, strict=True)
        ):
            if differ(group.get("initial_lr", base), base):
                changes.append(f"group {i} peak lr {group.get('initial_lr')} -> {base}")
            for key, value in hyper.items():
                if differ(group.get(key), value):
                    changes.append(f"group {i} {key} {group.get(key)} -> {value}")
            group.update(hyper)
            group["initial_lr"] = base
        sched.base_lrs = list(base_lrs)
        for group, base, fn in zip(
            self.optimizer.param_groups, base_lrs, sched.lr_lambdas, strict=True
        ):
            group["lr"] = base * fn(sched.last_epoch)
        sched._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        if changes:
            unique = list(dict.fromkeys(changes))
            self._log(
                f"step {step}: the config's optimizer settings replace the checkpoint's: "
                + "; ".join(unique)
            )

    def _check_trained_model(self, step: int | None) -> int | None:
        """Refuse to resume into another network: compare the model of this run with the one
        checkpoint ``step`` (``None``: the newest of the current lineage) was trained as, by
        the config saved with it (the checkpoint root's for a checkpoint without its own).
        Every field of the model but its run-time choices (``max_seq_len``, attention kernel,
        activation checkpointing, layout) and its initialisation counts, so a change that
        keeps every tensor's shape (``n_heads``, ``rope_theta``, ``norm_eps``) is refused too.
        A change of ``optim.precision`` among those whose optimizer keeps the same kind of
        state (``bf16-sr``, ``bf16`` and ``fp32``) is logged; one to or from ``mixed`` (fp32
        master weights) or ``bf16-kahan`` (a compensation) is refused. Returns the step
        checked, ``None`` when there is no checkpoint.

        Note: rank 0 reads the config and every rank gets it, so all ranks decide alike.
        """
        found: list[Any] = [None, None, "", False]
        if self.rank0:
            from hlat_train.export import read_trained_config

            infos = [
                i
                for i in self.checkpointer.list()
                if i.current and (step is None or i.step == step)
            ]
            if infos:
                found = [infos[-1].step, *read_trained_config(infos[-1].url)]
        if self._control is not None:
            dist.broadcast_object_list(found, src=0, group=self._control)
        checked, text, where, own = found
        if text is None:
            return checked
        from hlat_train.export import parse_config

        c = self.config
        try:
            data = parse_config(text, where)
            saved = TrainConfig.from_dict({"model": data.get("model", {})}, source=where)
            before = dataclasses.asdict(saved.llama_config(self.tokenizer.vocab_size))
        except ValueError as error:  # ConfigError of hlat-train or hlat-model
            self._log(f"the model of checkpoint step {checked} is not compared: {error}")
            return checked
        now = dataclasses.asdict(self.llama_config)
        for name in now:
            if name in NOT_ARCHITECTURE:
                continue
            if before.get(name) != now[name]:
                key = f"model.{name}" if hasattr(c.model, name) else f"{name} (model.preset)"
                if not own:
                    # the root's config: hlat-train before 0.24 rewrote it at every start,
                    # refused ones included, so it may not be the checkpoint's
                    self._log(
                        f"warning: {key} is {now[name]!r}, but the run's saved config "
                        f"({where}) says {before.get(name)!r}; checkpoint step {checked} has "
                        "no config of its own to tell which it was trained with"
                    )
                    continue
                raise ConfigError(
                    f"{key} is {now[name]!r}, but checkpoint step {checked} under "
                    f"{c.checkpoint_dir} was trained with {before.get(name)!r} ({where}): "
                    "resuming would load its weights into another network. Set it back to "
                    "resume, or train the new model in another checkpoint.dir"
                )
        precision = data.get("optim", {}).get("precision")
        if precision not in (None, "auto", c.optim.precision):
            kinds = [_OPTIMIZER_STATE.get(p, "") for p in (precision, c.optim.precision)]
            if kinds[0] == kinds[1]:
                self._log(
                    f"optim.precision {precision} -> {c.optim.precision}: checkpoint step "
                    f"{checked} was trained in {precision}; its weights and optimizer state "
                    f"are converted to {c.optim.precision} as they load"
                )
            elif not own:
                # the root's config, which may not be the checkpoint's (as above); the load
                # refuses an optimizer state of another kind itself
                self._log(
                    f"warning: optim.precision is {c.optim.precision}, but the run's saved "
                    f"config ({where}) says {precision}; checkpoint step {checked} has no "
                    "config of its own to tell which it was trained with"
                )
            else:
                what = " and ".join(k or "no state beyond AdamW's moments" for k in kinds)
                raise ConfigError(
                    f"optim.precision is {c.optim.precision}, but checkpoint step {checked} "
                    f"under {c.checkpoint_dir} was trained in {precision}: their optimizer "
                    f"states differ ({what}), and optimizer state loads into the same kind "
                    f"only. Set optim.precision={precision} to resume, or start the new "
                    "precision in another checkpoint.dir"
                )
        return checked

    def _record_configs(self) -> None:
        """Write the run's config into the directory of each checkpoint committed since the
        last call (rank 0), where :func:`~hlat_train.export_hf` and a resume read the config
        the checkpoint was trained with.

        Note: called after each :meth:`_log_saves`, which hands over the saves committed
        since the last call; a failed write is logged and tried again at the next call.
        """
        steps, self._unrecorded = self._unrecorded, []
        if not steps or not self.rank0:
            return
        self._drop_older_guard()
        from hlat_train.export import save_step_config

        try:
            urls = {i.step: i.url for i in self.checkpointer.list() if i.current}
            for step in steps:
                if step in urls:
                    save_step_config(self.config, urls[step])
        except Exception as error:  # an auxiliary file: the run goes on
            self._unrecorded = steps  # tried again at the next call
            self._log(f"could not write the config of checkpoint(s) {steps}: {error}")

    def _start_over(self) -> None:
        """``checkpoint.resume = false``: this run's checkpoints form a lineage of their own
        (``hlat_ckpt``'s ``start_new_lineage``), so it saves any step an older run under the
        same root saved; the older run's checkpoints are abandoned: never resumed once this
        run has saved, and deleted by retention as this run passes their steps (logged). The
        older run's spike-guard file goes at this run's first commit (rank 0), so a later
        resume of this run does not skip that run's micro-batches."""
        from hlat_ckpt.storage import Storage

        self.checkpointer.start_new_lineage()
        if not self.rank0:
            return
        where = self.config.checkpoint_dir
        steps = [i.step for i in self.checkpointer.list()]
        if steps:
            self._log(
                f"checkpoint.resume is false: the {len(steps)} checkpoint(s) under {where} "
                f"(newest step {max(steps)}) are not resumed; each is deleted once this run "
                "has saved a step at least as new"
            )
        # the older run's micro-batches to skip are not this run's: its file is not read,
        # and goes once this run has a checkpoint (until then, a restart with resume = true
        # resumes the older run, which needs it)
        self._older_guard = Storage(where).exists(GUARD_FILE)

    def _drop_older_guard(self, last: bool = False) -> None:
        """Once this run has a checkpoint, remove the spike-guard file of the older run it
        started over from (rank 0, ``checkpoint.resume = false``); a file left behind is
        logged and tried again at the next checkpoint or at :meth:`close` (``last``)."""
        if not (getattr(self, "_older_guard", False) and self.rank0):
            return
        try:
            remove_guard_file(self.config.checkpoint_dir)
        except Exception as error:  # an auxiliary file: the run goes on
            then = (
                "delete it before resuming this run"
                if last
                else "tried again at the next checkpoint"
            )
            self._log(
                f"warning: the older run's {GUARD_FILE} could not be removed "
                f"({type(error).__name__}: {error}); {then}"
            )
            return
        self._older_guard = False
        self._log(f"checkpoint.resume is false: removed the older run's {GUARD_FILE}")

    def _restore_guard_file(self) -> None:
        """Merge the rollback state persisted since the checkpoint (``spike-guard.json``):
        the micro-batches to skip and the rollbacks spent only grow, so the union and the
        maximum are right whichever of the two is newer."""
        saved = read_guard_file(self.config.checkpoint_dir)
        if saved is None:
            return
        bad = sorted({*self.state.bad_micro_batches, *saved["bad_micro_batches"]})
        rollbacks = max(self.state.rollbacks, saved["rollbacks"])
        if bad != self.state.bad_micro_batches or rollbacks != self.state.rollbacks:
            self._log(
                f"spike guard: {len(bad)} bad micro-batch(es) to skip and {rollbacks} "
                f"rollback(s) spent, from {GUARD_FILE} (newer than the checkpoint)"
            )
        self.state.bad_micro_batches, self.state.rollbacks = bad, rollbacks

    # --- preemption ------------------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.preempted = True
        if self._sigterm_at is None:
            self._sigterm_at = time.monotonic()

    def _auto_interval(self, step: int, step_s: float) -> int:
        """Steps to the next checkpoint under ``checkpoint.every = "auto"``, from the newest
        committed save's stall and write, the measured step time and the restart time of
        this process (``hlat_train.interval``); logged. Until a save has committed (an
        async first save still writing) the first interval is used again. All ranks take
        the largest answer (one small all-reduce per checkpoint), so they save together."""
        c = self.config
        every = FIRST_SAVE_STEPS
        planned = None
        if self._last_stats is not None and step_s > 0:
            planned = plan_interval(
                stall_s=self._last_stats.stall_s,
                write_s=self._last_stats.write_s if self._last_stats.async_save else 0.0,
                step_s=step_s,
                restart_s=self._restart_s,
                mtbf_hours=c.checkpoint.mtbf_hours,
            )
            every = planned.every
        if self._control is not None:
            agreed = torch.tensor([every], dtype=torch.int64)
            dist.all_reduce(agreed, dist.ReduceOp.MAX, self._control)
            every = int(agreed.tolist()[0])
        if planned is not None:
            self._log(
                f"checkpoint.every auto at step {step}: save stall {planned.stall_s:.3g} s, "
                f"background write {planned.write_s:.3g} s, step {step_s:.3g} s, restart "
                f"{planned.restart_s:.3g} s, MTBF {c.checkpoint.mtbf_hours:g} h -> next save "
                f"in {every} steps ({every * step_s:.3g} s); expected utilisation "
                f"{planned.utilisation:.2%}"
            )
            if self.writer:
                self.writer.write(
                    {
                        "kind": "checkpoint_interval",
                        "step": step,
                        "every": every,
                        "interval_s": every * step_s,
                        "stall_s": planned.stall_s,
                        "write_s": planned.write_s,
                        "step_s": step_s,
                        "restart_s": planned.restart_s,
                        "mtbf_hours": c.checkpoint.mtbf_hours,
                        "utilisation": planned.utilisation,
                    }
                )
        return every

    def _preempt_save_fits(self, step: int, last_saved: int) -> bool:
        """On SIGTERM: whether a save of ``step`` fits in what is left of
        ``checkpoint.preempt_budget`` (all ranks agree: every rank must save, or none).

        The estimate is the slowest of the last three measured saves, from the call to the
        commit (an async save must also finish writing before the process may exit), plus
        the wait for a save still in flight, taken as one more save. A rank with no save
        measured yet (its first save not committed) has nothing to estimate from and counts
        as fitting; with no save measured on any rank the run saves. When the save does not
        fit, the run exits at once and says what is lost: the steps since the newest
        committed checkpoint, which the next run trains again.
        """
        budget = self.config.checkpoint.preempt_budget
        if not budget:
            return True
        elapsed = time.monotonic() - (self._sigterm_at or time.monotonic())
        in_flight = self.checkpointer.saving
        estimate = max(self._save_seconds, default=0.0) * (2 if in_flight else 1)
        fits = not self._save_seconds or estimate <= budget - elapsed
        if self._control is not None:
            # every rank joins, measured or not: (any rank that does not fit, the slowest
            # estimate)
            agreed = torch.tensor([float(not fits), estimate], dtype=torch.float64)
            dist.all_reduce(agreed, dist.ReduceOp.MAX, self._control)
            refused, estimate = agreed.tolist()
            fits = not refused
        if not fits:
            lost = step - max(last_saved, 0)
            self._log(
                f"SIGTERM: a save takes about {estimate:.1f} s but {budget - elapsed:.1f} s of "
                f"checkpoint.preempt_budget ({budget:.0f} s) are left; exiting without saving "
                f"step {step}. Lost: the {lost} step(s) since "
                + (f"the checkpoint of step {last_saved}" if last_saved > 0 else "the start")
                + ", trained again by the next run"
            )
        return fits

    def _stop_requested(self, final: bool) -> bool:
        """Whether to stop after this step because a rank got SIGTERM (1) or ran out of time
        (2).

        Note: with several processes the ranks agree through an all-reduce (MAX) of a host
        tensor on a gloo group, started without waiting and read one step later, so every
        rank stops at the same step and no step waits for the device. A rank's SIGTERM
        therefore stops the job one step after it arrives.
        """
        code = 1 if self.preempted else 2 if time.monotonic() > self._deadline else 0
        if self._control is None:
            agreed = code
        else:
            agreed = 0
            if self._pending is not None:
                work, flag = self._pending
                work.wait()
                agreed = int(flag.tolist()[0])  # host memory: no device synchronisation
                self._pending = None
            if not final and not agreed:
                flag = torch.tensor([code], dtype=torch.int32)
                work = dist.all_reduce(flag, dist.ReduceOp.MAX, self._control, async_op=True)
                self._pending = (work, flag)
        self.preempted = agreed == 1
        self.out_of_time = agreed == 2
        return agreed > 0

    def _finish_stop_flag(self) -> None:
        """Complete a stop-flag all-reduce still under way (before the group goes away)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    @torch.no_grad()
    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 48,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
        stop_at_blank_line: bool = True,
    ) -> str:
        """A continuation of ``prompt`` (single process: every rank of a parallel run would
        have to take part in each forward).

        ``temperature`` 0 is greedy; above 0 each token is drawn from the softmax of the
        logits over ``temperature``, among the ``top_k`` most likely (0: all), with a
        generator seeded by ``seed``, so a sample is reproducible. It stops after
        ``max_new_tokens``, at the end-of-sequence token, or, with ``stop_at_blank_line``,
        where the continuation first ends a block of lines (a blank line), which is cut off.
        """
        if self.world_size != 1:
            raise RuntimeError("generate() runs in a single-process run only")
        if temperature < 0 or top_k < 0:
            raise ValueError(
                f"generate: temperature and top_k must be at least 0, got {temperature}, {top_k}"
            )
        ids = self.tokenizer.encode(prompt)
        if self.config.data.add_bos and self.tokenizer.bos_id >= 0:
            ids = [self.tokenizer.bos_id, *ids]
        start = len(ids)
        # Note: the continuation is cut from the decoded whole: SentencePiece drops the
        # leading space ("▁") of the first piece of a decode, so decoding the new ids
        # alone would lose the space between the prompt and the first new word
        prefix = self.tokenizer.decode(ids)
        window = self.config.data.seq_len
        generator = torch.Generator().manual_seed(seed)
        text = ""
        for _ in range(max_new_tokens):
            x = torch.tensor([ids[-window:]], device=self.device)
            # Note: compiled blocks run eager here: each token is a new shape, and would be
            # another compilation
            with torch.compiler.set_stance("force_eager"):
                logits = self.model(x)[0, -1].float().cpu()
            if temperature == 0:
                next_id = int(logits.argmax())
            else:
                if 0 < top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits / temperature, dim=-1)
                next_id = int(torch.multinomial(probs, 1, generator=generator))
            if next_id == self.tokenizer.eos_id:
                break
            ids.append(next_id)
            whole = self.tokenizer.decode(ids)
            if whole.startswith(prefix):
                text = whole[len(prefix) :]
            else:
                text = self.tokenizer.decode(ids[start:])
            if stop_at_blank_line and "\n\n" in text.lstrip("\n"):
                lead = len(text) - len(text.lstrip("\n"))
                text = text[: text.index("\n\n", lead)]
                break
        return prompt + text

    def close(self) -> None:
        """Release the W&B run, the checkpointer and the process group."""
        try:
            if getattr(self, "_wandb", None) is not None:
                self._wandb.close()  # finished already where the run's metrics were closed
        finally:
            try:
                if hasattr(self, "checkpointer"):
                    self.checkpointer.close()  # commits a save still being written
                    if getattr(self.checkpointer, "last_save", None) is not None:
                        self._drop_older_guard(last=True)  # the run has a checkpoint
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
