"""One rank of a ZeRO-1 run, launched by tests/test_zero1.py with torchrun's environment.

Usage: zero1_worker.py WORKDIR TP DTYPE (float32 or bfloat16: the precisions of that weight
dtype; ``hooks``: only the optimizer hooks, see :func:`hooks`, to
WORKDIR/hooks-rank<r>.pt). Trains a small language model (a column-parallel bias
and a 0-d parameter among its weights) with ``dp_shard="zero1"`` and writes what the test
compares to WORKDIR/rank<r>.pt:

- ``resume``: per precision, 2 steps, a save with ``hlat_ckpt.Checkpointer``, step 3; then
  the checkpoint loaded back into the same objects (a rollback) and step 3 again; then a
  fresh model of other weights and a fresh optimizer, built before the load (as hlat-train
  builds them), the checkpoint loaded and step 3, then a step at learning rate 0 set
  through ``param_groups`` after the load.
- ``model_only``: per precision, a step, other weights loaded into the model (the
  optimizer's state left as it is), one more step.
- ``switch``: 2 steps of bf16-sr, then a new model and a ``master_weights=True`` optimizer
  (built before the load), the model's weights loaded, then the optimizer's state dict
  (which lacks master weights), one step.
- ``whole``: 2 steps of the same weights and batches under ZeRO-1 and under
  ``dp_shard="none"`` (every parameter stepped whole on every rank).
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from spawn import end_worker
from torch import nn
from torch.distributed.tensor import DTensor

from hlat_ckpt import Checkpointer
from hlat_optim import AdamW
from hlat_parallel import init_parallel, loss_parallel, parallelize, sync_gradients
from hlat_parallel import zero1_optimizer as zero1

LR = 1e-3
VOCAB, DIM, BATCH, SEQ = 64, 32, 2, 9
PLAN = {"embed": "embedding", "norm": "norm", "up": "colwise", "down": "rowwise", "head": "lm_head"}
# precision: (model dtype, optimizer class and arguments)
PRECISIONS: dict[str, tuple[torch.dtype, Any]] = {
    "bf16-sr": (torch.bfloat16, dict(stochastic_rounding=True)),
    "bf16-kahan": (torch.bfloat16, dict(stochastic_rounding=True, kahan_sum=True)),
    "mixed": (torch.bfloat16, dict(master_weights=True)),
    "fp32": (torch.float32, {}),
    "torch": (torch.float32, None),
}


class TinyLM(nn.Module):
    """The README's model, with a 0-d parameter scaling the embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(VOCAB, DIM), nn.RMSNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.head(h)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in model.named_parameters()}


def optimizer_cls(precision: str) -> Any:
    options = PRECISIONS[precision][1]
    if options is None:
        return torch.optim.AdamW
    return functools.partial(AdamW, impl="reference", seed=7, **options)


def build(dims, precision: str, seed: int, dp_shard: str = "zero1"):
    torch.manual_seed(seed)
    model = TinyLM().to(PRECISIONS[precision][0])
    parallelize(model, dims, PLAN, dp_shard=dp_shard)
    cls = optimizer_cls(precision)
    if dp_shard == "zero1":
        optimizer = zero1(cls, model.parameters(), dims, lr=LR, weight_decay=0.1)
    else:
        optimizer = cls(model.parameters(), lr=LR, weight_decay=0.1)
    return model, optimizer


def train_step(model: nn.Module, optimizer, dims, step: int) -> None:
    """One step on the batch of ``step`` for this data-parallel rank."""
    gen = torch.Generator().manual_seed(1000 * step + dims.dp_rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    with loss_parallel(dims):
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
    sync_gradients(model, dims)
    optimizer.step()
    optimizer.zero_grad()


def masters(optimizer) -> list[torch.Tensor]:
    """This rank's fp32 master slices (hlat_optim.AdamW's ``master`` state), in order."""
    found = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            master = optimizer.state[p].get("master")
            if master is not None:
                found.append(master.to_local().clone())
    return found


def resume(dims, precision: str, root: Path) -> dict:
    out: dict = {}
    model, optimizer = build(dims, precision, seed=0)
    for step in (1, 2):
        train_step(model, optimizer, dims, step)
    checkpointer = Checkpointer(str(root / f"ckpt-{precision}"), async_save=False)
    state = {"model": model, "optimizer": optimizer}
    checkpointer.save(2, state)
    out["saved"] = weights(model)
    saved_masters = masters(optimizer)
    train_step(model, optimizer, dims, 3)
    out["uninterrupted"] = weights(model)

    # a rollback: the checkpoint loaded into the objects that went on training
    assert checkpointer.load_latest(state) == 2
    out["rolled_back_loaded"] = weights(model)
    train_step(model, optimizer, dims, 3)
    out["rolled_back"] = weights(model)

    # a resume: new objects of other weights, the optimizer built before the load
    model, optimizer = build(dims, precision, seed=1)
    out["fresh"] = weights(model)
    state = {"model": model, "optimizer": optimizer}
    assert checkpointer.load_latest(state) == 2
    out["resumed_loaded"] = weights(model)
    out["masters_equal"] = [
        torch.equal(a, b) for a, b in zip(saved_masters, masters(optimizer), strict=True)
    ]
    train_step(model, optimizer, dims, 3)
    out["resumed"] = weights(model)
    # a learning rate set after the load (a scheduler's, the config's) reaches the step
    out["lr_loaded"] = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    train_step(model, optimizer, dims, 4)
    out["lr0"] = weights(model)
    checkpointer.close()
    return out


def model_only(dims, precision: str) -> dict:
    model, optimizer = build(dims, precision, seed=0)
    train_step(model, optimizer, dims, 1)
    other, _ = build(dims, precision, seed=1)
    model.load_state_dict(other.state_dict())
    out = {"loaded": weights(model)}
    train_step(model, optimizer, dims, 2)
    out["stepped"] = weights(model)
    return out


def switch(dims) -> dict:
    model, optimizer = build(dims, "bf16-sr", seed=0)
    for step in (1, 2):
        train_step(model, optimizer, dims, step)
    model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    model, optimizer = build(dims, "mixed", seed=1)
    model.load_state_dict(model_state)
    out: dict = {"loaded": weights(model)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.load_state_dict(optimizer_state)
    out["warnings"] = [str(w.message) for w in caught]
    train_step(model, optimizer, dims, 3)
    out["stepped"] = weights(model)
    return out


def whole(dims) -> dict:
    out: dict = {}
    for dp_shard in ("zero1", "none"):
        model, optimizer = build(dims, "fp32", seed=0, dp_shard=dp_shard)
        out["init"] = weights(model)
        for step in (1, 2):
            train_step(model, optimizer, dims, step)
        out[dp_shard] = weights(model)
        if dp_shard == "zero1":  # the parameters ZeRO-1 keeps whole: no dimension to cut
            names = [name for name, _ in model.named_parameters()]
            slots = optimizer._slots
            out["kept_whole"] = sorted(
                n for n, s in zip(names, slots, strict=True) if s.dim is None
            )
    return out


def hooks(dims, dp_shard: str) -> list:
    """The optimizer hooks that run, in order, around a step, ``state_dict()`` and
    ``load_state_dict()``: torch's AdamW on whole replicas (``dp_shard="none"``) or under
    ZeRO-1, as ``(hook, whether it was given this optimizer)``; the closure a step pre-hook
    passes and the dict a state-dict post-hook returns must take effect."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    torch.manual_seed(0)
    model = TinyLM()
    parallelize(model, dims, PLAN, dp_shard=dp_shard)
    params = list(model.parameters())
    if dp_shard == "zero1":
        optimizer = zero1(torch.optim.AdamW, params, dims, lr=LR)
    else:
        optimizer = torch.optim.AdamW(params, lr=LR)
    ran: list = []

    def note(name: str, result: Any = None) -> Any:
        def hook(opt: Any, *args: Any) -> Any:
            ran.append((name, opt is optimizer))
            return result(*args) if result is not None else None

        return hook

    def with_closure(args: tuple, kwargs: dict) -> tuple:  # the step calls it
        return args, {**kwargs, "closure": lambda: ran.append(("closure", True))}

    def extended(state_dict: dict) -> dict:
        return {**state_dict, "noted": True}

    handles = [
        register_optimizer_step_pre_hook(note("global pre")),
        register_optimizer_step_post_hook(note("global post")),
        optimizer.register_step_pre_hook(note("step pre", with_closure)),
        optimizer.register_step_post_hook(note("step post")),
        optimizer.register_state_dict_pre_hook(note("state_dict pre")),
        optimizer.register_state_dict_post_hook(note("state_dict post", extended)),
        optimizer.register_load_state_dict_pre_hook(note("load pre")),
        optimizer.register_load_state_dict_post_hook(note("load post")),
    ]
    if dp_shard == "zero1":  # the wrapped optimizer's own step hooks run around its step
        handles.append(optimizer.inner.register_step_pre_hook(note("inner pre")))
        handles.append(optimizer.inner.register_step_post_hook(note("inner post")))
    train_step(model, optimizer, dims, 1)
    state = optimizer.state_dict()
    ran.append(("noted", state.pop("noted", False)))
    optimizer.load_state_dict(state)
    for handle in handles:
        handle.remove()
    return ran


def main() -> None:
    workdir = Path(sys.argv[1])
    if sys.argv[3] == "hooks":
        dims = init_parallel(tp=int(sys.argv[2]), device="cpu")
        ran = {dp_shard: hooks(dims, dp_shard) for dp_shard in ("none", "zero1")}
        torch.save(ran, workdir / f"hooks-rank{dims.rank}.pt")
        dist.destroy_process_group()
        return
    tp, dtype = int(sys.argv[2]), getattr(torch, sys.argv[3])
    # Note: one weight dtype per process: torch 2.9's vocabulary-parallel embedding fails
    # ("assert self.mask_buffer.data is not None") when a process builds it in a second dtype
    mine = [p for p, (d, _) in PRECISIONS.items() if d == dtype]
    dims = init_parallel(tp=tp, device="cpu")
    result: dict = {"dp": dims.dp, "tp": dims.tp}
    if dtype == torch.float32:
        result["whole"] = whole(dims)
    result["resume"] = {p: resume(dims, p, workdir) for p in mine}
    result["model_only"] = {p: model_only(dims, p) for p in ("bf16-sr", "fp32") if p in mine}
    if dtype == torch.bfloat16:
        result["switch"] = switch(dims)
    torch.save(result, workdir / f"rank{dims.rank}-{sys.argv[3]}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
