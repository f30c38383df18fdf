"""A small deterministic training setup shared by the hlat-ckpt tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
