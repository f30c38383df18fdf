"""``hlat-train plan``: a dry run of a training layout at full scale, before booking it.

For a config, a device and a world size, it says what each rank holds (parameters,
gradients, optimizer state, activations), what it sends per optimizer step, what it writes
per checkpoint, and whether that fits the device's memory; when it does not, it names the
biggest item and a layout that would fit. Nothing is allocated and nothing is sent: the
model lives on the meta device and the layout is built on torch's fake process group.
The layout is the trainer's mesh ("pp", "dp", "cp", "tp"): tensor (and sequence)
parallelism, context parallelism over the sequence, pipeline stages, and data parallelism
over what is left (``dp = world / (pp x cp x tp)``).

Note: what comes from the real layout and what is analytic.

- Real: the per-rank shards of every parameter are the local shapes of the DTensors that
  ``hlat_parallel.init_parallel`` and ``parallelize`` build for one rank of each distinct
  role, on a fake process group of the full world size (torch backend: DTensor TP/SP plus
  FSDP2 over dp, or over dp x cp flattened when cp > 1, the same calls ``Trainer``
  makes). With pp > 1 the rank's pipeline stages are cut from the meta model with
  ``hlat_parallel.split_layers``, ``stage_ids`` and ``stage_modules``, and each stage is
  parallelized with the entries of the model's plan that match it, as the trainer does.
  Pipeline ranks whose stages hold the same things (embedding, head, number of blocks)
  share one build: a Llama's blocks all have the same shapes. Parameter bytes come from
  those local tensors' element sizes. On the neuron backend (trn1, NxD) the TP shards come
  from the same plan applied by the torch backend (NxD's ColumnParallel, RowParallel and
  ParallelEmbedding split the same dimensions), without data parallelism.
- Analytic: gradient and optimizer-state bytes (per element of the real local shards, by
  precision mode, as ``hlat_optim.AdamW`` and ``hlat_parallel.neuron_backend.
  zero1_precision`` document them); NxD ZeRO-1's 1/dp sharding of the optimizer state;
  activation memory (a count of the tensors autograd saves, after Korthikanti et al. 2022,
  per micro-batch, times the micro-batches each pipeline rank keeps in flight under its
  schedule, see :func:`peak_in_flight`); context parallelism's gathered keys and values;
  communication (ring-algorithm bytes of each collective from the layer shapes, and the
  pipeline's point-to-point sends); the pipeline bubble (``hlat_parallel.bubble_fraction``,
  the papers' idealised figure); the device capacities (vendor tables). The layouts the
  search suggests are evaluated with the same arithmetic, which a test checks against the
  real layout.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hlat_train.config import ConfigError, TrainConfig

GIB = 1024**3

HEADROOM = 0.10
"""Share of device memory kept free for the runtime: CUDA context and NCCL buffers or the
Neuron runtime's scratch, compiled graphs, allocator fragmentation."""


@dataclass(frozen=True)
class Device:
    """One device kind: memory per process and processes per node."""

    name: str
    memory_gib: float
    procs_per_node: int
    what: str


DEVICES: dict[str, Device] = {
    # AWS Neuron docs, "Trainium architecture": 32 GiB of device memory per Trainium chip of
    # two NeuronCore-v2; trn1.32xlarge has 16 chips, one process per NeuronCore.
    "trn1": Device("trn1", 16.0, 32, "Trainium NeuronCore-v2 (trn1.32xlarge)"),
    # AWS Neuron docs, "Trainium2 architecture": 96 GiB of HBM per Trainium2 chip of eight
    # NeuronCore-v3; at the default logical NeuronCore size of 2 a chip is 4 processes, and
    # trn2.48xlarge's 16 chips are 64.
    "trn2": Device("trn2", 24.0, 64, "Trainium2 logical NeuronCore, LNC=2 (trn2.48xlarge)"),
    # NVIDIA H100 Tensor Core GPU datasheet: 80 GB (SXM5), 8 per HGX node.
    "h100": Device("h100", 80.0, 8, "NVIDIA H100 SXM 80 GB"),
    # NVIDIA H200 Tensor Core GPU datasheet: 141 GB, 8 per HGX node.
    "h200": Device("h200", 141.0, 8, "NVIDIA H200 141 GB"),
    # NVIDIA A100 Tensor Core GPU datasheet: 80 GB variant, 8 per HGX node (plan the 40 GB
    # one as a custom device: --device-memory-gib 40 --procs-per-node 8, without --device).
    "a100": Device("a100", 80.0, 8, "NVIDIA A100 80 GB"),
}

CHECKPOINTING = ("none", "selective", "full")


# --- the layout --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A complete layout: sizes, parallel degrees, numerics and batch shape."""

    nodes: int
    procs_per_node: int
    tp: int
    sp: bool
    backend: str
    """``torch`` (DTensor TP/SP + FSDP2) or ``neuron`` (NxD TP/SP + ZeRO-1)."""
    precision: str
    checkpointing: str
    micro_batch: int
    seq_len: int
    global_batch: int
    pp: int = 1
    cp: int = 1
    pp_schedule: str = "1F1B"
    pp_virtual: int = 0
    """Stages per pipeline rank; 0: the schedule's default (see :attr:`virtual`)."""
    pp_split: tuple[int, ...] = ()
    """Blocks per stage; empty: ``hlat_parallel.split_layers``'s balance rule."""
    dp_shard: str = "fsdp"
    """``fsdp``, ``zero1`` or ``none`` (``parallel.dp_shard``; always ``zero1`` on the
    neuron backend)."""

    @property
    def fsdp(self) -> bool:
        """Parameters and gradients sharded over dp (x cp) by FSDP2."""
        return self.backend == "torch" and self.dp_shard == "fsdp"

    @property
    def state_shard_over(self) -> int:
        """Ranks the optimizer state is split over: dp x cp (FSDP2, ZeRO-1 on the torch
        backend), dp (NxD's ZeRO-1) or 1 (``none``)."""
        if self.dp_shard == "none":
            return 1
        return self.dp if self.backend == "neuron" else self.dp_cp

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def dp(self) -> int:
        return self.world_size // (self.pp * self.cp * self.tp)

    @property
    def dp_cp(self) -> int:
        """Ranks FSDP2 shards over on the torch backend: dp, times cp (flattened) when cp > 1."""
        return self.dp * self.cp

    @property
    def sequence_parallel(self) -> bool:
        return self.sp and self.tp > 1

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step per data-parallel rank; with pp > 1 they are the
        pipeline's micro-batches, all run in one schedule step."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def virtual(self) -> int:
        """Stages per pipeline rank: ``pp_virtual``, else 1 for 1F1B and GPipe, 2 otherwise."""
        if self.pp == 1:
            return 1
        if self.pp_virtual:
            return self.pp_virtual
        from hlat_parallel import default_virtual

        return default_virtual(self.pp_schedule)

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def stage_style(self) -> Literal["loop", "v"]:
        """How stages sit on pipeline ranks (``hlat_parallel.stage_ids``)."""
        return "v" if self.pp_schedule == "ZBVZeroBubble" else "loop"

    @property
    def local_tokens(self) -> int:
        """Tokens of one micro-batch on one rank before the SP split: 1/cp of each sequence."""
        return self.micro_batch * self.seq_len // self.cp

    def describe(self) -> str:
        sp = " (sp)" if self.sequence_parallel else ""
        cp = f", cp {self.cp}" if self.cp > 1 else ""
        pp = f"pp {self.pp}"
        if self.pp > 1:
            per_rank = f"{self.virtual} stages per rank" if self.virtual > 1 else "1 stage per rank"
            pp += f" ({self.pp_schedule}, {per_rank})"
        engine = {
            "fsdp": "DTensor + FSDP2",
            "zero1": "DTensor + ZeRO-1",
            "none": "DTensor, whole replicas",
        }[self.dp_shard]
        if self.backend == "neuron":
            engine = "NxD + ZeRO-1"
        tokens = f"{self.seq_len} tokens"
        if self.cp > 1:
            tokens += f" ({self.seq_len // self.cp} per cp rank)"
        accum = "pipeline micro-batches" if self.pp > 1 else "grad accumulation"
        return (
            f"tp {self.tp}{sp}{cp}, dp {self.dp}, {pp}; backend {self.backend} ({engine}), "
            f"precision {self.precision}, checkpointing {self.checkpointing}, micro-batch "
            f"{self.micro_batch} x {tokens}, {accum} {self.grad_accum} "
            f"(global batch {self.global_batch})"
        )


@dataclass(frozen=True)
class Shard:
    """One parameter as one rank holds it."""

    name: str
    tp_numel: int
    """Elements after the tensor-parallel split (what an FSDP all-gather rebuilds)."""
    tp_padded_numel: int
    """``tp_numel`` rounded up to whole dp chunks of dim 0 (FSDP2 pads the last chunk)."""
    local_numel: int
    """Elements this rank stores (the DTensor's local shape)."""
    element_size: int


# --- pipeline stages ----------------------------------------------------------------------


def stage_splits(llama: Any, layout: Layout) -> list[Any]:
    """Every stage's ``hlat_parallel.StageSplit``: which blocks it holds, first and last."""
    from hlat_parallel import split_layers

    return split_layers(llama.n_layers, layout.n_stages, split=list(layout.pp_split) or None)


def rank_stages(splits: list[Any], layout: Layout, pp_rank: int) -> list[Any]:
    """The splits of the stages pipeline rank ``pp_rank`` runs (``hlat_parallel.stage_ids``)."""
    from hlat_parallel import stage_ids

    ids = stage_ids(pp_rank, layout.pp, layout.virtual, style=layout.stage_style)
    return [splits[i] for i in ids]


def owned(name: str, stages: Sequence[Any]) -> bool:
    """Whether parameter ``name`` of the whole model belongs to one of ``stages``: the
    embedding to the first stage, ``layers.<i>`` to the stage holding block i, the final
    norm and the LM head to the last (``hlat_parallel.StageModule``'s contract)."""
    head, _, rest = name.partition(".")
    if head == "embed_tokens":
        return any(s.first for s in stages)
    if head in ("norm", "lm_head"):
        return any(s.last for s in stages)
    if head == "layers":
        index = int(rest.split(".", 1)[0])
        return any(index in s.layers for s in stages)
    raise ConfigError(f"parameter {name!r} belongs to no pipeline stage of the plan")


def _stage_signature(stages: Sequence[Any]) -> tuple[tuple[bool, bool, int], ...]:
    """What a rank's stages hold, up to block indices (all blocks have the same shapes)."""
    return tuple((s.first, s.last, len(s.layers)) for s in stages)


def _stage_text(stages: Sequence[Any]) -> str:
    parts = []
    for s in stages:
        held = []
        if s.first:
            held.append("embedding")
        if s.layers:
            first, last = s.layers[0], s.layers[-1]
            blocks = f"block {first}" if first == last else f"blocks {first}-{last}"
            held.append(blocks)
        if s.last:
            held.append("norm + LM head")
        parts.append(f"stage {s.index}: {', '.join(held)}")
    return "; ".join(parts)


# --- bytes per element by precision -------------------------------------------------------


def param_bytes(precision: str) -> int:
    """Bytes per stored weight: the trainer casts the model to bf16 except in ``fp32``."""
    return 4 if precision == "fp32" else 2


def grad_bytes(layout: Layout) -> int:
    """Bytes per gradient element: the parameter's dtype; NxD's ``mixed`` accumulates in fp32."""
    if layout.backend == "neuron" and layout.precision == "mixed":
        return 4
    return param_bytes(layout.precision)


def optimizer_bytes_per_element(layout: Layout) -> int:
    """Optimizer-state bytes per parameter element the rank's optimizer owns.

    torch backend, ``hlat_optim.AdamW`` as the trainer builds it (states in the parameter's
    dtype, fp32 with master weights): bf16/bf16-sr 2+2, bf16-kahan 2+2 and a bf16
    compensation, mixed fp32 moments and an fp32 master copy, fp32 4+4. NxD ZeRO-1: a
    master shard and two moments in ``optimizer_dtype`` (bf16 for bf16/bf16-sr, fp32 for
    mixed/fp32); see ``hlat_parallel.neuron_backend.zero1_precision``.
    """
    p = layout.precision
    if layout.backend == "neuron":
        return 6 if p in ("bf16", "bf16-sr") else 12
    return {"bf16": 4, "bf16-sr": 4, "bf16-kahan": 6, "mixed": 12, "fp32": 8}[p]


OPTIMIZER_STEP_BYTES = 4
"""hlat_optim.AdamW keeps one fp32 0-d ``step`` per parameter tensor."""


# --- shards: real (fake process group) and analytic -------------------------------------


def _meta_model(llama: Any, precision: str) -> Any:
    import torch

    from hlat_model import Llama

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    with torch.device("meta"):
        model = Llama(llama)
    return model.to(dtype)


def _stage_plan(plan: dict[str, Any], stage: Any) -> dict[str, Any]:
    """The entries of ``plan`` whose patterns match a module of ``stage`` (a middle stage has
    no embedding and no head, and ``parallelize`` wants every pattern to match)."""
    from hlat_parallel import parse_plan

    names = [name for name, _ in stage.named_modules() if name]
    keep = {e.pattern for e in parse_plan(plan) if any(e.matches(n) for n in names)}
    return {pattern: value for pattern, value in plan.items() if pattern in keep}


def real_shards(llama: Any, layout: Layout, dp_rank: int, pp_rank: int = 0) -> list[Shard]:
    """The shards of TP rank 0 of data-parallel rank ``dp_rank`` (an index over dp x cp
    when cp > 1) on pipeline rank ``pp_rank``, read from the layout ``hlat_parallel``
    builds on a fake process group of the full world size (torch backend), or of ``tp``
    ranks (neuron backend: TP shards only; ZeRO-1 shards the optimizer state analytically).
    With pp > 1 only that pipeline rank's stages are built and parallelized.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hlat_parallel import init_parallel, parallelize, stage_modules

    if dist.is_initialized():
        raise ConfigError(
            "hlat-train plan builds the layout on its own fake process group, but this "
            "process already has a process group; run the plan in a fresh process"
        )
    torch_backend = layout.backend == "torch"
    world = layout.world_size if torch_backend else layout.tp
    # mesh ("pp", "dp", "cp", "tp"), row-major; "dp" x "cp" flattened is dp_rank * cp + cp_rank
    rank = (pp_rank * layout.dp_cp + dp_rank) * layout.tp if torch_backend else 0
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        if torch_backend:
            dims = init_parallel(
                layout.tp, layout.sp, "torch", pp=layout.pp, cp=layout.cp, device="cpu"
            )
        else:
            dims = init_parallel(layout.tp, layout.sp, "torch", device="cpu")
        dp_shard = layout.dp_shard if torch_backend else "zero1"
        if layout.pp > 1:
            # shapes do not depend on the activation layout; stages pass batch-first states
            llama = dataclasses.replace(llama, sequence_first=False)
        model = _meta_model(llama, layout.precision)
        plan = model.parallel_plan()
        if layout.pp > 1:
            splits = stage_splits(llama, layout)
            ids = [s.index for s in rank_stages(splits, layout, pp_rank)]
            modules = stage_modules(model, splits, ids)
            for module in modules:
                parallelize(module, dims, _stage_plan(plan, module), dp_shard=dp_shard)
            params = [item for module in modules for item in module.named_parameters()]
        else:
            model = parallelize(model, dims, plan, dp_shard=dp_shard)
            params = list(model.named_parameters())
        shards = []
        for name, p in params:
            local = p.to_local() if isinstance(p, DTensor) else p
            tp_numel = _tp_numel(p, layout.tp)
            shards.append(
                Shard(
                    name,
                    tp_numel,
                    _padded(tp_numel, _tp_dim0(p, layout.tp), dims.dp_cp),
                    local.numel(),
                    local.element_size(),
                )
            )
        return shards
    finally:
        dist.destroy_process_group()


def _tp_dim0(p: Any, tp: int) -> int:
    """Rows of dim 0 after the tensor-parallel split."""
    from torch.distributed.tensor import DTensor

    rows = p.shape[0]
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ()
        for name, placement in zip(names, p.placements, strict=False):
            if name == "tp" and placement.is_shard(0):
                rows //= tp
    return int(rows)


def _tp_numel(p: Any, tp: int) -> int:
    from torch.distributed.tensor import DTensor

    numel = p.numel()
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ()
        if any(n == "tp" and pl.is_shard() for n, pl in zip(names, p.placements, strict=False)):
            numel //= tp
    return int(numel)


def _padded(numel: int, rows: int, dp: int) -> int:
    chunk = -(-rows // dp)
    return numel // rows * chunk * dp if rows else numel


def _chunk_rows(rows: int, dp: int, dp_rank: int) -> int:
    """Rows of dim 0 that ``torch.chunk`` (FSDP2's split) gives ``dp_rank``."""
    chunk = -(-rows // dp)
    return max(0, min(chunk, rows - dp_rank * chunk))


def tp_shapes(llama: Any, tp: int, model: Any = None) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape after the TP split) of every parameter, from the model's plan (pure
    arithmetic on a meta model, ``model`` if given: the analytic twin of
    :func:`real_shards`)."""
    from hlat_parallel import match_plan

    if model is None:
        model = _meta_model(llama, "bf16")
    matched = match_plan(model, model.parallel_plan())
    out = []
    for name, p in model.named_parameters():
        shape = list(p.shape)
        entry = matched.get(name.rsplit(".", 1)[0])
        if entry is not None and entry.style in (
            "embedding",
            "colwise",
            "fused_colwise",
            "lm_head",
        ):
            shape[0] //= tp
        elif entry is not None and entry.style == "rowwise":
            shape[1] //= tp
        out.append((name, tuple(shape)))
    return out


def stage_shapes(
    shapes: list[tuple[str, tuple[int, ...]]], stages: Sequence[Any]
) -> list[tuple[str, tuple[int, ...]]]:
    """The entries of ``shapes`` (see :func:`tp_shapes`) that ``stages`` hold."""
    return [(name, shape) for name, shape in shapes if owned(name, stages)]


def analytic_shards(
    shapes: list[tuple[str, tuple[int, ...]]], layout: Layout, dp_rank: int
) -> list[Shard]:
    """The shards of TP rank 0 of ``dp_rank`` (over dp x cp when cp > 1) by arithmetic:
    FSDP2 chunks dim 0 over dp x cp on the torch backend; ZeRO-1 (torch or NxD) and
    ``none`` keep whole TP shards (ZeRO-1 splits only optimizer state). Pass :func:`stage_shapes` for one pipeline rank."""
    size = param_bytes(layout.precision)
    shards = []
    shard_over = layout.dp_cp
    for name, shape in shapes:
        numel = math.prod(shape)
        rows = shape[0]
        if layout.fsdp and shard_over > 1:
            local = numel // rows * _chunk_rows(rows, shard_over, dp_rank)
        else:
            local = numel
        shards.append(Shard(name, numel, _padded(numel, rows, shard_over), local, size))
    return shards


def roles(shapes: list[tuple[str, tuple[int, ...]]], layout: Layout) -> list[list[int]]:
    """Data-parallel ranks grouped by identical holdings (every TP rank of a group holds
    the same sizes, since tp divides every split dimension); with cp > 1 on the torch
    backend the ranks are FSDP2's, dp x cp flattened (``dp_rank * cp + cp_rank``).

    torch backend: FSDP2's chunks of dim 0 differ only where a dimension does not divide
    by dp x cp. neuron backend: ZeRO-1 pads every shard to the same size, but only dp rank
    0 writes the model to checkpoints.
    """
    if layout.backend == "neuron":
        return [[0], list(range(1, layout.dp))] if layout.dp > 1 else [[0]]
    if not layout.fsdp:  # whole parameters on every rank; the state's slices differ a little
        return [list(range(layout.dp_cp))]
    all_rows = sorted({shape[0] for _, shape in shapes})
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(layout.dp_cp):
        key = tuple(_chunk_rows(rows, layout.dp_cp, r) for rows in all_rows)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


# --- activations (analytic) ----------------------------------------------------------------


@dataclass(frozen=True)
class Activations:
    """Bytes autograd keeps for one micro-batch on one rank, by where they sit."""

    per_block: float
    """Per transformer block (without :attr:`kv_per_block`)."""
    kv_per_block: float
    """Per block, context parallelism without recomputation: the keys and values attention
    all-gathers over the whole sequence and keeps for backward, with its mask (0 when cp
    is 1, and under ``selective`` and ``full`` checkpointing, which redo the gather in
    backward)."""
    head: float
    """The final norm, the LM head's input, the logits and the loss (last stage)."""
    recompute: float
    """``full`` checkpointing: one block rebuilt in backward at a time, once per rank."""

    def stage(self, n_blocks: int, last: bool) -> float:
        """One micro-batch of a stage holding ``n_blocks`` blocks (and the head if ``last``)."""
        return n_blocks * (self.per_block + self.kv_per_block) + (self.head if last else 0.0)


def activation_parts(llama: Any, layout: Layout) -> Activations:
    """Bytes autograd keeps for one micro-batch until its backward, per rank.

    After Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models" (arXiv 2205.05198, section 4 and table 2), counted for this model instead of
    GPT's: the tensors saved for backward by each op of a block (T = micro-batch x seq_len
    / cp tokens on the rank, h = dim, f = ffn_dim, t = tp, u = t under SP else 1, A = 2
    bytes, 4 in fp32):

    - two RMSNorms: the fp32 input and the normed output, ``2 T h / u (4 + A)``;
    - inputs of qkv_proj and gate_up_proj: ``2 T h A``, full on every TP rank (DTensor's
      colwise layer saves its all-gathered input; NxD's SP layers save the sequence shard
      and gather it again in backward: ``/ t`` there);
    - q, k, v after RoPE ``T (n_heads + 2 n_kv_heads) head_dim A / t``; o_proj's input
      ``T h A / t``; the attention output ``T h A / t`` (``none`` only);
    - SwiGLU: gate_up's output ``2 T f A / t``, silu(gate) ``T f A / t`` (``none`` only),
      down_proj's input ``T f A / t``.

    ``selective`` recomputes the attention core and the SwiGLU in backward, so their
    outputs are not kept; ``full`` keeps each block's input ``T h A / u`` and rebuilds one
    block at a time (that block's ``none`` set is added once). Outside the blocks: the final
    norm, the LM head's input, and the logits: ``T V A`` on the torch backend without TP
    (``hlat_model.cross_entropy_loss`` keeps the logits and one fp32 number per token),
    ``T V / t (A + 8)`` with vocabulary-sharded logits and on the neuron backend (the
    loss's fp32 copy and log-softmax besides). The plan's devices are accelerators, where
    the head goes through the logits: ``hlat_model.linear_cross_entropy`` fuses the head and
    the loss on CPUs only (on CUDA it was measured slower than the logits).

    Context parallelism (cp > 1, ``hlat_parallel.ContextParallelAttention``): every
    per-token term above holds 1/cp of the sequence. Attention all-gathers the keys and
    values of the whole sequence over "cp" inside the attention core, so ``selective``
    (which recomputes the core) keeps only the rank's own q, k, v and gathers again in
    backward; without recomputation SDPA keeps the gathered ``B S 2 n_kv_heads head_dim A /
    t`` instead of the rank's own keys and values, and the ``[S / cp, S]`` causal mask in
    global positions (SDPA turns the boolean mask into an additive one of q's dtype),
    :attr:`Activations.kv_per_block`; ``full`` has them in its one rebuilt block.

    Note: attention is counted as a fused kernel (flash or memory-efficient SDPA on GPUs,
    Neuron's fused attention) that keeps no ``S x S`` scores; a kernel that materialises
    them (the CPU math path, Korthikanti's count) adds ``2 n_heads S^2 B / t`` bytes per
    layer in bf16.
    """
    c, lay = llama, layout
    t = lay.tp
    u = t if lay.sequence_parallel else 1
    gathered = t if (lay.backend == "neuron" and lay.sequence_parallel) else 1
    a = 4 if lay.precision == "fp32" else 2
    tokens = lay.local_tokens
    h, f = c.dim, c.ffn_dim
    q_rows, kv_rows = c.n_heads * c.head_dim, 2 * c.kv_heads * c.head_dim
    norms = 2 * tokens * h / u * (4 + a)
    inputs = 2 * tokens * h * a / gathered
    # q k v, o_proj in, gate_up out, down in
    kept = tokens * a / t * (q_rows + kv_rows + h + 2 * f + f)
    recomputed = tokens * a / t * (h + f)  # attention output, silu(gate)
    none = norms + inputs + kept + recomputed
    cp_saved = 0.0
    if lay.cp > 1:
        # SDPA keeps the whole sequence's keys and values, not the rank's own, and the mask
        none -= tokens * a / t * kv_rows
        local = lay.seq_len // lay.cp
        cp_saved = lay.micro_batch * lay.seq_len * kv_rows * a / t + local * lay.seq_len * a
    head = tokens * h / u * (4 + a) + tokens * h * a / gathered
    chunked_loss = lay.backend == "torch" and t == 1
    logits = tokens * c.vocab_size / t * (a if chunked_loss else a + 8)
    if lay.checkpointing == "none":
        return Activations(none, cp_saved, head + logits, 0.0)
    if lay.checkpointing == "selective":
        return Activations(norms + inputs + kept, 0.0, head + logits, 0.0)
    return Activations(tokens * h * a / u, 0.0, head + logits, none + cp_saved)


def activation_bytes(llama: Any, layout: Layout) -> float:
    """Bytes one micro-batch of the whole model keeps (see :func:`activation_parts`)."""
    parts = activation_parts(llama, layout)
    return parts.stage(llama.n_layers, True) + parts.recompute


# --- micro-batches in flight per pipeline schedule (analytic) -----------------------------


def schedule_actions(
    schedule: str, pp: int, n_microbatches: int, virtual: int, pp_rank: int
) -> list[tuple[int, int]]:
    """What pipeline rank ``pp_rank`` does to its saved activations, in order: ``(+1,
    stage)`` for a forward (one micro-batch's activations of ``stage`` saved), ``(-1,
    stage)`` when they are freed: the backward, or for the zero-bubble schedules the
    weight-gradient pass (``W``), which needs the inputs the input-gradient pass (``I``)
    leaves.

    The orders are torch 2.13's ``torch.distributed.pipelining.schedules`` (a test compares
    them with torch's own action lists):

    - ``GPipe``: every forward, then every backward.
    - ``1F1B``: ``min(m, pp - rank)`` forwards, then backward-forward pairs, then the
      remaining backwards; so stage ``s`` keeps ``min(pp - s, m)`` micro-batches in flight
      (Narayanan et al. 2021, arXiv 2104.04473, section 2.2.1: "at most p").
    - ``Interleaved1F1B``: ``(v - 1) r + 2 (pp - 1 - rank)`` forwards first (``r`` =
      micro-batches per round, pp when m >= pp), capped at ``v m``, local stages taking
      ``r`` micro-batches in turn; then forward-backward pairs. This is Megatron-LM's
      interleaved warm-up (ibid., section 2.2.2), whose first rank keeps
      ``1 + (pp - 1) / (pp v)`` times the activations of 1F1B's first stage (Korthikanti
      et al. 2022, section 4.2.3).
    - ``InterleavedZeroBubble`` (ZB1P): the same with ``1 x (pp - 1 - rank)`` in the
      warm-up, and each ``W`` running ``rank`` steps after its ``I``.
    - ``ZBVZeroBubble``: the V-shaped order of Qi et al. 2023 (arXiv 2401.10241, section 6)
      as torch writes it, stage ``rank`` and stage ``2 pp - 1 - rank`` on each rank.
    """
    p, m, v, r = pp, n_microbatches, virtual, pp_rank
    if schedule == "GPipe":
        return [(1, r)] * m + [(-1, r)] * m
    if schedule == "1F1B":
        warm = min(m, p - r)
        return [(1, r)] * warm + [(-1, r), (1, r)] * (m - warm) + [(-1, r)] * warm
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        zero_bubble = schedule == "InterleavedZeroBubble"
        per_round = m // max(1, m // p)
        warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), m * v)
        total = m * v
        out: list[tuple[int, int]] = []
        pending: list[int] = []

        def backward(op: int) -> None:
            stage = (v - 1 - ((op - warm) // per_round) % v) * p + r
            if not zero_bubble:
                out.append((-1, stage))
                return
            pending.append(stage)
            if op - warm >= r:  # torch: num_1f1b_microbatches = rank
                out.append((-1, pending.pop(0)))

        for op in range(total + warm):
            if op < total:
                out.append((1, ((op // per_round) % v) * p + r))
            if op >= warm:
                backward(op)
        out.extend((-1, stage) for stage in pending)
        return out
    if schedule == "ZBVZeroBubble":
        return _zbv_actions(p, m, r)
    raise ConfigError(f"unknown pipeline schedule {schedule!r}")


def _zbv_actions(p: int, m: int, r: int) -> list[tuple[int, int]]:
    """torch's ``ScheduleZBVZeroBubble`` order for rank ``r``: forwards and weight passes."""
    n = max(2 * p - 1, m)  # torch fills the V with n, then drops micro-batches >= m
    stage = (r, 2 * p - 1 - r)
    f, b = [0, 0], [0, 0]
    out: list[tuple[int, int]] = []

    def forward(c: int) -> None:
        if f[c] < m:
            out.append((1, stage[c]))
        f[c] += 1

    def weight(c: int, micro_batch: int) -> None:
        if micro_batch < m:
            out.append((-1, stage[c]))

    def input_then_weight(c: int) -> None:
        weight(c, b[c])
        b[c] += 1

    for _ in range(2 * (p - r) - 1):
        forward(0)
    for _ in range(r):
        forward(1)
        forward(0)
    for _ in range(p - r):
        forward(1)
        input_then_weight(1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            forward(0)
        input_then_weight(0)
        forward(1)
        input_then_weight(1)
    w = list(b)
    for _ in range(r):  # input passes only; their weight passes come last
        b[0] += 1
        b[1] += 1
    for _ in range(p - r):
        b[0] += 1
        weight(0, w[0])
        w[0] += 1
    for c in (1, 0):
        while w[c] < b[c]:
            weight(c, w[c])
            w[c] += 1
    return out


def peak_in_flight(layout: Layout, pp_rank: int, stage_bytes: dict[int, float]) -> dict[int, int]:
    """Micro-batches of each of the rank's stages whose activations are alive at the rank's
    peak (the most bytes, ``stage_bytes[stage]`` each), following
    :func:`schedule_actions`; ``{0: 1}`` without pipelining (micro-steps run one after the
    other)."""
    if layout.pp == 1:
        return {0: 1}
    live: dict[int, int] = dict.fromkeys(stage_bytes, 0)
    best: dict[int, int] = dict(live)
    best_bytes, current = -1.0, 0.0
    actions = schedule_actions(
        layout.pp_schedule, layout.pp, layout.grad_accum, layout.virtual, pp_rank
    )
    for delta, stage in actions:
        live[stage] += delta
        current += delta * stage_bytes[stage]
        if delta > 0 and current > best_bytes:
            best_bytes, best = current, dict(live)
    return best


# --- communication (analytic) ----------------------------------------------------------------


@dataclass(frozen=True)
class Comm:
    """One collective (or point-to-point send) per optimizer step, per rank: calls and
    bytes sent."""

    what: str
    dim: str
    calls: int
    bytes_sent: float


def ring_bytes(kind: str, payload: float, group: int) -> float:
    """Bytes each rank sends (``hlat_parallel.comm.Collective.bytes_per_rank``'s rule)."""
    from hlat_parallel.comm import Collective

    return Collective(kind, int(payload), group).bytes_per_rank


def communication(
    llama: Any, layout: Layout, shards: list[Shard], stages: Sequence[Any] | None = None
) -> list[Comm]:
    """Collectives of one optimizer step (all micro-steps) and the bytes a rank sends, for
    a rank holding ``stages`` (default: the whole model).

    Per micro-step and block, without SP: all-reduces after o_proj and down_proj forward
    and of the qkv_proj and gate_up_proj input gradients backward; with SP: all-gathers
    before qkv_proj and gate_up_proj and of the o_proj and down_proj output gradients,
    reduce-scatters after o_proj and down_proj and of the input gradients (NxD's SP layers
    gather their saved sequence shard once more for the weight gradient). ``full``
    recomputation replays the forward ones. The embedding (first stage) and the LM head
    (last stage) add one each way; the vocab-parallel loss three small ones (last stage).
    Context parallelism: per block, an all-gather over "cp" of the keys and values forward
    (again in backward under ``selective`` and ``full``, which recompute it) and a
    reduce-scatter of their gradients backward.
    Pipeline: per micro-batch and stage boundary, the stage's output activations are sent
    to the next stage and their gradient back (``micro-batch x seq_len / cp x dim``, / tp
    under SP, in the activation dtype). Once per optimizer step over dp (dp x cp): FSDP2
    all-gathers the parameters (kept across micro-steps) and reduce-scatters the gradients
    on the last micro-step; NxD's ZeRO-1 reduce-scatters the gradients and all-gathers the
    updated weights; hlat's ZeRO-1 (torch backend) all-reduces the gradients and
    all-gathers the updated slices; ``none`` all-reduces the gradients. Scalars: the grad-norm partial sums over tp, dp (x cp) and pp, the
    loss over dp (x cp) and from the last stage over pp.
    """
    lay, c = layout, llama
    if stages is None:
        stages = stage_splits(llama, dataclasses.replace(layout, pp=1, pp_split=()))
    out: list[Comm] = []
    accum = lay.grad_accum
    a = 4 if lay.precision == "fp32" else 2
    pb, gb = param_bytes(lay.precision), grad_bytes(lay)
    padded = sum(s.tp_padded_numel for s in shards)
    blocks = sum(len(s.layers) for s in stages)
    first = any(s.first for s in stages)
    last = any(s.last for s in stages)
    dp_dim = "dp" if lay.cp == 1 else "dp x cp"
    shard_over = lay.dp_cp if lay.backend == "torch" else lay.dp
    if shard_over > 1 and lay.backend == "torch" and not lay.fsdp:
        # hlat_parallel.zero1: an all-reduce of the whole gradients, and under ZeRO-1 an
        # all-gather of the updated slices
        if lay.dp_shard == "zero1":
            out.append(
                Comm(
                    "ZeRO-1 all-gather, updated parameters",
                    dp_dim,
                    1,
                    ring_bytes("all_gather", padded * pb, shard_over),
                )
            )
        out.append(
            Comm(
                "all-reduce, gradients",
                dp_dim,
                1,
                ring_bytes("all_reduce", padded * gb, shard_over),
            )
        )
    elif shard_over > 1:
        engine = "FSDP2" if lay.backend == "torch" else "ZeRO-1"
        what_ag = "all-gather, parameters" if lay.backend == "torch" else "all-gather, weights"
        out.append(
            Comm(
                f"{engine} {what_ag}", dp_dim, 1, ring_bytes("all_gather", padded * pb, shard_over)
            )
        )
        out.append(
            Comm(
                f"{engine} reduce-scatter, gradients",
                dp_dim,
                1,
                ring_bytes("reduce_scatter", padded * gb, shard_over),
            )
        )
    tokens = lay.local_tokens
    if lay.tp > 1:
        payload = tokens * c.dim * a
        per_layer = 4 + (2 if lay.checkpointing == "full" else 0)
        calls = blocks * per_layer + int(first) + int(last)
        if lay.sequence_parallel:
            regather = 2 * blocks if lay.backend == "neuron" else 0
            out.append(
                Comm(
                    "SP all-gather, sequence shards",
                    "tp",
                    (calls + regather) * accum,
                    ring_bytes("all_gather", payload, lay.tp) * (calls + regather) * accum,
                )
            )
            out.append(
                Comm(
                    "SP reduce-scatter, sequence shards",
                    "tp",
                    calls * accum,
                    ring_bytes("reduce_scatter", payload, lay.tp) * calls * accum,
                )
            )
        else:
            out.append(
                Comm(
                    "TP all-reduce, activations",
                    "tp",
                    calls * accum,
                    ring_bytes("all_reduce", payload, lay.tp) * calls * accum,
                )
            )
        if last:
            out.append(
                Comm(
                    "loss all-reduces (vocab-parallel)",
                    "tp",
                    3 * accum,
                    ring_bytes("all_reduce", tokens * 4, lay.tp) * 3 * accum,
                )
            )
    if lay.cp > 1 and blocks:
        kv = lay.micro_batch * lay.seq_len * 2 * c.kv_heads // lay.tp * c.head_dim * a
        gathers = blocks * accum * (1 if lay.checkpointing == "none" else 2)
        out.append(
            Comm(
                "CP all-gather, keys and values",
                "cp",
                gathers,
                ring_bytes("all_gather", kv, lay.cp) * gathers,
            )
        )
        out.append(
            Comm(
                "CP reduce-scatter, key and value gradients",
                "cp",
                blocks * accum,
                ring_bytes("reduce_scatter", kv, lay.cp) * blocks * accum,
            )
        )
    if lay.pp > 1:
        hidden = tokens * c.dim * a / (lay.tp if lay.sequence_parallel else 1)
        forward = sum(accum for s in stages if not s.last)
        backward = sum(accum for s in stages if not s.first)
        if forward:
            out.append(
                Comm(
                    "pipeline send, activations to the next stage", "pp", forward, hidden * forward
                )
            )
        if backward:
            out.append(
                Comm(
                    "pipeline send, gradients to the previous stage",
                    "pp",
                    backward,
                    hidden * backward,
                )
            )
    scalars = [
        ("tp", lay.tp, 1, "scalars (grad norm)"),
        (dp_dim, lay.dp_cp, 2, "scalars (grad norm, loss mean)"),
        ("pp", lay.pp, 2, "scalars (grad norm, loss from the last stage)"),
    ]
    for dim, size, calls, what in scalars:
        if size > 1:
            out.append(Comm(what, dim, calls, ring_bytes("all_reduce", 4, size) * calls))
    return out


# --- one role's report ---------------------------------------------------------------------


def _ranks_phrase(word: str, ranks: list[int]) -> str:
    first, last = ranks[0], ranks[-1]
    if first == last:
        return f"{word} {first}"
    if last - first + 1 == len(ranks):
        return f"{word}s {first}-{last}"
    if len(ranks) <= 4:
        return f"{word}s {', '.join(str(r) for r in ranks)}"
    return f"{len(ranks)} {word}s from {first} to {last}"


@dataclass
class Role:
    """Ranks with identical holdings, and what each holds, sends and writes."""

    dp_ranks: list[int]
    """Data-parallel ranks (FSDP2's over dp x cp, flattened, when cp > 1)."""
    tp: int
    memory: list[tuple[str, float]] = field(default_factory=list)
    comm: list[Comm] = field(default_factory=list)
    checkpoint_bytes: float = 0.0
    held: dict[str, float] = field(default_factory=dict)
    """Parameter, gradient and optimizer-state bytes (see :func:`holdings`)."""
    pp_ranks: list[int] = field(default_factory=lambda: [0])
    """Pipeline ranks holding the same (one entry without pipelining)."""
    pp: int = 1
    cp: int = 1
    stages: list[Any] = field(default_factory=list)
    """The ``hlat_parallel.StageSplit`` of each stage the rank runs."""
    in_flight: int = 1
    """Micro-batches (of one of its stages each) whose activations are alive at the peak."""

    @property
    def count(self) -> int:
        return len(self.pp_ranks) * len(self.dp_ranks) * self.tp

    @property
    def total(self) -> float:
        return sum(b for _, b in self.memory)

    @property
    def sent(self) -> float:
        return sum(c.bytes_sent for c in self.comm)

    def biggest(self) -> tuple[str, float]:
        return max(self.memory, key=lambda item: item[1])

    def ranks_text(self) -> str:
        pp = _ranks_phrase("pp rank", self.pp_ranks) + " x " if self.pp > 1 else ""
        dp = _ranks_phrase("dp rank" if self.cp == 1 else "dp x cp rank", self.dp_ranks)
        tp = f" x tp ranks 0-{self.tp - 1}" if self.tp > 1 else ""
        return f"{pp}{dp}{tp}: {self.count} rank{'s' if self.count > 1 else ''}"


def holdings(shards: list[Shard], layout: Layout) -> dict[str, float]:
    """Parameter, gradient and optimizer-state bytes of a rank holding ``shards``."""
    params = sum(s.local_numel * s.element_size for s in shards)
    grads = sum(s.local_numel for s in shards) * grad_bytes(layout)
    per = optimizer_bytes_per_element(layout)
    if layout.backend == "neuron":
        # ZeRO-1 (torch_xla's sharding) pads each tensor to a multiple of dp and splits it
        owned = sum(-(-s.local_numel // layout.dp) for s in shards)
        state = owned * per
    elif layout.dp_shard == "zero1":
        # hlat_parallel.zero1: one slice of each tensor per dp x cp rank (the largest)
        over = layout.dp_cp
        state = sum(-(-s.local_numel // over) * per + OPTIMIZER_STEP_BYTES for s in shards)
    else:
        state = sum(s.local_numel * per + OPTIMIZER_STEP_BYTES for s in shards)
    return {"parameters": params, "gradients": grads, "optimizer": state}


def role_report(
    llama: Any,
    layout: Layout,
    dp_ranks: list[int],
    shards: list[Shard],
    pp_rank: int = 0,
    stages: Sequence[Any] | None = None,
) -> Role:
    """Memory, communication and checkpoint bytes of the ranks ``dp_ranks`` (x every TP
    rank) of pipeline rank ``pp_rank``, which runs ``stages`` (default: its stages by
    ``hlat_parallel.stage_ids``) and holds ``shards``."""
    lay = layout
    if stages is None:
        stages = rank_stages(stage_splits(llama, lay), lay, pp_rank)
    held = holdings(shards, lay)
    role = Role(dp_ranks, lay.tp, held=held, pp_ranks=[pp_rank], pp=lay.pp, cp=lay.cp)
    role.stages = list(stages)
    pname, gname = _dtype_name(param_bytes(lay.precision)), _dtype_name(grad_bytes(lay))
    fsdp = lay.fsdp and lay.dp_cp > 1
    over = "dp" if lay.cp == 1 else "dp x cp"
    split = f"1/{over} over FSDP2" if fsdp else "whole TP shard"
    role.memory.append((f"parameters ({pname}, {split})", held["parameters"]))
    role.memory.append((f"gradients ({gname}, {split})", held["gradients"]))
    shard_over = lay.state_shard_over
    sharded = f"1/{over}" if shard_over > 1 else "unsharded"
    role.memory.append(
        (
            f"optimizer state ({lay.precision}: {optimizer_bytes_per_element(lay)} B/param, "
            f"{sharded})",
            held["optimizer"],
        )
    )
    tp_numel = sum(s.tp_numel for s in shards)
    if lay.backend == "torch" and lay.dp_shard == "zero1" and lay.dp_cp > 1:
        role.memory.append(
            (
                f"ZeRO-1 parameter slices ({pname}, 1/{over}, stepped then all-gathered)",
                sum(-(-s.local_numel // lay.dp_cp) for s in shards) * param_bytes(lay.precision),
            )
        )
    if fsdp:
        # Note: hlat-parallel shards with reshard_after_forward=False, so every block's
        # gathered weights stay from its forward to its backward.
        role.memory.append(
            (
                "FSDP2 gathered parameters (kept forward to backward)",
                tp_numel * param_bytes(lay.precision),
            )
        )
        if lay.grad_accum > 1:
            role.memory.append(
                (
                    "unsharded gradients accumulated over micro-steps (no_grad_sync)",
                    tp_numel * grad_bytes(lay),
                )
            )
    parts = activation_parts(llama, lay)
    stage_bytes = {s.index: parts.stage(len(s.layers), s.last) for s in stages}
    live = peak_in_flight(lay, pp_rank, stage_bytes) if lay.pp > 1 else {stages[0].index: 1}
    by_index = {s.index: s for s in stages}
    role.in_flight = sum(live.values())
    blocks_alive = sum(n * len(by_index[i].layers) for i, n in live.items())
    acts = sum(
        n * (len(by_index[i].layers) * parts.per_block + (parts.head if by_index[i].last else 0))
        for i, n in live.items()
    )
    if any(s.layers for s in stages):
        acts += parts.recompute
    how = f"checkpointing {lay.checkpointing}" + (", SP" if lay.sequence_parallel else "")
    if lay.cp > 1:
        how += f", 1/{lay.cp} of the sequence"
    if lay.pp == 1:
        what = "one micro-batch"
    elif lay.virtual == 1:
        what = f"{role.in_flight} micro-batch{'es' if role.in_flight > 1 else ''} in flight"
    else:
        what = f"{role.in_flight} micro-batch x stage passes in flight"
    if lay.pp > 1:
        how = f"{lay.pp_schedule} peak, {how}"
    role.memory.append((f"activations, {what} ({how})", acts))
    if parts.kv_per_block and blocks_alive:
        role.memory.append(
            (
                "CP all-gathered keys and values, attention mask (kept for backward)",
                blocks_alive * parts.kv_per_block,
            )
        )
    role.comm = communication(llama, lay, shards, stages)
    if lay.backend == "torch" and not lay.fsdp and lay.dp_cp > 1:
        # DCP writes a tensor replicated over dp once, on the rank with the least planned
        # so far (torch.distributed.checkpoint's deduplication): an even share each
        replicated = held["parameters"] + (held["optimizer"] if lay.dp_shard == "none" else 0)
        sliced = held["optimizer"] if lay.dp_shard == "zero1" else 0.0
        role.checkpoint_bytes = replicated / lay.dp_cp + sliced
    else:
        writes_model = lay.backend == "torch" or dp_ranks[0] == 0
        role.checkpoint_bytes = held["optimizer"] + (held["parameters"] if writes_model else 0.0)
    return role


def _dtype_name(size: int) -> str:
    return "fp32" if size == 4 else "bf16"


def _merge_pipeline_ranks(reports: list[Role]) -> list[Role]:
    """One role for pipeline ranks whose reports are identical (same data-parallel ranks,
    memory, traffic and checkpoint bytes), in order of first appearance."""
    merged: dict[Any, Role] = {}
    for role in reports:
        key = (
            tuple(role.dp_ranks),
            tuple(role.memory),
            tuple(role.comm),
            role.checkpoint_bytes,
            _stage_signature(role.stages),
        )
        if key in merged:
            merged[key].pp_ranks.extend(role.pp_ranks)
        else:
            merged[key] = role
    return list(merged.values())


# --- the plan --------------------------------------------------------------------------------


@dataclass
class Plan:
    """The outcome of :func:`make_plan`; :meth:`render` is what the command prints."""

    config_name: str
    device: Device
    capacity_gib: float
    layout: Layout
    roles: list[Role]
    params_total: int
    suggestion: tuple[Layout, float] | None = None
    notes: list[str] = field(default_factory=list)
    splits: list[Any] = field(default_factory=list)
    """Every pipeline stage's ``hlat_parallel.StageSplit``."""
    warnings: list[str] = field(default_factory=list)
    """Printed under the layout: what the plan computes but hlat cannot run yet."""
    batch_from_dp: bool = False
    """``train.global_batch_size`` is 0 (micro-batch x dp): a suggestion that changes dp
    pins the planned global batch."""

    @property
    def usable_bytes(self) -> float:
        return self.capacity_gib * GIB * (1 - HEADROOM)

    @property
    def worst(self) -> Role:
        return max(self.roles, key=lambda r: r.total)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.usable_bytes

    @property
    def bubble(self) -> float:
        """Idle over compute time of a pipeline step (``hlat_parallel.bubble_fraction``)."""
        lay = self.layout
        if lay.pp == 1:
            return 0.0
        from hlat_parallel import bubble_fraction

        return bubble_fraction(lay.pp_schedule, lay.pp, lay.grad_accum, lay.virtual)

    def render(self) -> str:
        lay = self.layout
        lines = [
            f"hlat-train plan: {self.config_name} ({self.params_total / 1e9:.2f}B parameters) "
            f"on {self.device.what}: {lay.nodes} node(s) x {lay.procs_per_node} = "
            f"{lay.world_size} processes, {self.capacity_gib:g} GiB each",
            f"layout: {lay.describe()}",
        ]
        lines.extend(self.warnings)
        if lay.pp == 1:
            lines.append("pipeline bubble: 0 (pp 1: no pipeline stages)")
        else:
            counts = [len(s.layers) for s in self.splits]
            lines.append(
                f"pipeline: {len(self.splits)} stages over pp {lay.pp}, blocks per stage "
                f"{counts} (embedding on stage 0, norm + LM head on stage "
                f"{len(self.splits) - 1})"
            )
            lines.append(
                f"pipeline bubble: {self.bubble:.2%} of compute ({lay.pp_schedule}, pp "
                f"{lay.pp}, {lay.grad_accum} micro-batches, {lay.virtual} "
                f"stage{'s' if lay.virtual > 1 else ''} per rank; "
                "idealised, hlat_parallel.bubble_fraction)"
            )
        if lay.pp == 1:
            for index, role in enumerate(self.roles, 1):
                lines.append("")
                lines.append(f"role {index} of {len(self.roles)}: {role.ranks_text()}")
                lines.extend(self._role_lines(role))
        else:
            lines.extend(self._pipeline_table())
            worst = self.worst
            index = self.roles.index(worst) + 1
            lines.append("")
            held = "; ".join(
                (f"pp rank {rank}: " if len(worst.pp_ranks) > 1 else "") + _stage_text(stages)
                for rank, stages in zip(worst.pp_ranks, self._stages_of(worst), strict=True)
            )
            lines.append(
                f"role {index} of {len(self.roles)} (the busiest): {worst.ranks_text()}; {held}"
            )
            lines.extend(self._role_lines(worst))
        lines.append("")
        lines.extend(self.notes)
        return "\n".join(lines)

    def _pipeline_table(self) -> list[str]:
        rows = [("role", "ranks", "stages", "in flight", "memory GiB", "sent GiB", "ckpt GiB", "")]
        for index, role in enumerate(self.roles, 1):
            verdict = "fits" if role.total <= self.usable_bytes else "DOES NOT FIT"
            rows.append(
                (
                    str(index),
                    role.ranks_text(),
                    " ".join(
                        ",".join(str(s.index) for s in stages) for stages in self._stages_of(role)
                    ),
                    str(role.in_flight),
                    f"{role.total / GIB:.2f}",
                    f"{role.sent / GIB:.2f}",
                    f"{role.checkpoint_bytes / GIB:.2f}",
                    verdict,
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        out = ["", "per rank (in flight: micro-batches whose activations are alive at the peak):"]
        for row in rows:
            out.append(
                "  "
                + "  ".join(
                    cell.ljust(widths[i]) if i < 3 or i == 7 else cell.rjust(widths[i])
                    for i, cell in enumerate(row)
                ).rstrip()
            )
        return out

    def _stages_of(self, role: Role) -> list[list[Any]]:
        """The stages of each pipeline rank of ``role``."""
        return [rank_stages(self.splits, self.layout, rank) for rank in role.pp_ranks]

    def _role_lines(self, role: Role) -> list[str]:
        lines = []
        width = max(len(name) for name, _ in role.memory) + 2
        lines.append(f"  {'memory per rank':<{width}}{'GiB':>9}")
        for name, value in role.memory:
            lines.append(f"  {name:<{width}}{value / GIB:>9.2f}")
        verdict = "fits" if role.total <= self.usable_bytes else "DOES NOT FIT"
        lines.append(
            f"  {'total':<{width}}{role.total / GIB:>9.2f}  {verdict} "
            f"(usable {self.usable_bytes / GIB:.2f} of {self.capacity_gib:g} GiB, "
            f"{HEADROOM:.0%} kept for the runtime)"
        )
        if role.comm:
            cw = max(len(f"{c.dim}: {c.what}") for c in role.comm) + 2
            lines.append(f"  {'sent per rank per optimizer step':<{cw}}{'calls':>7}{'GiB':>10}")
            for c in role.comm:
                label = f"{c.dim}: {c.what}"
                lines.append(f"  {label:<{cw}}{c.calls:>7}{c.bytes_sent / GIB:>10.4f}")
        lines.append(
            f"  checkpoint written per save (model + optimizer state): "
            f"{role.checkpoint_bytes / GIB:.2f} GiB"
        )
        return lines


def _valid_pipeline(llama: Any, layout: Layout) -> bool:
    """Whether ``hlat_parallel`` accepts the pipeline settings of ``layout``."""
    if layout.pp == 1:
        return True
    from hlat_parallel import ParallelConfigError, check_schedule

    try:
        check_schedule(layout.pp_schedule, layout.pp, layout.virtual, layout.grad_accum)
        stage_splits(llama, layout)
    except ParallelConfigError:
        return False
    return True


def _layouts_near(layout: Layout, llama: Any) -> Iterable[Layout]:
    """Candidate layouts of the same world size, nearest first: fewer changed settings,
    then less recomputation, the bigger micro-batch, the smaller tp, the smaller pp.

    pp is tried at its value, twice and four times it, on the torch backend only (hlat's
    trn1 path runs no pipeline); a changed pp drops an explicit ``pp_split``."""
    world = layout.world_size
    heads = math.gcd(llama.n_heads, llama.kv_heads)
    replica = layout.cp
    tps = [
        t
        for t in range(1, heads + 1)
        if heads % t == 0
        and world % (t * replica) == 0
        and llama.vocab_size % t == 0
        and not (layout.sp and t > 1 and layout.seq_len % (t * layout.cp))
    ]
    pps = [layout.pp]
    if layout.backend == "torch":
        pps += [layout.pp * 2, layout.pp * 4]
    micro = [m for m in range(layout.micro_batch, 0, -1)]
    out = []
    for p in pps:
        for t in tps:
            if world % (p * replica * t):
                continue
            for mode in CHECKPOINTING:
                for m in micro:
                    cand = dataclasses.replace(
                        layout,
                        tp=t,
                        pp=p,
                        checkpointing=mode,
                        micro_batch=m,
                        pp_split=layout.pp_split if p == layout.pp else (),
                    )
                    if layout.global_batch % (m * cand.dp) or not _valid_pipeline(llama, cand):
                        continue
                    changed = (
                        (t != layout.tp)
                        + (p != layout.pp)
                        + (mode != layout.checkpointing)
                        + (m != layout.micro_batch)
                    )
                    out.append((changed, CHECKPOINTING.index(mode), -m, t, p, cand))
    return [c[-1] for c in sorted(out, key=lambda c: c[:5])]


def busiest_total(llama: Any, layout: Layout, shapes: list[tuple[str, tuple[int, ...]]]) -> float:
    """Memory of the busiest rank of ``layout`` by arithmetic alone: data-parallel rank 0
    (a full chunk of every tensor) of every pipeline rank."""
    splits = stage_splits(llama, layout)
    worst = 0.0
    for pp_rank in range(layout.pp):
        stages = rank_stages(splits, layout, pp_rank)
        shards = analytic_shards(stage_shapes(shapes, stages), layout, 0)
        worst = max(worst, role_report(llama, layout, [0], shards, pp_rank, stages).total)
    return worst


def suggest(llama: Any, layout: Layout, usable: float) -> tuple[Layout, float] | None:
    """The nearest layout whose busiest rank fits in ``usable`` bytes, with its total."""
    shapes_by_tp: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for cand in _layouts_near(layout, llama):
        if cand == layout:
            continue
        if cand.tp not in shapes_by_tp:
            shapes_by_tp[cand.tp] = tp_shapes(llama, cand.tp)
        total = busiest_total(llama, cand, shapes_by_tp[cand.tp])
        if total <= usable:
            return cand, total
    return None


def _change_text(old: Layout, new: Layout, batch_from_dp: bool = False) -> str:
    changes = []
    if new.tp != old.tp:
        changes.append(f"--parallel.tp={new.tp}")
    if new.pp != old.pp:
        changes.append(f"--parallel.pp={new.pp}")
        if old.pp_split:
            changes.append("--parallel.pp_split=[]")
    if new.checkpointing != old.checkpointing:
        changes.append(f"--model.checkpointing={new.checkpointing}")
    if new.micro_batch != old.micro_batch:
        changes.append(f"--data.micro_batch_size={new.micro_batch}")
    if batch_from_dp and new.dp != old.dp:
        # else the rerun recomputes it from the new dp
        changes.append(f"--train.global_batch_size={new.global_batch}")
    return " ".join(changes)


def resolve_layout(
    config: TrainConfig,
    *,
    device: str | None,
    nodes: int | None,
    procs_per_node: int | None,
    device_memory_gib: float | None,
) -> tuple[Device, float, Layout]:
    """The device, its memory per process and the layout, from the config and the options;
    raises :class:`ConfigError` before any work for a bad combination."""
    par = config.parallel
    if device is not None and device not in DEVICES:
        import difflib

        close = difflib.get_close_matches(device, list(DEVICES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"--device {device!r} is not a known device{hint}; use one of "
            f"{', '.join(DEVICES)} or give --device-memory-gib with --procs-per-node"
        )
    if device_memory_gib is not None and not device_memory_gib > 0:
        raise ConfigError(f"--device-memory-gib must be positive, got {device_memory_gib}")
    for name, value in (("--nodes", nodes), ("--procs-per-node", procs_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    for name, value in (("parallel.tp", par.tp), ("parallel.pp", par.pp), ("parallel.cp", par.cp)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if par.pp_virtual < 0:
        raise ConfigError(f"parallel.pp_virtual must be at least 0, got {par.pp_virtual}")
    if device is None and device_memory_gib is None and par.backend in ("auto", "neuron"):
        device = "trn1"  # HLAT's hardware; parallel.backend = "auto" takes NxD there
    # --device-memory-gib without --device: a custom device, on the torch backend unless
    # parallel.backend is "neuron"
    if device is None and device_memory_gib is None:
        raise ConfigError(
            f"parallel.backend = {par.backend!r} runs on any device: name it with --device "
            f"({', '.join(DEVICES)}) or give --device-memory-gib and --procs-per-node"
        )
    if device is not None:
        spec = DEVICES[device]
    else:
        if procs_per_node is None:
            raise ConfigError("--device-memory-gib without --device needs --procs-per-node")
        spec = Device("custom", float(device_memory_gib or 0), procs_per_node, "custom device")
    backend = par.backend
    if backend == "auto":
        backend = "neuron" if spec.name == "trn1" else "torch"
    if backend == "neuron" and spec.name not in ("trn1", "custom"):
        raise ConfigError(
            f"parallel.backend = 'neuron' (NeuronX Distributed) runs on trn1 only, not "
            f"{spec.name}; set --parallel.backend=torch or --device trn1"
        )
    if backend == "neuron" and par.cp > 1:
        raise ConfigError(
            f"parallel.cp = {par.cp} on parallel.backend = 'neuron': hlat's NeuronX "
            "Distributed path (trn1) has no context parallelism; plan it with "
            "--parallel.backend=torch (and a --device) or set parallel.cp = 1"
        )
    replica = par.tp * par.pp * par.cp
    ppn = procs_per_node or spec.procs_per_node
    if nodes is None:
        if par.nodes:
            nodes = par.nodes
        elif par.dp:
            world = par.dp * replica
            if world % ppn:
                raise ConfigError(
                    f"parallel.dp {par.dp} x pp {par.pp} x cp {par.cp} x tp {par.tp} = "
                    f"{world} processes do not fill whole nodes of {ppn}; give --nodes"
                )
            nodes = world // ppn
        else:
            nodes = 1
    world = nodes * ppn
    if world % replica:
        degrees = (
            f"parallel.tp {par.tp}"
            if replica == par.tp
            else f"parallel.pp x parallel.cp x parallel.tp = {par.pp} x {par.cp} x {par.tp} = "
            f"{replica}"
        )
        raise ConfigError(
            f"world size {world} ({nodes} node(s) x {ppn}) is not divisible by {degrees}; "
            "change --nodes, --procs-per-node or the parallel degrees"
        )
    dp = world // replica
    from hlat_parallel import resolve_dp_shard

    layout = Layout(
        nodes=nodes,
        procs_per_node=ppn,
        tp=par.tp,
        sp=par.sp,
        backend=backend,
        # every device of the table multiplies bf16 natively: auto is bf16-sr on each
        precision="bf16-sr" if config.optim.precision == "auto" else config.optim.precision,
        checkpointing=config.model.checkpointing or "none",
        micro_batch=config.data.micro_batch_size,
        seq_len=config.data.seq_len,
        global_batch=config.train.global_batch_size or config.data.micro_batch_size * dp,
        pp=par.pp,
        cp=par.cp,
        pp_schedule=par.pp_schedule,
        pp_virtual=par.pp_virtual,
        pp_split=tuple(par.pp_split),
        dp_shard=resolve_dp_shard(par.dp_shard, backend),
    )
    capacity = device_memory_gib if device_memory_gib is not None else spec.memory_gib
    return spec, capacity, layout


NEURON_PIPELINE_NOTE = (
    "note: hlat's trn1 path (parallel.backend = 'neuron', NeuronX Distributed) does not run "
    "pipeline parallelism yet: NxD's pipeline engine is not wired. This plan is arithmetic "
    "on NxD's layout; to train, use parallel.backend = 'torch' (GPUs, trn2/trn3) or "
    "parallel.pp = 1."
)


def make_plan(
    config: TrainConfig,
    config_name: str = "config",
    *,
    device: str | None = None,
    nodes: int | None = None,
    procs_per_node: int | None = None,
    device_memory_gib: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Plan ``config`` on a device: validate, build one rank of each role on a fake process
    group, and add up what it holds, sends and writes (see the module docstring)."""
    from hlat_train.validation import tokenizer_pieces, validate

    say = progress or (lambda text: None)
    spec, capacity, layout = resolve_layout(
        config,
        device=device,
        nodes=nodes,
        procs_per_node=procs_per_node,
        device_memory_gib=device_memory_gib,
    )
    neuron_pipeline = layout.backend == "neuron" and layout.pp > 1
    if neuron_pipeline:
        # the plan is arithmetic: check the layout as the torch path would run it, and the
        # precision as NxD's ZeRO-1 takes it
        from hlat_parallel.neuron_backend import zero1_precision

        try:
            zero1_precision(
                "bf16-sr" if config.optim.precision == "auto" else config.optim.precision
            )
        except ValueError as e:
            raise ConfigError(f"optim.precision on parallel.backend = 'neuron': {e}") from None
    # --nodes replaces the node count a preset expects (parallel.nodes)
    checked = dataclasses.replace(
        config,
        parallel=dataclasses.replace(
            config.parallel,
            backend="torch" if neuron_pipeline else layout.backend,
            nodes=layout.nodes,
        ),
    )
    vocab_note = None
    if config.model.vocab_size == 0:  # the tokenizer's, where its file is here
        tokenizer = config.data.tokenizer
        if tokenizer and os.path.isfile(tokenizer.removeprefix("file://")):
            pieces = tokenizer_pieces(tokenizer)
            vocab = config.llama_config(pieces).vocab_size
            checked.model = dataclasses.replace(config.model, vocab_size=vocab)
            vocab_note = (
                f"model.vocab_size 0: {vocab}, the {pieces} pieces of data.tokenizer "
                f"{tokenizer} rounded up to a multiple of 64"
            )
        else:
            vocab_note = (
                "model.vocab_size 0 follows the tokenizer, and data.tokenizer "
                f"({tokenizer or 'empty'}) is not a file here: the plan assumes a vocabulary "
                "of 64; set model.vocab_size (or data.tokenizer) for the model's real size"
            )
    # validate checks the pp and cp rules at this world size too (schedule, micro-batches,
    # split, CP with document masking)
    llama = validate(
        checked, layout.world_size, local_world_size=layout.procs_per_node, check_files=False
    )
    whole = _meta_model(llama, "bf16")
    shapes = tp_shapes(llama, layout.tp, whole)
    splits = stage_splits(llama, layout)
    torch_backend = layout.backend == "torch"
    built: dict[Any, list[Shard]] = {}
    reports: list[Role] = []
    for pp_rank in range(layout.pp):
        stages = rank_stages(splits, layout, pp_rank)
        groups = roles(stage_shapes(shapes, stages), layout)
        for index, dp_ranks in enumerate(groups, 1):
            # neuron: the dp roles differ only in what they write to checkpoints
            built_for = dp_ranks[0] if torch_backend else 0
            key = (_stage_signature(stages), built_for)
            if key not in built:
                # global rank in the ("pp", "dp", "cp", "tp") order both backends share
                rank = (pp_rank * layout.dp_cp + built_for) * layout.tp
                where = f"pp rank {pp_rank}, " if layout.pp > 1 else ""
                say(
                    f"hlat-train plan: building rank {rank} ({where}role {index} of "
                    f"{len(groups)}) on a fake process group of "
                    f"{layout.world_size if torch_backend else layout.tp}"
                )
                built[key] = real_shards(llama, layout, built_for, pp_rank)
            reports.append(role_report(llama, layout, dp_ranks, built[key], pp_rank, stages))
    plan = Plan(
        config_name,
        spec,
        capacity,
        layout,
        _merge_pipeline_ranks(reports),
        params_total=sum(p.numel() for p in whole.parameters()),
        splits=splits,
        batch_from_dp=not config.train.global_batch_size,
    )
    if neuron_pipeline:
        plan.warnings.append(NEURON_PIPELINE_NOTE)
    plan.notes.append(
        "measured on the real layout (fake process group, meta tensors): parameter shards"
        + (" of each pipeline rank's stages" if layout.pp > 1 else "")
        + "; analytic: gradients and optimizer state per element of those shards, "
        "activations (Korthikanti et al. 2022, counted for this model"
        + (", times the micro-batches in flight per schedule" if layout.pp > 1 else "")
        + "), communication (ring bytes"
        + (", point-to-point sends" if layout.pp > 1 else "")
        + "), device memory (vendor tables)"
    )
    plan.notes.append(checkpoint_interval_note(config))
    if vocab_note is not None:
        plan.notes.append(vocab_note)
    if not plan.fits:
        say("hlat-train plan: searching for a layout that fits")
        plan.suggestion = suggest(llama, layout, plan.usable_bytes)
    return plan


def checkpoint_interval_note(config: TrainConfig) -> str:
    """What ``checkpoint.every`` means for this run: a fixed step count, or ``auto`` with
    Daly's interval for a range of save stalls (the stall itself is measured by the run)."""
    every = config.checkpoint.every
    if every != "auto":
        return f"checkpoint.every: every {every} steps (fixed)"
    from hlat_train.interval import daly_interval

    hours = config.checkpoint.mtbf_hours
    examples = ", ".join(
        f"{stall:g} s -> {daly_interval(stall, hours * 3600) / 60:.0f} min"
        for stall in (1, 10, 30, 120)
    )
    return (
        f"checkpoint.every: auto (Young/Daly, hlat_train.interval), re-estimated at every save "
        f"from the measured save stall and step time with mtbf_hours {hours:g}; the first "
        f"save after 50 steps. Interval by save stall: {examples}"
    )


def failure_text(plan: Plan) -> str:
    """What does not fit, the biggest item, and what to change."""
    worst = plan.worst
    name, size = worst.biggest()
    text = (
        f"the layout does not fit: {worst.total / GIB:.2f} GiB per rank on "
        f"{worst.ranks_text()}, {plan.usable_bytes / GIB:.2f} GiB usable of "
        f"{plan.capacity_gib:g} GiB; the biggest item is {name}, {size / GIB:.2f} GiB"
    )
    if plan.suggestion is None:
        knobs = "tp, pp, checkpointing or micro-batch"
        if plan.layout.backend != "torch":
            knobs = "tp, checkpointing or micro-batch"
        return text + (
            f"; no {knobs} at this world size fits: use more nodes, a device with more "
            "memory, or a smaller model"
        )
    new, total = plan.suggestion
    return text + (
        f"; {new.describe()} would fit ({total / GIB:.2f} GiB): rerun with "
        f"{_change_text(plan.layout, new, plan.batch_from_dp)}"
    )


def print_progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
