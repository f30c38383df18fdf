"""One rank of a parity run, launched by tests/test_parity.py with torchrun's environment.

Usage: parity_worker.py WORKDIR TP LAYOUTS, LAYOUTS a JSON list of [dp_shard, sp,
[gradient-accumulation settings]]. Reads WORKDIR/input-*.pt (initial weights, batch, model
config) written by the test, runs 3 training steps with hlat-parallel per layout, and writes
what the test compares to WORKDIR/<dp_shard>-<sp>-<case>-...-rank<r>.pt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from spawn import end_worker
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from hlat_model import Llama, LlamaConfig, cross_entropy_loss
from hlat_optim import clip_grad_norm_
from hlat_parallel import (
    ParallelConfigError,
    init_parallel,
    loss_parallel,
    no_grad_sync,
    parallelize,
    shard_optimizer,
    sync_gradients,
    zero1_optimizer,
)
from hlat_parallel.comm import CollectiveLog

STEPS = 3
LR = 1e-4
MAX_NORM = 1.0


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def build(case: dict, dims, dp_shard: str, optimizer_cls):
    config = LlamaConfig(**case["config"])
    with torch.device("meta"):
        model = Llama(config)
    model.load_state_dict({k: v.clone() for k, v in case["state"].items()}, assign=True)
    parallelize(model, dims, model.parallel_plan(), dp_shard=dp_shard)
    if dp_shard == "fsdp":
        optimizer = shard_optimizer(optimizer_cls, model.parameters(), dims, lr=LR)
    elif dp_shard == "zero1":
        optimizer = zero1_optimizer(optimizer_cls, model.parameters(), dims, lr=LR)
    else:
        optimizer = optimizer_cls(model.parameters(), lr=LR)
    return model, optimizer


def resharded_state_error(model, optimizer, optimizer_cls, case: dict, dims, path: Path) -> float:
    """Save the optimizer state with torch.distributed.checkpoint, load it into the same
    model under FSDP, and return the largest relative difference of the whole states."""
    saved = get_optimizer_state_dict(model, optimizer)
    dcp.save(saved, checkpoint_id=str(path))
    other, other_optimizer = build(case, dims, "fsdp", optimizer_cls)
    target = get_optimizer_state_dict(other, other_optimizer)
    dcp.load(target, checkpoint_id=str(path))
    set_optimizer_state_dict(other, other_optimizer, target)
    names = [n for n, _ in model.named_parameters()]
    mine = dict(zip(names, optimizer.param_groups[0]["params"], strict=True))
    theirs = dict(other.named_parameters())
    worst = 0.0
    for name, param in mine.items():
        for key in ("exp_avg", "exp_avg_sq"):
            a = full(optimizer.state[param][key]).double()
            b = full(other_optimizer.state[theirs[name]][key]).double()
            worst = max(worst, ((a - b).norm() / b.norm()).item())
    return worst


def opt_tag(optimizer_cls) -> str:
    return getattr(optimizer_cls, "func", optimizer_cls).__module__.replace(".", "_")


def run_case(
    case: dict, dims, accumulate: int, optimizer_cls, dp_shard: str, scratch: Path
) -> dict:
    model, optimizer = build(case, dims, dp_shard, optimizer_cls)
    out: dict = {"fused": {}}
    if dims.dp == 1:  # the TP shards as they sit in the module, before any step
        for name in ("layers.0.attention.qkv_proj.weight", "layers.0.mlp.gate_up_proj.weight"):
            out["fused"][name] = local(model.get_parameter(name))
    rows = case["tokens"].shape[0] // dims.dp
    tokens = case["tokens"][dims.dp_rank * rows : (dims.dp_rank + 1) * rows]
    micro = tokens.chunk(accumulate)
    out["comms"] = []
    for step in range(STEPS):
        losses = []
        for i, part in enumerate(micro):
            final = i == len(micro) - 1
            sync = contextlib.nullcontext() if final else no_grad_sync(model)
            # the dispatch-mode log costs Python time per op: only where comms are checked
            logged = step == 0 and accumulate > 1
            log = CollectiveLog() if logged else contextlib.nullcontext()
            with log, sync, loss_parallel(dims):
                logits = model(part[:, :-1])
                loss = cross_entropy_loss(logits, part[:, 1:]) / len(micro)
                loss.backward()
            losses.append(full(loss))
            if isinstance(log, CollectiveLog):
                out["comms"].append(dict(log.counts()))
            if step == 0 and i == 0 and accumulate == 1:
                out["logits"] = full(logits)
        log = CollectiveLog() if step == 0 and accumulate > 1 else contextlib.nullcontext()
        with log:
            sync_gradients(model, dims)  # zero1 and none: the one data-parallel reduction
        if isinstance(log, CollectiveLog):
            out["comms"].append(dict(log.counts()))
        loss = torch.stack(losses).sum()
        dist.all_reduce(loss, group=dims.dp_group)
        if step == 0:
            out["loss"] = loss / dims.dp
            out["grads"] = {n: full(p.grad) for n, p in model.named_parameters()}
            out["norm"] = clip_grad_norm_(model.parameters(), MAX_NORM, **dims.norm_groups())
            out["clipped"] = {n: full(p.grad) for n, p in model.named_parameters()}
        else:
            clip_grad_norm_(model.parameters(), MAX_NORM, **dims.norm_groups())
        log = CollectiveLog() if step == 0 and accumulate > 1 else contextlib.nullcontext()
        with log:
            optimizer.step()
        if isinstance(log, CollectiveLog):
            out["comms"].append(dict(log.counts()))
        optimizer.zero_grad()
    out["params"] = {n: full(p) for n, p in model.named_parameters()}
    if dims.sequence_parallel:  # refused in a pre-hook, before any collective could hang
        try:
            model(tokens[:, :-2])
        except ParallelConfigError as error:
            out["odd_sequence"] = str(error)
    state_local = sum(
        local(v).numel()
        for s in optimizer.state.values()
        for k, v in s.items()
        if torch.is_tensor(v) and v.dim() > 0
    )
    out["state_numel"] = state_local
    if dp_shard == "zero1" and accumulate == 1 and dims.dp > 1:
        out["reshard_error"] = resharded_state_error(
            model, optimizer, optimizer_cls, case, dims, scratch / opt_tag(optimizer_cls)
        )
    return out


def unsharded_optimizer_is_refused(dims) -> str:
    model = torch.nn.Linear(4, 4)
    try:
        shard_optimizer(torch.optim.AdamW, model.parameters(), dims, lr=LR)
    except ParallelConfigError as error:
        return str(error)
    return ""


def main() -> None:
    workdir, tp = Path(sys.argv[1]), int(sys.argv[2])
    layouts = json.loads(sys.argv[3])
    base = init_parallel(tp=tp)
    optimizers = {"torch": torch.optim.AdamW}
    try:
        from hlat_optim import AdamW as HlatAdamW

        # the eager update: the same arithmetic without compiling in every process
        optimizers["hlat_optim"] = functools.partial(HlatAdamW, impl="reference")
    except Exception:
        pass
    for (dp_shard, sp, accumulates), path in itertools.product(
        layouts, sorted(workdir.glob("input-*.pt"))
    ):
        dims = dataclasses.replace(base, sp=sp)  # one process group serves both layouts
        case = torch.load(path, weights_only=False)
        name = path.stem.removeprefix("input-")
        for opt_name, accumulate in case["runs"]:
            if opt_name not in optimizers or accumulate not in accumulates:
                continue
            scratch = workdir / f"reshard-{dp_shard}-sp{int(sp)}-{name}"
            result = run_case(case, dims, accumulate, optimizers[opt_name], dp_shard, scratch)
            if dims.dp > 1 and dp_shard == "fsdp":
                result["refused"] = unsharded_optimizer_is_refused(dims)
            result["dims"] = {"tp": dims.tp, "dp": dims.dp, "tp_rank": dims.tp_rank}
            result["dp_rank"] = dims.dp_rank
            tag = f"{dp_shard}-sp{int(sp)}-{name}-{opt_name}-acc{accumulate}-rank{dims.rank}"
            torch.save(result, workdir / f"{tag}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
