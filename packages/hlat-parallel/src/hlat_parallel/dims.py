"""`init_parallel` and `ParallelDims`: the process group, the ("pp", "dp", "cp", "tp")
mesh, and the checks that must pass before either exists."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from hlat_parallel.device import (
    BackendChoice,
    DeviceError,
    auto_backend,
    check_device,
    dist_backend_for,
    resolve_device,
)

Backend = Literal["auto", "torch", "neuron"]


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work; the message says what, where and what to do."""


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


PIPELINE_MIN_TORCH = (2, 13)
"""The oldest torch pipeline parallelism runs on here: the release its tests pass with.
torch 2.9's ``torch.distributed.pipelining`` fails on gloo ("Received data size doesn't
match expected size") with the same stages."""


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def check_pipeline_torch() -> None:
    """Raise :class:`ParallelConfigError` when this torch is older than
    :data:`PIPELINE_MIN_TORCH`."""
    if _torch_version() < PIPELINE_MIN_TORCH:
        need = ".".join(map(str, PIPELINE_MIN_TORCH))
        raise ParallelConfigError(
            f"pipeline parallelism (pp > 1) needs torch>={need}, the oldest release it is "
            f"tested with; this is torch {torch.__version__}. Upgrade torch or set pp=1"
        )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_parallel_config(
    world_size: int,
    tp: int,
    sp: bool = False,
    *,
    pp: int = 1,
    cp: int = 1,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    seq_len: int | None = None,
) -> None:
    """Raise :class:`ParallelConfigError` for the first rule the layout breaks.

    Pure arithmetic, so it runs before any process group or tensor is created. Head counts
    and ``seq_len`` are checked only when given. Every size must be a positive ``int`` and
    ``sp`` a ``bool``; the error names the field that is not.
    """
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not _positive_int(value):
            raise ParallelConfigError(f"{name} must be a positive integer, got {value!r}")
    for name, given in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("seq_len", seq_len)):
        if given is not None and not _positive_int(given):
            raise ParallelConfigError(
                f"{name} must be a positive integer when given, got {given!r}"
            )
    if not isinstance(sp, bool):
        raise ParallelConfigError(f"sp must be True or False, got {sp!r}")
    if world_size % tp:
        raise ParallelConfigError(
            f"world size {world_size} is not divisible by tp {tp}: every tensor-parallel group "
            f"needs {tp} processes; launch a multiple of {tp} processes "
            f"(torchrun --nproc-per-node) or pick tp among {_divisors(world_size)}"
        )
    if world_size % (tp * pp * cp):
        raise ParallelConfigError(
            f"world size {world_size} is not divisible by pp x cp x tp = {pp} x {cp} x {tp} = "
            f"{pp * cp * tp}: each data-parallel replica needs that many processes; launch a "
            f"multiple of {pp * cp * tp} processes or change pp, cp or tp"
        )
    if n_heads is not None and n_heads % tp:
        raise ParallelConfigError(
            f"tp {tp} does not divide the {n_heads} attention heads: each rank must hold whole "
            f"heads; pick tp among {_divisors(n_heads)}"
        )
    if n_kv_heads is not None and n_kv_heads % tp:
        if tp % n_kv_heads == 0:
            replicate = (
                f", or replicate the KV heads {tp // n_kv_heads} times so there are {tp} of "
                "them (convert the checkpoint to n_kv_heads=tp with each KV head repeated for "
                "the query heads it serves; results are unchanged, the KV projection grows)"
            )
        else:
            replicate = (
                f"; replicating KV heads needs tp to be a multiple of the {n_kv_heads} KV heads"
            )
        raise ParallelConfigError(
            f"tp {tp} does not divide the {n_kv_heads} key/value heads: each rank must hold "
            f"whole KV heads; pick tp among {_divisors(n_kv_heads)}{replicate}"
        )
    if sp and tp > 1 and seq_len is not None and seq_len % (tp * cp):
        raise ParallelConfigError(
            f"sequence parallelism splits the sequence over tp {tp} ranks"
            + (f" (of each of the {cp} context-parallel shards)" if cp > 1 else "")
            + f", but seq_len {seq_len} is not divisible by {tp * cp}; use a seq_len that is "
            f"a multiple of {tp * cp} or set sp=False"
        )
    if cp > 1 and seq_len is not None and seq_len % (2 * cp):
        raise ParallelConfigError(
            f"context parallelism cuts the sequence into 2 x cp = {2 * cp} equal chunks (two "
            f"per rank, for balanced causal work), but seq_len {seq_len} is not divisible by "
            f"{2 * cp}; use a seq_len that is a multiple of {2 * cp}"
        )


@dataclass
class ParallelDims:
    """Where this process sits in the ("pp", "dp", "cp", "tp") layout, and the groups to
    talk over.

    Ranks are laid out with tensor-parallel ranks contiguous (ranks 0..tp-1 form the first TP
    group), as NeuronX Distributed does, so a TP group stays inside one node; then context-
    parallel, data-parallel and, outermost, pipeline ranks (pipeline stages exchange one
    activation per micro-batch, the least traffic, so they may cross nodes).
    """

    world_size: int
    """Number of processes."""
    rank: int
    """This process's global rank."""
    tp: int
    """Tensor-parallel degree."""
    dp: int
    """Data-parallel degree (``world_size // (pp * cp * tp)``)."""
    sp: bool
    """Sequence parallelism requested (effective when tp > 1, see :attr:`sequence_parallel`)."""
    backend: Literal["torch", "neuron"]
    """Which engine applies plans: DTensor/FSDP2 or NeuronX Distributed."""
    device: torch.device
    """The device this rank computes on."""
    tp_rank: int
    """Rank inside the tensor-parallel group (which shard this rank holds)."""
    dp_rank: int
    """Rank inside the data-parallel group (which slice of the batch this rank reads)."""
    tp_group: Any = None
    """The process group of this rank's tensor-parallel peers."""
    dp_group: Any = None
    """The process group of this rank's data-parallel replicas (same TP rank)."""
    mesh: Any = None
    """The 4-D ``DeviceMesh`` with dimensions ("pp", "dp", "cp", "tp"); ``None`` on the
    neuron backend."""
    dist_backend: str = ""
    """The process-group backend (``gloo``, ``nccl``, ``neuron``, ``xla``...)."""
    backend_reason: str = ""
    """Why this backend: what ``backend="auto"`` saw, or that it was asked for."""
    pp: int = 1
    """Pipeline-parallel degree (stages over ranks)."""
    cp: int = 1
    """Context-parallel degree (shards of each sequence)."""
    pp_rank: int = 0
    """Rank inside the pipeline group (which stage(s) this rank runs)."""
    cp_rank: int = 0
    """Rank inside the context-parallel group (which part of each sequence it holds)."""
    pp_group: Any = None
    """The process group of this rank's pipeline peers (same dp, cp and tp ranks)."""
    cp_group: Any = None
    """The process group of this rank's context-parallel peers."""
    dp_cp_mesh: Any = None
    """The mesh gradients are averaged and sharded over (torch backend): "dp", or "dp" and
    "cp" flattened into one dimension, "dp_cp", when cp > 1 (every CP rank computes
    gradients of its own tokens)."""

    @property
    def sequence_parallel(self) -> bool:
        """True when activations between blocks are split along the sequence."""
        return self.sp and self.tp > 1

    @property
    def tp_mesh(self) -> Any:
        """The 1-D "tp" sub-mesh (torch backend)."""
        return self.mesh["tp"] if self.mesh is not None else None

    @property
    def dp_mesh(self) -> Any:
        """The 1-D "dp" sub-mesh (torch backend)."""
        return self.mesh["dp"] if self.mesh is not None else None

    @property
    def pp_mesh(self) -> Any:
        """The 1-D "pp" sub-mesh (torch backend)."""
        return self.mesh["pp"] if self.mesh is not None else None

    @property
    def cp_mesh(self) -> Any:
        """The 1-D "cp" sub-mesh (torch backend)."""
        return self.mesh["cp"] if self.mesh is not None else None

    @property
    def dp_cp(self) -> int:
        """Ranks holding different tokens of one model replica's batch (``dp * cp``)."""
        return self.dp * self.cp

    @property
    def dp_cp_group(self) -> Any:
        """The process group of :attr:`dp_cp_mesh` (the data-parallel group when cp is 1)."""
        if self.dp_cp_mesh is None or self.cp == 1:
            return self.dp_group
        return self.dp_cp_mesh.get_group()

    def norm_groups(self) -> dict[str, Any]:
        """The process groups a global norm of this layout's parameters or gradients sums
        over, as keyword arguments of ``hlat_optim.clip_grad_norm_`` / ``global_norm``:
        ``groups`` for the plain tensor-parallel shards of NxD layers (trn1; DTensors carry
        their own layout), ``stage_groups`` for pipeline stages, whose ranks hold different
        layers. ``clip_grad_norm_(model.parameters(), 1.0, **dims.norm_groups())``."""
        return {
            "groups": (self.tp_group,) if self.backend == "neuron" and self.tp > 1 else (),
            "stage_groups": (self.pp_group,) if self.pp > 1 else (),
        }


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ParallelConfigError(
            f"environment variable {name}={value!r} is not an integer; launch with torchrun"
        ) from None


def init_parallel(
    tp: int = 1,
    sp: bool = False,
    backend: Backend = "auto",
    *,
    pp: int = 1,
    cp: int = 1,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    seq_len: int | None = None,
    timeout: datetime.timedelta | None = None,
    device: str = "auto",
    dist_backend: str = "auto",
) -> ParallelDims:
    """Join (or start) the process group and build the ("pp", "dp", "cp", "tp") layout.

    Reads torchrun's ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``; without them it runs as a
    single process. ``device`` is ``"auto"`` (the accelerator ``torch.accelerator``
    reports, else the CPU) or any device torch knows (``"cpu"``, ``"cuda"``, ``"neuron"``);
    each local process takes the device of its local rank. ``dist_backend`` is the
    process-group backend, ``"auto"`` meaning torch's default for the device type.
    ``backend="auto"`` picks the parallel engine as :func:`hlat_parallel.device.choose_backend`
    explains (the native ``torch`` path on every device, trn2/trn3 included; ``neuron``, the
    legacy NxD path, on trn1); :attr:`ParallelDims.backend_reason` says why.
    ``n_heads``, ``n_kv_heads`` and ``seq_len`` are optional: given, they are validated too
    (see :func:`check_parallel_config`). All checks run before the process group is created.
    ``pp`` pipeline stages and ``cp`` context-parallel shards take their share of the world
    before data parallelism: ``dp = world_size // (pp * cp * tp)``.

    Under torchrun the process group is created on a namespace of the store per restart
    attempt (``TORCHELASTIC_RESTART_COUNT``), so workers restarted by
    ``torchrun --max-restarts`` rendezvous afresh instead of finding the addresses of the
    workers that died.

    Note: a process group that already exists is reused, so a trainer may create its own.
    """
    if backend not in ("auto", "torch", "neuron"):
        raise ParallelConfigError(f"backend must be 'auto', 'torch' or 'neuron', got {backend!r}")
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:
        world_size, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    check_parallel_config(
        world_size,
        tp,
        sp,
        pp=pp,
        cp=cp,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        seq_len=seq_len,
    )
    try:
        check_device(device)
        choice = (
            auto_backend(device)
            if backend == "auto"
            else BackendChoice(backend, f"parallel backend {backend!r} as configured")
        )
    except DeviceError as error:
        raise ParallelConfigError(str(error)) from None
    if choice.backend == "neuron":
        from hlat_parallel.neuron_backend import init_neuron_parallel

        if pp > 1 or cp > 1:
            raise ParallelConfigError(
                f"pp {pp} / cp {cp}: pipeline and context parallelism run on the native torch "
                "backend only (CPUs, GPUs, trn2/trn3 through TorchNeuron); hlat's legacy "
                "NeuronX Distributed path (trn1) does not wire NxD's pipeline engine yet. "
                "Use backend='torch', or pp=1 and cp=1 on trn1"
            )

        dims = init_neuron_parallel(world_size, rank, tp, sp, timeout)
    else:
        dims = _init_torch(world_size, rank, tp, sp, timeout, device, dist_backend, pp, cp)
    dims.backend_reason = choice.reason
    return dims


def _attempt_store(
    world_size: int, rank: int, timeout: datetime.timedelta | None = None
) -> dist.Store:
    """The rendezvous store of torchrun, seen through a namespace of this restart attempt.

    Note: after ``torchrun --max-restarts`` restarts the workers, torchrun's store still
    holds the addresses the dead workers published, and workers of the new attempt would
    try to connect to them ("Connection refused"). Prefixing every
    key with ``TORCHELASTIC_RESTART_COUNT`` gives each attempt a clean namespace. Rank 0
    hosts the store only when torchrun's agent does not (``TORCHELASTIC_USE_AGENT_STORE``).

    Note: torch's own handling is not enough here. Its env:// rendezvous reuses the agent's
    store without a per-attempt prefix (it assumes a new store per retry), and its dynamic
    rendezvous prefixes only the agents' keys. ``tests/test_restart.py`` runs the same
    restarted job both ways: with a plain ``init_process_group`` the second attempt fails
    ("Gloo connectFullMesh failed ... Connection refused": the dead worker's address);
    through this store it forms a new group.
    """
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        _env_int("MASTER_PORT", 29500),
        world_size,
        is_master=not agent_store and rank == 0,
        multi_tenant=True,
        # what init_process_group gives the store it creates from the environment
        timeout=default_pg_timeout if timeout is None else timeout,
    )
    return dist.PrefixStore(f"hlat-parallel/attempt-{attempt}", store)


def _init_torch(
    world_size: int,
    rank: int,
    tp: int,
    sp: bool,
    timeout: datetime.timedelta | None,
    device_spec: str,
    dist_backend: str,
    pp: int = 1,
    cp: int = 1,
) -> ParallelDims:
    from torch.distributed.device_mesh import init_device_mesh

    device = resolve_device(device_spec, _env_int("LOCAL_RANK", 0))
    try:
        pg_backend = dist_backend_for(device, dist_backend)
    except DeviceError as error:
        raise ParallelConfigError(str(error)) from None
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        if world_size == 1:  # one process needs no rendezvous: an in-memory store will do
            dist.init_process_group(
                pg_backend, store=dist.HashStore(), world_size=1, rank=0, **kwargs
            )
        elif "MASTER_ADDR" not in os.environ:
            raise ParallelConfigError(
                f"WORLD_SIZE={world_size} but MASTER_ADDR is not set; launch with torchrun"
            )
        elif "TORCHELASTIC_RESTART_COUNT" in os.environ:
            store = _attempt_store(world_size, rank, timeout)
            dist.init_process_group(
                pg_backend, store=store, world_size=world_size, rank=rank, **kwargs
            )
        else:
            dist.init_process_group(pg_backend, world_size=world_size, rank=rank, **kwargs)
    dp = world_size // (pp * cp * tp)
    mesh = init_device_mesh(device.type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    return ParallelDims(
        world_size=world_size,
        rank=rank,
        tp=tp,
        dp=dp,
        sp=sp,
        backend="torch",
        device=device,
        tp_rank=mesh["tp"].get_local_rank(),
        dp_rank=mesh["dp"].get_local_rank(),
        tp_group=mesh["tp"].get_group(),
        dp_group=mesh["dp"].get_group(),
        mesh=mesh,
        dist_backend=str(dist.get_backend()),
        pp=pp,
        cp=cp,
        pp_rank=mesh["pp"].get_local_rank(),
        cp_rank=mesh["cp"].get_local_rank(),
        pp_group=mesh["pp"].get_group(),
        cp_group=mesh["cp"].get_group(),
        dp_cp_mesh=mesh["dp"] if cp == 1 else mesh["dp", "cp"]._flatten("dp_cp"),
    )
