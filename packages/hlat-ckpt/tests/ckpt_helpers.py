"""A small deterministic training setup shared by the hlat-ckpt tests."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import torch
from torch import nn


class Counters:
    """A trainer's counters: any object with state_dict()/load_state_dict()."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.tokens = state["steps"], state["tokens"]


def make_state(seed: int) -> dict:
    """Model (with dropout, so RNG state matters), AdamW, a scheduler, counters, loader dict."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "counters": Counters(),
        "loader": {"position": 0, "epoch": 0},
    }


def train_step(state: dict) -> float:
    """One deterministic step; draws random inputs and dropout masks from torch's RNG."""
    x = torch.randn(16, 8)
    loss = state["model"](x).square().mean()
    loss.backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    state["scheduler"].step()
    state["counters"].steps += 1
    state["counters"].tokens += 16
    state["loader"]["position"] += 16
    return loss.item()


def snapshot(state: dict) -> dict[str, torch.Tensor]:
    """Copies of every model and optimizer tensor, by name."""
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for pid, s in state["optimizer"].state_dict()["state"].items():
        for k, v in s.items():
            out[f"optimizer.{pid}.{k}"] = v.clone()
    return out


WORKERS = Path(__file__).with_name("ckpt_workers.py")


def launch(scenario: str, root: Path, world_size: int = 2) -> None:
    """Run ``ckpt_workers.py <scenario> <root>`` as ``world_size`` ranks on loopback and
    fail with a rank's output if any rank fails."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world_size):
        env = os.environ | {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKERS), scenario, str(root)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"{scenario} rank {rank} failed:\n{out[-3000:]}"


class ForkParent:
    """Forks test children from a freshly spawned process instead of from pytest's own.

    A child forked from pytest's process copies whatever threads it had only as memory: the
    OpenMP pool of earlier tests, and under pytest-xdist the thread that serves the worker's
    channel. A lock one of them held stays locked in the child, which then hangs or crashes.
    The process spawned here first runs ``warm_up`` (say, a save, which imports what a save
    needs, then closes its writer) and checks that no Python thread but its own is left, so
    each child starts at once (the crash test kills children a few hundredths of a second
    in) and starts sound.
    """

    def __init__(self, target, *args, warm_up=None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self._process = ctx.Process(target=_fork_on_request, args=(theirs, warm_up, target, args))
        self._process.start()
        theirs.close()

    def fork(self) -> int:
        """Forks a child running ``target(*args)``; returns its pid once it is forked."""
        self._conn.send(True)
        try:
            return self._conn.recv()
        except (EOFError, ConnectionError):
            raise RuntimeError(
                "the process that forks the children ended (its traceback is in the output)"
            ) from None

    def exitcode(self, timeout: float = 60.0) -> int:
        """Waits for the last child and returns its exit code (negative: the signal)."""
        if not self._conn.poll(timeout):
            raise TimeoutError(f"the forked child did not end within {timeout} s")
        return self._conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the process already ended
            self._conn.send(False)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def __enter__(self) -> ForkParent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fork_on_request(conn, warm_up, target, args) -> None:
    if warm_up is not None:
        warm_up()
    threads = threading.enumerate()
    if len(threads) > 1:
        raise RuntimeError(f"the process children are forked from has threads: {threads}")
    ctx = multiprocessing.get_context("fork")
    while conn.recv():
        child = ctx.Process(target=target, args=args)
        child.start()
        conn.send(child.pid)
        child.join()
        conn.send(child.exitcode)
