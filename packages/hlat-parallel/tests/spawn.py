"""Start worker processes with torchrun's environment on loopback and wait for them: the
launcher of the multi-process tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import NoReturn


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(worker: Path, args: list[str], world: int, timeout: float = 300) -> None:
    """Run ``python worker *args`` as ranks 0..world-1 of one gloo job; fail the test with
    the tail of each failing rank's output."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    failures = []
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            tails = [
                f"rank {r} after {timeout:.0f} s:\n{p.communicate()[0].decode()[-3000:]}"
                for r, p in enumerate(procs)
            ]
            raise AssertionError("a rank did not end in time\n" + "\n".join(tails)) from None
        if proc.returncode:
            failures.append(f"rank {rank} exited {proc.returncode}:\n{output.decode()[-3000:]}")
    assert not failures, "\n".join(failures)


def end_worker() -> NoReturn:
    """End a worker whose work is saved and whose process group is destroyed, before the
    interpreter's finalization, where torch's threads of a destroyed group now and then
    abort a finished rank (SIGABRT, "terminate called without an active exception");
    hlat-train's CLI ends the same way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
