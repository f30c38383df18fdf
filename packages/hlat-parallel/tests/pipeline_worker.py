"""One rank of a pipeline run, launched by tests/test_pipeline.py with torchrun's environment.

Usage: pipeline_worker.py WORKDIR. Reads WORKDIR/input.pt (model config, initial weights,
batch, document lengths, the schedules to run with their
block splits), trains each schedule for a few SGD steps on a
pipeline over all processes, and writes WORKDIR/<schedule>-rank<r>.pt: the losses of every
step (on the rank holding the last stage), the named gradients of the first step and the
named parameters after the last step, for the stages this rank holds.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hlat_model import Llama, LlamaConfig, cross_entropy_loss
from hlat_model.attention import AttentionMask, document_positions
from hlat_model.model import rope_cos_sin
from hlat_parallel import build_pipeline, init_parallel


def llama_block_args(config: LlamaConfig):
    """What ``Llama.forward`` computes once before its blocks, per micro-batch and stage."""

    def block_args(h: torch.Tensor, doc_lens: torch.Tensor | None = None) -> tuple[Any, ...]:
        batch, seq_len = h.shape[:2]
        if doc_lens is not None:
            position_ids = document_positions(doc_lens, seq_len)
        else:
            position_ids = torch.arange(seq_len, device=h.device).expand(batch, seq_len)
        cos, sin = rope_cos_sin(position_ids, config.head_dim, config.rope_theta)
        mask = AttentionMask.build(doc_lens, seq_len, config.attention, h.device)
        return cos, sin, mask

    return block_args


def run(data: dict, schedule: str, split: list[int] | None) -> dict:
    config = LlamaConfig(**data["config"])
    model = Llama(config)
    model.load_state_dict(data["state"])
    pipe = build_pipeline(
        model,
        schedule=schedule,
        n_microbatches=data["n_microbatches"],
        split=split,
        loss_fn=cross_entropy_loss,
        block_args=llama_block_args(config),
    )
    del model
    optimizer = torch.optim.SGD(pipe.parameters(), lr=data["lr"])
    tokens, doc_lens = data["tokens"], data["doc_lens"]
    out: dict = {"losses": [], "splits": pipe.splits}
    for step in range(data["steps"]):
        args = (tokens[:, :-1],) if pipe.has_first_stage else ()
        kwargs: dict = {"doc_lens": doc_lens}
        losses: list = []
        if pipe.has_last_stage:
            kwargs.update(target=tokens[:, 1:], losses=losses)
        pipe.schedule.step(*args, **kwargs)
        if pipe.has_last_stage:
            out["losses"].append(torch.stack(losses).mean().detach())
        if step == 0:
            out["grads"] = {
                n: p.grad.detach().clone()
                for m in pipe.modules
                for n, p in m.named_parameters()
                if p.grad is not None
            }
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: p.detach().clone() for m in pipe.modules for n, p in m.named_parameters()}
    out["state_keys"] = [k for m in pipe.modules for k in m.state_dict()]
    return out


def main() -> None:
    workdir = Path(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    init_parallel(device="cpu")
    rank = dist.get_rank()
    data = torch.load(workdir / "input.pt", weights_only=False)
    for schedule, split in data["schedules"]:
        try:
            result: dict = run(data, schedule, split)
        except Exception as error:  # reported to the test, which says which schedule failed
            result = {"error": f"{type(error).__name__}: {error}"}
            torch.save(result, workdir / f"{schedule}-rank{rank}.pt")
            raise
        torch.save(result, workdir / f"{schedule}-rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
