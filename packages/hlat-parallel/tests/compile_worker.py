"""One rank of a tensor-parallel run with compiled blocks, launched by
tests/test_compile_blocks.py with torchrun's environment.

Usage: compile_worker.py WORKDIR SP. Builds the same small Llama twice under TP over both
ranks (sequence parallel if SP is "1"), once with ``parallelize(compile=True)`` and once
eager, runs two forward and backward passes of each with the loss under ``loss_parallel``,
and writes the losses and full gradients to WORKDIR/<compiled|eager>-rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from spawn import end_worker
from torch.distributed.tensor import DTensor

from hlat_model import Llama, LlamaConfig, cross_entropy_loss
from hlat_parallel import init_parallel, loss_parallel, parallelize

CONFIG = LlamaConfig(
    vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64
)


def run(dims, state: dict, tokens: torch.Tensor, compile: bool) -> dict:
    with torch.device("meta"):
        model = Llama(CONFIG)
    model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    parallelize(model, dims, model.parallel_plan(), compile=compile)
    losses = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        with loss_parallel(dims):
            loss = cross_entropy_loss(logits, tokens[:, 1:])
            loss.backward()
        losses.append(loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach())
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in model.named_parameters()
    }
    return {"losses": torch.stack(losses), "grads": grads}


def main() -> None:
    workdir, sp = Path(sys.argv[1]), sys.argv[2] == "1"
    dims = init_parallel(tp=2, sp=sp)
    torch.manual_seed(0)
    state = Llama(CONFIG).state_dict()
    tokens = torch.randint(0, 256, (2, 33))
    rank = dist.get_rank()
    for compile in (False, True):
        result = run(dims, state, tokens, compile)
        name = "compiled" if compile else "eager"
        torch.save(result, workdir / f"{name}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    end_worker()


if __name__ == "__main__":
    main()
