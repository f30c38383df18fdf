"""One rank of a pipeline run, launched by tests/test_pipeline.py with torchrun's environment.

Usage: pipeline_worker.py WORKDIR [devices]. Reads WORKDIR/input.pt (model config, initial weights,
batch, document lengths, the schedules to run with their block splits, the number of
micro-batches and the tensor-parallel degree ``tp``), trains each schedule for a few SGD
steps on a pipeline over all processes, and writes WORKDIR/<schedule>-rank<r>.pt: the
losses of every step (on the ranks holding the last stage), the named gradients of the
first step and the named parameters after the last step, for the stages this rank holds
(whole tensors, gathered over "tp").

With ``tp`` > 1 the processes form a ("pp", "dp", "cp", "tp") mesh with pp = world / tp
and sequence parallelism, and each stage is parallelized with the model's plan before torch
wraps it, as hlat-train does: the blocks take their RoPE tables and mask from the
``position_ids`` passed to every rank (a later stage's hidden state holds only this TP
rank's part of the sequence), the logits are vocabulary-sharded and the loss is computed
under ``loss_parallel``.

With ``tp`` 1 it then steps a 1F1B pipeline on 6 rows, which ``n_microbatches`` (4) does
not divide, and writes the error each rank raised to WORKDIR/uneven-rank<r>.pt.

With ``devices`` it only builds pipelines over a "cpu" mesh, a "cuda" mesh (no GPU is
needed to build one on gloo), with ``device="cpu"`` and over a process group, and writes
the device of each one's first stage to WORKDIR/devices-rank<r>.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from spawn import end_worker
from torch.distributed.tensor import DTensor

from hlat_model import Llama, LlamaConfig, block_inputs, cross_entropy_loss
from hlat_model.attention import AttentionMask, document_positions
from hlat_model.model import rope_cos_sin
from hlat_parallel import (
    ParallelConfigError,
    ParallelDims,
    build_pipeline,
    init_parallel,
    loss_parallel,
    parallelize,
    stage_plan,
)


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


def full(t: torch.Tensor) -> torch.Tensor:
    """A whole, plain copy of ``t`` (a DTensor is gathered over its mesh, a Partial one summed)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run(data: dict, schedule: str, split: list[int] | None, dims: ParallelDims) -> dict:
    config = LlamaConfig(**data["config"])
    model = Llama(config)
    model.load_state_dict(data["state"])
    tokens, doc_lens = data["tokens"], data["doc_lens"]
    kwargs: dict = {"doc_lens": doc_lens}
    if dims.tp > 1:
        plan = model.parallel_plan()
        pipe = build_pipeline(
            model,
            schedule=schedule,
            n_microbatches=data["n_microbatches"],
            split=split,
            loss_fn=cross_entropy_loss,
            group=dims.pp_mesh,
            block_args=lambda h, position_ids, doc_lens=None: block_inputs(
                config, position_ids, doc_lens
            ),
            prepare=lambda stage: parallelize(stage, dims, stage_plan(plan, stage)),
        )
        kwargs["position_ids"] = document_positions(doc_lens, tokens.shape[1] - 1)
    else:
        pipe = build_pipeline(
            model,
            schedule=schedule,
            n_microbatches=data["n_microbatches"],
            split=split,
            loss_fn=cross_entropy_loss,
            block_args=llama_block_args(config),
        )
    del model
    held = pipe.rank_module()
    optimizer = torch.optim.SGD(held.parameters(), lr=data["lr"])
    out: dict = {"losses": [], "splits": pipe.splits}
    for step in range(data["steps"]):
        args = (tokens[:, :-1],) if pipe.has_first_stage else ()
        losses: list = []
        last = {"target": tokens[:, 1:], "losses": losses} if pipe.has_last_stage else {}
        with loss_parallel(dims):
            pipe.schedule.step(*args, **kwargs, **last)
        if pipe.has_last_stage:
            out["losses"].append(torch.stack([full(x) for x in losses]).mean())
        if step == 0:
            out["grads"] = {
                n: full(p.grad) for n, p in held.named_parameters() if p.grad is not None
            }
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: full(p) for n, p in held.named_parameters()}
    out["state_keys"] = [k for m in pipe.modules for k in m.state_dict()]
    out["pp_rank"], out["tp_rank"] = dims.pp_rank, dims.tp_rank
    out["sharded"] = sorted(  # parameters of which this rank holds a part only
        n
        for n, p in held.named_parameters()
        if isinstance(p, DTensor) and p.to_local().numel() < p.numel()
    )
    return out


def uneven_batch_refusal(data: dict) -> str:
    """The error of a step on 6 rows split into 4 micro-batches ("" if none)."""
    config = LlamaConfig(**data["config"])
    model = Llama(config)
    model.load_state_dict(data["state"])
    pipe = build_pipeline(
        model,
        schedule="1F1B",
        n_microbatches=data["n_microbatches"],
        loss_fn=cross_entropy_loss,
        block_args=llama_block_args(config),
    )
    tokens, doc_lens = data["tokens"].repeat(2, 1)[:6], data["doc_lens"].repeat(2, 1)[:6]
    args = (tokens[:, :-1],) if pipe.has_first_stage else ()
    last = {"target": tokens[:, 1:], "losses": []} if pipe.has_last_stage else {}
    try:
        pipe.schedule.step(*args, doc_lens=doc_lens, **last)
    except ParallelConfigError as error:
        return str(error)
    return ""


def stage_devices(workdir: Path) -> None:
    """The device of the first stage ``build_pipeline`` builds, per group and ``device``,
    to WORKDIR/devices-rank<r>.pt."""
    from torch.distributed.device_mesh import DeviceMesh

    dims = init_parallel(pp=int(os.environ["WORLD_SIZE"]), device="cpu")
    ranks = list(range(dims.world_size))
    del os.environ["LOCAL_RANK"]  # without it DeviceMesh sets no device where there is none
    cuda_mesh = DeviceMesh("cuda", ranks, mesh_dim_names=("pp",))
    fields = dict(n_layers=2, vocab_size=64, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64)
    config = LlamaConfig.preset("tiny", **fields)
    found = {}
    for name, group, device in [
        ("cpu mesh", dims.pp_mesh, None),
        ("cuda mesh", cuda_mesh, None),
        ("cuda mesh, device='cpu'", cuda_mesh, "cpu"),
        ("process group", dist.group.WORLD, None),
    ]:
        pipe = build_pipeline(
            Llama(config),
            schedule="1F1B",
            n_microbatches=dims.world_size,
            loss_fn=cross_entropy_loss,
            group=group,
            **({} if device is None else {"device": device}),
        )
        found[name] = str(pipe.stages[0].device)
    torch.save(found, workdir / f"devices-rank{dims.rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    workdir = Path(sys.argv[1])
    if sys.argv[2:] == ["devices"]:
        stage_devices(workdir)
        return
    torch.use_deterministic_algorithms(True)
    data = torch.load(workdir / "input.pt", weights_only=False)
    tp = data.get("tp", 1)
    world = int(os.environ["WORLD_SIZE"])
    seq_len = data["tokens"].shape[1] - 1
    dims = init_parallel(tp=tp, sp=tp > 1, pp=world // tp, seq_len=seq_len, device="cpu")
    rank = dist.get_rank()
    for schedule, split in data["schedules"]:
        try:
            result: dict = run(data, schedule, split, dims)
        except Exception as error:  # reported to the test, which says which schedule failed
            result = {"error": f"{type(error).__name__}: {error}"}
            torch.save(result, workdir / f"{schedule}-rank{rank}.pt")
            raise
        torch.save(result, workdir / f"{schedule}-rank{rank}.pt")
        dist.barrier()
    if tp == 1:
        refused = uneven_batch_refusal(data)
        torch.save({"refused": refused}, workdir / f"uneven-rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
