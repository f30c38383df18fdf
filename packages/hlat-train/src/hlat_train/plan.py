"""``hlat-train plan``: a dry run of a training layout at full scale, before booking it.

For a config, a device and a world size, it says what each rank holds (parameters,
gradients, optimizer state, activations), what it sends per optimizer step, what it writes
per checkpoint, and whether that fits the device's memory; when it does not, it names the
biggest item and a layout that would fit. Nothing is allocated and nothing is sent: the
model lives on the meta device and the layout is built on torch's fake process group.

Note: what comes from the real layout and what is analytic.

- Real: the per-rank shards of every parameter are the local shapes of the DTensors that
  ``hlat_parallel.init_parallel`` and ``parallelize`` build for one rank of each distinct
  role, on a fake process group of the full world size (torch backend: DTensor TP/SP plus
  FSDP2 over dp, the same calls ``Trainer`` makes). Parameter bytes come from those local
  tensors' element sizes. On the neuron backend (trn1, NxD) the TP shards come from the
  same plan applied by the torch backend (NxD's ColumnParallel, RowParallel and
  ParallelEmbedding split the same dimensions), without data parallelism.
- Analytic: gradient and optimizer-state bytes (per element of the real local shards, by
  precision mode, as ``hlat_optim.AdamW`` and ``hlat_parallel.neuron_backend.
  zero1_precision`` document them); NxD ZeRO-1's 1/dp sharding of the optimizer state;
  activation memory (a count of the tensors autograd saves, after Korthikanti et al. 2022);
  communication (ring-algorithm bytes of each collective from the layer shapes); the
  device capacities (vendor tables). The layouts the search suggests are evaluated with the
  same arithmetic, which a test checks against the real layout.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

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
    # NVIDIA A100 Tensor Core GPU datasheet: 80 GB variant (a 40 GB one exists: pass
    # --device-memory-gib 40), 8 per HGX node.
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

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def sequence_parallel(self) -> bool:
        return self.sp and self.tp > 1

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def describe(self) -> str:
        sp = " (sp)" if self.sequence_parallel else ""
        engine = "DTensor + FSDP2" if self.backend == "torch" else "NxD + ZeRO-1"
        return (
            f"tp {self.tp}{sp}, dp {self.dp}, pp 1; backend {self.backend} ({engine}), "
            f"precision {self.precision}, checkpointing {self.checkpointing}, micro-batch "
            f"{self.micro_batch} x {self.seq_len} tokens, grad accumulation {self.grad_accum} "
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


def real_shards(llama: Any, layout: Layout, dp_rank: int) -> list[Shard]:
    """The shards rank ``dp_rank * tp`` holds, read from the layout ``hlat_parallel`` builds
    on a fake process group of the full world size (torch backend), or of ``tp`` ranks
    (neuron backend: TP shards only; ZeRO-1 shards the optimizer state analytically).
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hlat_parallel import init_parallel, parallelize

    if dist.is_initialized():
        raise ConfigError(
            "hlat-train plan builds the layout on its own fake process group, but this "
            "process already has a process group; run the plan in a fresh process"
        )
    world = layout.world_size if layout.backend == "torch" else layout.tp
    rank = dp_rank * layout.tp if layout.backend == "torch" else 0
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = init_parallel(layout.tp, layout.sp, "torch", device="cpu")
        shards = []
        model = _meta_model(llama, layout.precision)
        model = parallelize(model, dims, model.parallel_plan())
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            tp_numel = _tp_numel(p, layout.tp)
            shards.append(
                Shard(
                    name,
                    tp_numel,
                    _padded(tp_numel, _tp_dim0(p, layout.tp), dims.dp),
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


def tp_shapes(llama: Any, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape after the TP split) of every parameter, from the model's plan (pure
    arithmetic on a meta model: the analytic twin of :func:`real_shards`)."""
    from hlat_parallel import match_plan

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


def analytic_shards(
    shapes: list[tuple[str, tuple[int, ...]]], layout: Layout, dp_rank: int
) -> list[Shard]:
    """The shards of rank ``dp_rank * tp`` by arithmetic: FSDP2 chunks dim 0 over dp on
    the torch backend; NxD keeps whole TP shards (ZeRO-1 splits only optimizer state)."""
    size = param_bytes(layout.precision)
    shards = []
    for name, shape in shapes:
        numel = math.prod(shape)
        rows = shape[0]
        if layout.backend == "torch" and layout.dp > 1:
            local = numel // rows * _chunk_rows(rows, layout.dp, dp_rank)
        else:
            local = numel
        shards.append(Shard(name, numel, _padded(numel, rows, layout.dp), local, size))
    return shards


def roles(shapes: list[tuple[str, tuple[int, ...]]], layout: Layout) -> list[list[int]]:
    """Data-parallel ranks grouped by identical holdings (every TP rank of a group holds
    the same sizes, since tp divides every split dimension).

    torch backend: FSDP2's chunks of dim 0 differ only where a dimension does not divide
    by dp. neuron backend: ZeRO-1 pads every shard to the same size, but only dp rank 0
    writes the model to checkpoints.
    """
    if layout.backend == "neuron":
        return [[0], list(range(1, layout.dp))] if layout.dp > 1 else [[0]]
    all_rows = sorted({shape[0] for _, shape in shapes})
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(layout.dp):
        key = tuple(_chunk_rows(rows, layout.dp, r) for rows in all_rows)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


# --- activations and communication (analytic) ----------------------------------------------


def activation_bytes(llama: Any, layout: Layout) -> float:
    """Bytes autograd keeps for one micro-batch until its backward, per rank.

    After Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models" (arXiv 2205.05198, section 4 and table 2), counted for this model instead of
    GPT's: the tensors saved for backward by each op of a block (T = micro-batch x seq_len
    tokens, h = dim, f = ffn_dim, t = tp, u = t under SP else 1, A = 2 bytes, 4 in fp32):

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
    norm, the LM head's input, and the logits with the loss's fp32 copy and log-softmax
    ``T V / t (A + 8)``.

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
    tokens = lay.micro_batch * lay.seq_len
    h, f = c.dim, c.ffn_dim
    qkv = (c.n_heads + 2 * c.kv_heads) * c.head_dim
    norms = 2 * tokens * h / u * (4 + a)
    inputs = 2 * tokens * h * a / gathered
    kept = tokens * a / t * (qkv + h + 2 * f + f)  # q k v, o_proj in, gate_up out, down in
    recomputed = tokens * a / t * (h + f)  # attention output, silu(gate)
    none = norms + inputs + kept + recomputed
    if lay.checkpointing == "none":
        per_layer, extra = none, 0.0
    elif lay.checkpointing == "selective":
        per_layer, extra = norms + inputs + kept, 0.0
    else:
        per_layer, extra = tokens * h * a / u, none
    head = tokens * h / u * (4 + a) + tokens * h * a / gathered
    logits = tokens * c.vocab_size / t * (a + 8)
    return c.n_layers * per_layer + extra + head + logits


@dataclass(frozen=True)
class Comm:
    """One collective per optimizer step, per rank: calls and ring bytes sent."""

    what: str
    dim: str
    calls: int
    bytes_sent: float


def ring_bytes(kind: str, payload: float, group: int) -> float:
    """Bytes each rank sends (``hlat_parallel.comm.Collective.bytes_per_rank``'s rule)."""
    from hlat_parallel.comm import Collective

    return Collective(kind, int(payload), group).bytes_per_rank


def communication(llama: Any, layout: Layout, shards: list[Shard]) -> list[Comm]:
    """Collectives of one optimizer step (all micro-steps) and the bytes a rank sends.

    Per micro-step and layer, without SP: all-reduces after o_proj and down_proj forward
    and of the qkv_proj and gate_up_proj input gradients backward; with SP: all-gathers
    before qkv_proj and gate_up_proj and of the o_proj and down_proj output gradients,
    reduce-scatters after o_proj and down_proj and of the input gradients (NxD's SP layers
    gather their saved sequence shard once more for the weight gradient). ``full``
    recomputation replays the forward ones. The embedding and the LM head add one each
    way; the vocab-parallel loss three small ones. Over dp once per optimizer step: FSDP2
    all-gathers the parameters (kept across micro-steps) and reduce-scatters the
    gradients on the last micro-step; ZeRO-1 reduce-scatters the gradients and all-gathers
    the updated weights.
    """
    lay, c = layout, llama
    out: list[Comm] = []
    accum = lay.grad_accum
    pb, gb = param_bytes(lay.precision), grad_bytes(lay)
    padded = sum(s.tp_padded_numel for s in shards)
    if lay.dp > 1:
        engine = "FSDP2" if lay.backend == "torch" else "ZeRO-1"
        what_ag = "all-gather, parameters" if lay.backend == "torch" else "all-gather, weights"
        out.append(
            Comm(f"{engine} {what_ag}", "dp", 1, ring_bytes("all_gather", padded * pb, lay.dp))
        )
        out.append(
            Comm(
                f"{engine} reduce-scatter, gradients",
                "dp",
                1,
                ring_bytes("reduce_scatter", padded * gb, lay.dp),
            )
        )
    if lay.tp > 1:
        a = 4 if lay.precision == "fp32" else 2
        tokens = lay.micro_batch * lay.seq_len
        payload = tokens * c.dim * a
        per_layer = 4 + (2 if lay.checkpointing == "full" else 0)
        calls = c.n_layers * per_layer + 2  # + embedding and LM head
        if lay.sequence_parallel:
            regather = 2 * c.n_layers if lay.backend == "neuron" else 0
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
        out.append(
            Comm(
                "loss all-reduces (vocab-parallel)",
                "tp",
                3 * accum,
                ring_bytes("all_reduce", tokens * 4, lay.tp) * 3 * accum,
            )
        )
    scalars = [("tp", lay.tp), ("dp", lay.dp)]
    for dim, size in scalars:
        if size > 1:
            out.append(
                Comm(
                    "scalars (grad norm" + (", loss mean)" if dim == "dp" else ")"),
                    dim,
                    2 if dim == "dp" else 1,
                    ring_bytes("all_reduce", 4, size) * (2 if dim == "dp" else 1),
                )
            )
    return out


# --- one role's report ---------------------------------------------------------------------


@dataclass
class Role:
    """Ranks with identical holdings, and what each holds, sends and writes."""

    dp_ranks: list[int]
    tp: int
    memory: list[tuple[str, float]] = field(default_factory=list)
    comm: list[Comm] = field(default_factory=list)
    checkpoint_bytes: float = 0.0
    held: dict[str, float] = field(default_factory=dict)
    """Parameter, gradient and optimizer-state bytes (see :func:`holdings`)."""

    @property
    def count(self) -> int:
        return len(self.dp_ranks) * self.tp

    @property
    def total(self) -> float:
        return sum(b for _, b in self.memory)

    def biggest(self) -> tuple[str, float]:
        return max(self.memory, key=lambda item: item[1])

    def ranks_text(self) -> str:
        first, last = self.dp_ranks[0], self.dp_ranks[-1]
        dp = f"dp rank {first}" if first == last else f"dp ranks {first}-{last}"
        if len(self.dp_ranks) > 1 and last - first + 1 != len(self.dp_ranks):
            dp = f"{len(self.dp_ranks)} dp ranks from {first} to {last}"
        tp = f" x tp ranks 0-{self.tp - 1}" if self.tp > 1 else ""
        return f"{dp}{tp}: {self.count} rank{'s' if self.count > 1 else ''}"


def holdings(shards: list[Shard], layout: Layout) -> dict[str, float]:
    """Parameter, gradient and optimizer-state bytes of a rank holding ``shards``."""
    params = sum(s.local_numel * s.element_size for s in shards)
    grads = sum(s.local_numel for s in shards) * grad_bytes(layout)
    per = optimizer_bytes_per_element(layout)
    if layout.backend == "neuron":
        # ZeRO-1 (torch_xla's sharding) pads each tensor to a multiple of dp and splits it
        owned = sum(-(-s.local_numel // layout.dp) for s in shards)
        state = owned * per
    else:
        state = sum(s.local_numel * per + OPTIMIZER_STEP_BYTES for s in shards)
    return {"parameters": params, "gradients": grads, "optimizer": state}


def role_report(llama: Any, layout: Layout, dp_ranks: list[int], shards: list[Shard]) -> Role:
    """Memory, communication and checkpoint bytes of the ranks ``dp_ranks`` (x every TP rank)."""
    lay = layout
    held = holdings(shards, lay)
    role = Role(dp_ranks, lay.tp, held=held)
    pname, gname = _dtype_name(param_bytes(lay.precision)), _dtype_name(grad_bytes(lay))
    split = "1/dp over FSDP2" if lay.backend == "torch" and lay.dp > 1 else "whole TP shard"
    role.memory.append((f"parameters ({pname}, {split})", held["parameters"]))
    role.memory.append((f"gradients ({gname}, {split})", held["gradients"]))
    sharded = "1/dp" if lay.dp > 1 else "unsharded"
    role.memory.append(
        (
            f"optimizer state ({lay.precision}: {optimizer_bytes_per_element(lay)} B/param, "
            f"{sharded})",
            held["optimizer"],
        )
    )
    tp_numel = sum(s.tp_numel for s in shards)
    if lay.backend == "torch" and lay.dp > 1:
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
    role.memory.append(
        (
            f"activations, one micro-batch (checkpointing {lay.checkpointing}"
            + (", SP" if lay.sequence_parallel else "")
            + ")",
            activation_bytes(llama, lay),
        )
    )
    role.comm = communication(llama, lay, shards)
    writes_model = lay.backend == "torch" or dp_ranks[0] == 0
    role.checkpoint_bytes = held["optimizer"] + (held["parameters"] if writes_model else 0.0)
    return role


def _dtype_name(size: int) -> str:
    return "fp32" if size == 4 else "bf16"


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

    @property
    def usable_bytes(self) -> float:
        return self.capacity_gib * GIB * (1 - HEADROOM)

    @property
    def worst(self) -> Role:
        return max(self.roles, key=lambda r: r.total)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.usable_bytes

    def render(self) -> str:
        lay = self.layout
        lines = [
            f"hlat-train plan: {self.config_name} ({self.params_total / 1e9:.2f}B parameters) "
            f"on {self.device.what}: {lay.nodes} node(s) x {lay.procs_per_node} = "
            f"{lay.world_size} processes, {self.capacity_gib:g} GiB each",
            f"layout: {lay.describe()}",
            "pipeline bubble: 0 (pp 1: no pipeline stages)",
        ]
        for index, role in enumerate(self.roles, 1):
            lines.append("")
            lines.append(f"role {index} of {len(self.roles)}: {role.ranks_text()}")
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
        lines.append("")
        lines.extend(self.notes)
        return "\n".join(lines)


def _layouts_near(layout: Layout, llama: Any) -> Iterable[Layout]:
    """Candidate layouts of the same world size, nearest first: fewer changed settings,
    then less recomputation, the bigger micro-batch, the smaller tp."""
    world = layout.world_size
    heads = math.gcd(llama.n_heads, llama.kv_heads)
    tps = [
        t
        for t in range(1, heads + 1)
        if heads % t == 0
        and world % t == 0
        and llama.vocab_size % t == 0
        and not (layout.sp and t > 1 and layout.seq_len % t)
    ]
    micro = [m for m in range(layout.micro_batch, 0, -1)]
    out = []
    for t in tps:
        for mode in CHECKPOINTING:
            for m in micro:
                cand = dataclasses.replace(layout, tp=t, checkpointing=mode, micro_batch=m)
                if layout.global_batch % (m * cand.dp):
                    continue
                changed = (
                    (t != layout.tp) + (mode != layout.checkpointing) + (m != layout.micro_batch)
                )
                out.append((changed, CHECKPOINTING.index(mode), -m, t, cand))
    return [c[-1] for c in sorted(out, key=lambda c: c[:4])]


def suggest(llama: Any, layout: Layout, usable: float) -> tuple[Layout, float] | None:
    """The nearest layout whose busiest rank fits in ``usable`` bytes, with its total."""
    shapes_by_tp: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for cand in _layouts_near(layout, llama):
        if cand == layout:
            continue
        if cand.tp not in shapes_by_tp:
            shapes_by_tp[cand.tp] = tp_shapes(llama, cand.tp)
        # dp rank 0 holds a full chunk of every tensor: the busiest rank
        role = role_report(llama, cand, [0], analytic_shards(shapes_by_tp[cand.tp], cand, 0))
        if role.total <= usable:
            return cand, role.total
    return None


def _change_text(old: Layout, new: Layout) -> str:
    changes = []
    if new.tp != old.tp:
        changes.append(f"--parallel.tp={new.tp}")
    if new.checkpointing != old.checkpointing:
        changes.append(f"--model.checkpointing={new.checkpointing}")
    if new.micro_batch != old.micro_batch:
        changes.append(f"--data.micro_batch_size={new.micro_batch}")
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
    if device is None and par.backend in ("auto", "neuron"):
        device = "trn1"  # HLAT's hardware; parallel.backend = "auto" takes NxD there
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
    ppn = procs_per_node or spec.procs_per_node
    if nodes is None:
        if par.nodes:
            nodes = par.nodes
        elif par.dp:
            world = par.dp * par.tp
            if world % ppn:
                raise ConfigError(
                    f"parallel.dp {par.dp} x tp {par.tp} = {world} processes do not fill "
                    f"whole nodes of {ppn}; give --nodes"
                )
            nodes = world // ppn
        else:
            nodes = 1
    world = nodes * ppn
    if world % par.tp:
        raise ConfigError(
            f"world size {world} ({nodes} node(s) x {ppn}) is not divisible by "
            f"parallel.tp {par.tp}; change --nodes, --procs-per-node or --parallel.tp"
        )
    dp = world // par.tp
    layout = Layout(
        nodes=nodes,
        procs_per_node=ppn,
        tp=par.tp,
        sp=par.sp,
        backend=backend,
        precision=config.optim.precision,
        checkpointing=config.model.checkpointing or "none",
        micro_batch=config.data.micro_batch_size,
        seq_len=config.data.seq_len,
        global_batch=config.train.global_batch_size or config.data.micro_batch_size * dp,
    )
    capacity = device_memory_gib if device_memory_gib is not None else spec.memory_gib
    return spec, capacity, layout


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
    from hlat_train.validation import validate

    say = progress or (lambda text: None)
    spec, capacity, layout = resolve_layout(
        config,
        device=device,
        nodes=nodes,
        procs_per_node=procs_per_node,
        device_memory_gib=device_memory_gib,
    )
    checked = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, backend=layout.backend)
    )
    llama = validate(
        checked, layout.world_size, local_world_size=layout.procs_per_node, check_files=False
    )
    shapes = tp_shapes(llama, layout.tp)
    groups = roles(shapes, layout)
    reports: list[Role] = []
    tp_only: list[Shard] | None = None
    for index, dp_ranks in enumerate(groups, 1):
        if layout.backend == "neuron" and tp_only is not None:
            # roles differ only in what they write to checkpoints
            reports.append(role_report(llama, layout, dp_ranks, tp_only))
            continue
        say(
            f"hlat-train plan: building rank {dp_ranks[0] * layout.tp} (role {index} of "
            f"{len(groups)}) on a fake process group of "
            f"{layout.world_size if layout.backend == 'torch' else layout.tp}"
        )
        shards = tp_only = real_shards(llama, layout, dp_ranks[0])
        reports.append(role_report(llama, layout, dp_ranks, shards))
    plan = Plan(
        config_name,
        spec,
        capacity,
        layout,
        reports,
        params_total=sum(math.prod(s) for _, s in tp_shapes(llama, 1)),
    )
    plan.notes.append(
        "measured on the real layout (fake process group, meta tensors): parameter shards; "
        "analytic: gradients and optimizer state per element of those shards, activations "
        "(Korthikanti et al. 2022, counted for this model), communication (ring bytes), "
        "device memory (vendor tables)"
    )
    if not plan.fits:
        say("hlat-train plan: searching for a layout that fits")
        plan.suggestion = suggest(llama, layout, plan.usable_bytes)
    return plan


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
        return text + (
            "; no tp, checkpointing or micro-batch at this world size fits: use more "
            "nodes, a device with more memory, or a smaller model"
        )
    new, total = plan.suggestion
    return text + (
        f"; {new.describe()} would fit ({total / GIB:.2f} GiB): rerun with "
        f"{_change_text(plan.layout, new)}"
    )


def print_progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
