"""``hlat-train preflight``: health checks for a training job, run on every node before
``hlat-train train``.

HLAT checked each node before and during its runs (device listing, a collective burn-in,
stale ports) and put the remaining faults down to auto-resume. These are those checks, on
whatever devices the node has:

- ``devices``: CPU cores, CUDA GPUs and Neuron devices (``neuron-ls``, or ``/dev/neuron*``)
  are visible, as many as ``--expect-gpus`` / ``--expect-neuron-cores`` ask, and at least as
  many accelerators as torchrun's ``LOCAL_WORLD_SIZE`` processes need;
- ``free disk``: free space at the checkpoint directory (local paths; ``--min-free-gb``);
- ``rendezvous port``: no process outside this job listens on ``MASTER_PORT`` (default
  29500); under torchrun the launcher itself may hold it;
- ``stale processes``: other ``hlat-train`` processes still running on the node (a warning);
- ``all-reduce burn-in``: an all-reduce of a large buffer across all ranks (gloo on CPU, NCCL
  on CUDA, XLA on Neuron), checked for the right sum, with its bus bandwidth
  (``--min-busbw-gbps`` turns a slow link into a failure);
- ``checkpoint write/read``: every rank writes, reads back, compares and deletes a file at
  the checkpoint URL through fsspec (local paths and ``s3://``).

::

    hlat-train preflight --checkpoint-url /fsx/ckpt                            # one process
    torchrun --nproc-per-node 2 -m hlat_train preflight --checkpoint-url DIR   # every rank
    srun torchrun --nnodes 64 --nproc-per-node 32 ... -m hlat_train preflight \\
        --checkpoint-url s3://bucket/hlat-7b/ckpt --expect-neuron-cores 32 --min-free-gb 250

Rank 0 prints one table of every check on every rank; every rank exits 0 when all passed,
1 with the list of what failed otherwise (2 for bad arguments). ``--json FILE`` writes the
results. Uses torch and fsspec (s3fs for ``s3://``) and none of the other hlat packages;
torch is imported only once the arguments are valid. ``tools/preflight.py`` runs the same
checks as a script. The Neuron paths (``neuron-ls``, the XLA all-reduce) need a trn1
instance to verify.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

PASS, FAIL, WARN, SKIP = "PASS", "FAIL", "WARN", "SKIP"
EXIT_FAILED = 1
EXIT_USAGE = 2
DEFAULT_PORT = 29500
_TCP_LISTEN = "0A"  # state code of a listening socket in /proc/net/tcp


@dataclasses.dataclass
class Check:
    """The outcome of one check on one rank."""

    name: str
    status: str
    detail: str
    rank: int = 0
    host: str = ""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


# --- devices ------------------------------------------------------------------------------


def parse_neuron_ls(text: str) -> tuple[int, int]:
    """``(devices, neuron_cores)`` from the output of ``neuron-ls --json-output``.

    Note: the JSON is a list with one object per Neuron device; its core count is
    ``nc_count`` (older releases: ``neuroncore_count``). A device without either counts as
    two cores, what every trn1 device has.
    """
    data = json.loads(text)
    if isinstance(data, dict):  # some releases wrap the list
        data = data.get("neuron_devices", data.get("devices", []))
    if not isinstance(data, list):
        raise ValueError(f"neuron-ls --json-output gave {type(data).__name__}, expected a list")
    cores = 0
    for device in data:
        cores += int(device.get("nc_count", device.get("neuroncore_count", 2)))
    return len(data), cores


def _neuron_devices() -> tuple[int, int, str]:
    """``(devices, cores, how they were found)``; ``(0, 0, ...)`` where there are none."""
    tool = shutil.which("neuron-ls")
    if tool:
        try:
            out = subprocess.run(
                [tool, "--json-output"], capture_output=True, text=True, timeout=60, check=True
            ).stdout
            devices, cores = parse_neuron_ls(out)
            return devices, cores, "neuron-ls"
        except Exception as e:  # a broken driver is itself the finding
            return 0, 0, f"neuron-ls failed: {e}"
    nodes = sorted(p for p in Path("/dev").glob("neuron*") if p.name[6:].isdigit())
    if nodes:
        return len(nodes), 2 * len(nodes), "/dev/neuron* (no neuron-ls on PATH)"
    return 0, 0, "none"


def check_devices(args: argparse.Namespace, local_world_size: int) -> Check:
    """Devices visible, as many as expected and as the local processes need."""
    import torch

    problems = []
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    found = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    # the devices of torch's accelerator other than TorchNeuron's, which neuron-ls counts
    kind = found.type if found is not None and found.type != "neuron" else "gpu"
    gpus = torch.accelerator.device_count() if kind != "gpu" else 0
    n_dev, n_cores, how = _neuron_devices()
    metrics = {"cpus": float(cpus or 0), "gpus": float(gpus), "neuron_cores": float(n_cores)}
    detail = f"cpu {cpus} cores; {kind} {gpus}; neuron {n_dev} devices / {n_cores} cores ({how})"
    if how.startswith("neuron-ls failed"):
        problems.append(how)
    if args.expect_gpus and gpus < args.expect_gpus:
        problems.append(f"{gpus} {kind} devices visible, --expect-gpus {args.expect_gpus}")
    if args.expect_neuron_cores and n_cores < args.expect_neuron_cores:
        problems.append(
            f"{n_cores} NeuronCores visible, --expect-neuron-cores {args.expect_neuron_cores}"
        )
    # One process per accelerator: more local processes than accelerators cannot all run.
    accelerators = n_cores or gpus
    if accelerators and local_world_size > accelerators:
        kind = "NeuronCores" if n_cores else "GPUs"
        problems.append(
            f"{local_world_size} processes on this node but only {accelerators} {kind}; "
            "lower --nproc-per-node"
        )
    if problems:
        return Check("devices", FAIL, "; ".join(problems) + f" [{detail}]", metrics=metrics)
    return Check("devices", PASS, detail, metrics=metrics)


# --- storage ------------------------------------------------------------------------------


def _local_path(url: str) -> Path | None:
    """The local filesystem path of ``url``, or None for a remote one (``s3://`` ...)."""
    if url.startswith("file://"):
        return Path(url[len("file://") :])
    if "://" in url:
        return None
    return Path(url)


def check_free_disk(url: str | None, min_free_gb: float) -> Check:
    """Free space on the filesystem that holds the checkpoint directory."""
    if not url:
        return Check("free disk", SKIP, "no --checkpoint-url given")
    path = _local_path(url)
    if path is None:
        return Check("free disk", SKIP, f"{url} is an object store: no local disk to check")
    probe = path.absolute()
    # The directory may not exist yet (the trainer creates it): measure its nearest ancestor.
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return Check(
            "free disk",
            FAIL,
            f"{probe} is not a directory, so {path} cannot be created; give a directory",
        )
    usage = shutil.disk_usage(probe)
    free_gb = usage.free / 1e9
    detail = f"{free_gb:,.1f} GB free of {usage.total / 1e9:,.1f} GB at {probe}"
    metrics = {"free_gb": free_gb}
    if free_gb < min_free_gb:
        return Check(
            "free disk",
            FAIL,
            f"{detail}, below --min-free-gb {min_free_gb:g}; free space or use another path",
            metrics=metrics,
        )
    return Check("free disk", PASS, f"{detail} (need {min_free_gb:g})", metrics=metrics)


def check_checkpoint_io(
    url: str | None, storage_options: dict[str, Any], size_mb: float, rank: int
) -> Check:
    """Write a file at ``url``, read it back, compare and delete it (through fsspec)."""
    if not url:
        return Check("checkpoint write/read", SKIP, "no --checkpoint-url given")
    import fsspec

    name = f".preflight-{socket.gethostname()}-{rank}-{uuid.uuid4().hex[:8]}.bin"
    payload = os.urandom(max(1, int(size_mb * 2**20)))
    digest = hashlib.sha256(payload).hexdigest()
    try:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
        fs.makedirs(root, exist_ok=True)
        path = f"{root.rstrip('/')}/{name}"
        t0 = time.perf_counter()
        with fs.open(path, "wb") as f:
            f.write(payload)
        t1 = time.perf_counter()
        with fs.open(path, "rb") as f:
            back = f.read()
        t2 = time.perf_counter()
        fs.rm(path)
    except Exception as e:
        return Check(
            "checkpoint write/read",
            FAIL,
            f"cannot write and read {url}: {type(e).__name__}: {e}; check the path, "
            "permissions and credentials",
        )
    if hashlib.sha256(back).hexdigest() != digest:
        return Check(
            "checkpoint write/read",
            FAIL,
            f"{url}: read back {len(back)} bytes that differ from the {len(payload)} written",
        )
    mb = len(payload) / 1e6
    write_mbs, read_mbs = mb / max(t1 - t0, 1e-9), mb / max(t2 - t1, 1e-9)
    return Check(
        "checkpoint write/read",
        PASS,
        f"{url}: {mb:.1f} MB written at {write_mbs:,.0f} MB/s, read back at {read_mbs:,.0f} MB/s",
        metrics={"write_mb_s": write_mbs, "read_mb_s": read_mbs},
    )


# --- processes and ports --------------------------------------------------------------------


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address, IPv4 or IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _TCP_LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def _pids_holding(inodes: set[str]) -> set[int]:
    """Processes with an open file descriptor on one of the socket ``inodes`` (those this
    user may inspect)."""
    wanted = {f"socket:[{i}]" for i in inodes}
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    pids.add(int(proc.name))
                    break
        except OSError:
            continue
    return pids


def _ancestors(pid: int) -> list[int]:
    """``pid``'s parent, grandparent, ... up to (not including) init."""
    chain = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        # the command name (field 2) may contain spaces: the parent pid follows its ')'
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid > 1:
            chain.append(pid)
    return chain


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split()) or "?"


def check_port(port: int, under_launcher: bool) -> Check:
    """No process outside this job listens on the rendezvous port.

    Note: under torchrun the launcher's own store listens on ``MASTER_PORT`` on the first
    node; that holder is this process's parent and is fine. Anything else holding the
    port (a crashed job's leftover) makes the next rendezvous fail or hang.
    """
    if not Path("/proc/net/tcp").exists():
        # No /proc to name the holder: fall back to trying the port.
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError as e:
                if under_launcher:
                    return Check("rendezvous port", WARN, f"port {port} in use ({e})")
                return Check("rendezvous port", FAIL, f"port {port} is in use: {e}")
        return Check("rendezvous port", PASS, f"port {port} free")
    inodes = _listening_inodes(port)
    if not inodes:
        return Check("rendezvous port", PASS, f"port {port} free")
    holders = _pids_holding(inodes)
    ours = {os.getpid(), os.getppid()} if under_launcher else {os.getpid()}
    strangers = sorted(holders - ours)
    if strangers or not holders:
        who = (
            ", ".join(f"pid {p} ({_cmdline(p)[:80]})" for p in strangers)
            if strangers
            else "a process this user cannot inspect"
        )
        return Check(
            "rendezvous port",
            FAIL,
            f"port {port} is held by {who}; end it, or set MASTER_PORT/--port to a free port",
        )
    return Check("rendezvous port", PASS, f"port {port} held by this job's launcher only")


def check_stale_processes(patterns: tuple[str, ...] = ("hlat_train", "hlat-train")) -> Check:
    """Training processes on this node that are not part of this job (a warning: they may
    hold device memory or NeuronCores)."""
    me = os.getpid()
    family = {me, *_ancestors(me)}
    launcher = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None
    stale = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in family:
            continue
        pid = int(proc.name)
        cmd = _cmdline(pid)
        if not any(p in cmd for p in patterns):
            continue
        if launcher is not None and launcher in _ancestors(pid):
            continue  # a sibling rank of this job
        stale.append(f"pid {pid} ({cmd[:60]})")
    if stale:
        return Check("stale processes", WARN, "other training processes: " + "; ".join(stale))
    return Check("stale processes", PASS, "no other hlat-train processes on this node")


# --- collective ---------------------------------------------------------------------------


def _init_group(world_size: int, rank: int, timeout_s: float) -> tuple[Any, Any]:
    """Init the default process group on the best backend present; returns (device, sync)
    where ``sync()`` waits for queued device work."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.HashStore() if world_size == 1 else None  # one process needs no rendezvous
    kw: dict[str, Any] = {"timeout": timeout}
    if store is not None:
        kw.update(store=store, rank=0, world_size=1)
    if torch.accelerator.is_available():  # CUDA, TorchNeuron's neuron device, ...
        from hlat_parallel.device import dist_backend_for, resolve_device

        device = resolve_device("auto", int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(dist_backend_for(device), **kw)
        return device, lambda: torch.accelerator.synchronize(device)
    if _neuron_devices()[1]:
        try:  # the real torch-xla exists only on Neuron instances
            import torch_xla.core.xla_model as xm
            import torch_xla.distributed.xla_backend  # noqa: F401  registers "xla"

            dist.init_process_group("xla", **kw)
            return xm.xla_device(), xm.mark_step
        except Exception as e:
            print(f"preflight: rank {rank}: XLA unavailable ({e}); burn-in on CPU", file=sys.stderr)
    dist.init_process_group("gloo", **kw)
    return torch.device("cpu"), lambda: None


def check_all_reduce(
    size_mb: float, iters: int, min_busbw_gbps: float, timeout_s: float
) -> tuple[Check, Any]:
    """All-reduce a ``size_mb`` buffer ``iters`` times across all ranks; checks the sum and
    reports bus bandwidth (algorithm bandwidth x 2(n-1)/n, the nccl-tests convention).

    Returns the check and the process group module (None when the group failed)."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        device, sync = _init_group(world, rank, timeout_s)
    except Exception as e:
        return (
            Check(
                "all-reduce burn-in",
                FAIL,
                f"process group did not form: {type(e).__name__}: {e}; check MASTER_ADDR/"
                "MASTER_PORT, the network and that every node started",
            ),
            None,
        )
    try:
        n = max(1, int(size_mb * 2**20) // 4)
        buf = torch.full((n,), float(rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(buf)
        sync()
        expected = world * (world + 1) / 2
        wrong = int((buf != expected).sum().item())
        times = []
        for _ in range(iters):
            buf.fill_(1.0)
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            sync()
            times.append(time.perf_counter() - t0)
        # The slowest rank sets the pace of every collective: report its median.
        median = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
        if world > 1:
            median = median.to(device)
            dist.all_reduce(median, op=dist.ReduceOp.MAX)
        t = float(median.item())
    except Exception as e:
        return Check("all-reduce burn-in", FAIL, f"{type(e).__name__}: {e}"), dist
    nbytes = 4 * n
    algbw = nbytes / t / 1e9
    busbw = algbw * 2 * (world - 1) / world
    metrics = {"bytes": float(nbytes), "seconds": t, "algbw_gbps": algbw, "busbw_gbps": busbw}
    what = f"{nbytes / 2**20:.0f} MiB x {world} rank{'s' * (world > 1)} on {device.type}, {t * 1e3:.1f} ms"
    if wrong:
        return (
            Check(
                "all-reduce burn-in",
                FAIL,
                f"{what}: {wrong} of {n} elements hold the wrong sum (expected {expected:g}); "
                "a device or link corrupts data",
                metrics=metrics,
            ),
            dist,
        )
    if world == 1:
        return Check(
            "all-reduce burn-in", PASS, f"{what} (one rank: no link)", metrics=metrics
        ), dist
    detail = f"{what}: bus bandwidth {busbw:.2f} GB/s (algorithm {algbw:.2f} GB/s)"
    if busbw < min_busbw_gbps:
        return (
            Check(
                "all-reduce burn-in",
                FAIL,
                f"{detail}, below --min-busbw-gbps {min_busbw_gbps:g}; a slow or degraded link",
                metrics=metrics,
            ),
            dist,
        )
    return Check("all-reduce burn-in", PASS, detail, metrics=metrics), dist


# --- driver -------------------------------------------------------------------------------


def parse_args(
    argv: list[str] | None = None, prog: str = "hlat-train preflight"
) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Health checks before a training job; run under torchrun for all ranks.",
    )
    p.add_argument("--checkpoint-url", default=None, help="checkpoint directory or s3:// URL")
    p.add_argument(
        "--storage-options",
        default="{}",
        help="fsspec options for the URL as JSON, e.g. '{\"client_kwargs\": {...}}'",
    )
    p.add_argument("--min-free-gb", type=float, default=1.0, help="free disk needed (GB)")
    p.add_argument("--io-mb", type=float, default=16.0, help="size of the write/read test (MB)")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (MASTER_PORT, 29500)")
    p.add_argument("--burn-in-mb", type=float, default=64.0, help="all-reduce buffer (MiB)")
    p.add_argument("--burn-in-iters", type=int, default=5, help="timed all-reduces")
    p.add_argument("--min-busbw-gbps", type=float, default=0.0, help="fail below (GB/s)")
    p.add_argument(
        "--expect-gpus", type=int, default=0, help="accelerators (GPUs) each node must see"
    )
    p.add_argument("--expect-neuron-cores", type=int, default=0, help="per node, e.g. 32")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout (s)")
    p.add_argument("--json", default=None, help="write every rank's results here (rank 0)")
    args = p.parse_args(argv)
    try:
        options = json.loads(args.storage_options)
    except json.JSONDecodeError as e:
        p.error(f"--storage-options is not valid JSON ({e}): {args.storage_options!r}")
    if not isinstance(options, dict):
        p.error(f"--storage-options must be a JSON object, got {args.storage_options!r}")
    args.storage_options = options
    for name in ("min_free_gb", "io_mb", "burn_in_mb", "min_busbw_gbps", "timeout"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative")
    if args.burn_in_iters < 1:
        p.error("--burn-in-iters must be at least 1")
    if args.port is None:
        args.port = int(os.environ.get("MASTER_PORT", DEFAULT_PORT))
    return args


def format_table(checks: list[Check]) -> str:
    """The checks as an aligned text table."""
    rows = [("check", "rank", "host", "status", "detail")]
    rows += [(c.name, str(c.rank), c.host, c.status, c.detail) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4])
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "hlat-train preflight") -> int:
    """Run every check on this rank, gather them on rank 0, print, and return the exit code
    (the same on every rank). Bad arguments exit 2 (``SystemExit``) before any check."""
    args = parse_args(argv, prog)
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    under_launcher = "TORCHELASTIC_RUN_ID" in os.environ
    host = socket.gethostname()

    checks = [
        check_devices(args, local_world),
        check_free_disk(args.checkpoint_url, args.min_free_gb),
        check_port(args.port, under_launcher),
        check_stale_processes(),
        check_checkpoint_io(args.checkpoint_url, args.storage_options, args.io_mb, rank),
    ]
    burn_in, dist = check_all_reduce(
        args.burn_in_mb, args.burn_in_iters, args.min_busbw_gbps, args.timeout
    )
    checks.append(burn_in)
    for c in checks:
        c.rank, c.host = rank, host

    everyone = [checks]
    if dist is not None and dist.is_initialized():
        try:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, [dataclasses.asdict(c) for c in checks])
            everyone = [[Check(**d) for d in rank_checks] for rank_checks in gathered]
        except Exception as e:
            print(f"preflight: rank {rank}: could not gather results: {e}", file=sys.stderr)
        finally:
            dist.destroy_process_group()
    flat = [c for rank_checks in everyone for c in rank_checks]
    failed = [c for c in flat if c.status == FAIL]

    if rank == 0 or len(everyone) == 1:
        # The burn-in bandwidth is one job-wide figure: show it once, from rank 0.
        shown = [c for c in flat if c.rank == 0 or c.status in (FAIL, WARN)]
        if len(everyone) <= 8:
            shown = flat
        order = {c.name: i for i, c in enumerate(checks)}
        shown = sorted(shown, key=lambda c: (order.get(c.name, len(order)), c.rank))
        print(format_table(shown))
        if args.json:
            Path(args.json).write_text(
                json.dumps([dataclasses.asdict(c) for c in flat], indent=2) + "\n"
            )
        if failed:
            print(f"\npreflight: {len(failed)} check(s) FAILED:", file=sys.stderr)
            for c in failed:
                print(f"  - {c.name} (rank {c.rank}, {c.host}): {c.detail}", file=sys.stderr)
        else:
            ranks = len(everyone)
            print(f"\npreflight: all checks passed on {ranks} rank{'s' * (ranks > 1)}")
    return EXIT_FAILED if failed else 0
