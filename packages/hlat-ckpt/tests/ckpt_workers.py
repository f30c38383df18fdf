"""Worker processes of the hlat-ckpt tests: a TP=2 DTensor job that saves, a DP=2 job that
loads, a job that resumes from the newest undamaged checkpoint, a job that resumes from an
older step (a new lineage), a job that rewinds and saves a step it saved before, pipeline
stages that load the layers of their own, data-parallel replicas that load strictly, a job
saving replicated and sharded tensors, a TP job that saves before its optimizer's first
step, a trainer that checkpoints in a loop until it is killed, and a save that runs past a
file size limit.

Run as ``python ckpt_workers.py <scenario> <root>`` with torchrun's environment variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) for the distributed scenarios.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import resource
import signal
import sys
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hlat_ckpt import Checkpointer, CheckpointError


def tp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def train_once(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def tp_save(root: str) -> None:
    """TP=2 model and optimizer saved as shards; rank 0 also writes the full reference values;
    then each rank reloads its own per-rank state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = parallelize_module(tp_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_once(model, optimizer)
    ck = Checkpointer(root, async_save=True, layout={"tp": 2})
    ck.save(1, {"model": model, "optimizer": optimizer, "loader": {"rank": rank, "pos": 10 * rank}})
    ck.wait()
    reference = {f"model.{k}": full(v).clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for k, v in optimizer.state[p].items():
            reference[f"optimizer.{name}.{k}"] = full(v).clone()
    if rank == 0:
        torch.save(reference, os.path.join(root, "reference.pt"))
    loader: dict = {}
    Checkpointer(root).load_latest({"loader": loader})
    assert loader == {"rank": rank, "pos": 10 * rank}, loader


def dp_load(root: str) -> None:
    """Two replicas (plain tensors) load the TP checkpoint and write what they got."""
    rank = dist.get_rank()
    model = tp_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = Checkpointer(root).load_latest({"model": model, "optimizer": optimizer})
    assert step == 1, step
    got = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for k, v in optimizer.state[p].items():
            got[f"optimizer.{name}.{k}"] = v.clone()
    torch.save(got, os.path.join(root, f"dp_rank{rank}.pt"))


def latest(root: str) -> None:
    """``load_latest`` of the model on every rank; writes the step and the warnings."""
    rank = dist.get_rank()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = Checkpointer(root).load_latest({"model": tp_model()})
    messages = [str(w.message) for w in caught if "skipping" in str(w.message)]
    with open(os.path.join(root, f"latest_rank{rank}.json"), "w") as f:
        json.dump({"step": step, "warnings": messages}, f)


def fork(root: str) -> None:
    """Two DP ranks: a run saves steps 1-3, a second resumes from step 1 (a new lineage),
    saves 2 (beside the abandoned 2) and 3; every rank writes what it then loads. The weights
    of a step are the step number plus 100 in the second run."""
    rank = dist.get_rank()
    model = nn.Linear(4, 4)

    def fill(value: float) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)

    first = Checkpointer(root, keep_last=3, async_save=False)
    for step in (1, 2, 3):
        fill(step)
        first.save(step, {"model": model, "progress": {"rank": rank, "step": step}})
    first.close()
    second = Checkpointer(root, keep_last=2, async_save=True)
    progress: dict = {}
    second.load(1, {"model": model, "progress": progress})
    assert progress == {"rank": rank, "step": 1} and float(model.weight[0, 0]) == 1
    for step in (2, 3):
        fill(100 + step)
        second.save(step, {"model": model, "progress": {"rank": rank, "step": step}})
        second.wait()
        if step == 2:
            listed = [(c.step, c.current) for c in second.list()]
    second.close()
    fill(0)
    resumed = Checkpointer(root).load_latest({"model": model, "progress": progress})
    with open(os.path.join(root, f"fork_rank{rank}.json"), "w") as f:
        json.dump(
            {
                "resumed": resumed,
                "weight": float(model.weight[0, 0]),
                "progress": progress,
                "listed_after_2": listed,
                "lineages": [first.lineage, second.lineage],
            },
            f,
        )


def rewind(root: str) -> None:
    """One async Checkpointer per rank saves steps 1-3, loads step 1 and saves step 2 again
    (into the new lineage); every rank writes the steps it then lists."""
    rank = dist.get_rank()
    model = nn.Linear(4, 4)
    ck = Checkpointer(root, async_save=True)
    for step in (1, 2, 3):
        ck.save(step, {"model": model})
    ck.wait()
    ck.load(1, {"model": model})
    ck.save(2, {"model": model})
    ck.wait()
    listed = [(c.step, c.current) for c in ck.list()]
    ck.close()
    with open(os.path.join(root, f"rewind_rank{rank}.json"), "w") as f:
        json.dump(listed, f)


def before_first_step(root: str) -> None:
    """TP=2: a save before the optimizer's first step leaves it as it was, and a job resumed
    from it (with the grads of a warm-up pass set) trains as one that never saved; then a
    checkpoint directory passed as the root is refused on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        model = parallelize_module(tp_model(), mesh, plan)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def trained(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        for _ in range(2):
            train_once(model, optimizer)
        return {k: full(v).clone() for k, v in model.state_dict().items()}

    expected = trained(*build())
    model, optimizer = build()
    ck = Checkpointer(root, async_save=False)
    ck.save(0, {"model": model, "optimizer": optimizer})
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    after = trained(model, optimizer)  # as a job without the save
    assert all(torch.equal(v, expected[k]) for k, v in after.items())

    model, optimizer = build()
    model(torch.randn(4, 16)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    state = {"model": model, "optimizer": optimizer}
    assert Checkpointer(root).load_latest(state) == 0
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert not any(optimizer.state.values())
    optimizer.zero_grad()
    got = trained(model, optimizer)
    assert all(torch.equal(v, expected[k]) for k, v in got.items())

    inner = Checkpointer(os.path.join(root, "step_0000000000"), async_save=False)
    for call in (lambda: inner.load_latest(state), lambda: inner.save(1, state)):
        try:
            call()
        except CheckpointError as e:
            assert "step_0000000000 is a checkpoint (it holds hlat-checkpoint.json)" in str(e)
        else:
            raise AssertionError("a checkpoint directory was taken for a root")


def unsaveable_on_one_rank(root: str) -> None:
    """Rank 1's loader state holds a set, which cannot be saved: every rank raises (rank 1
    its own error, rank 0 naming rank 1) before anything is written, sync and async; then,
    the state fixed, both save and list the step."""
    rank = dist.get_rank()
    model = nn.Linear(2, 2)
    errors = {}
    for async_save in (False, True):
        ck = Checkpointer(root, async_save=async_save)
        loader = {"seen": {1, 2} if rank == 1 else [1, 2]}
        try:
            ck.save(1, {"model": model, "loader": loader})
            ck.wait()
        except (TypeError, CheckpointError) as e:
            errors[str(async_save)] = f"{type(e).__name__}: {e}"
        errors[f"{async_save} files"] = sorted(os.listdir(root)) if os.path.isdir(root) else []
        ck.close()
    ck = Checkpointer(root, async_save=True)
    ck.save(1, {"model": model, "loader": {"seen": [1, 2]}})
    ck.wait()
    errors["listed"] = [c.step for c in ck.list()]
    ck.close()
    with open(os.path.join(root, f"unsaveable_rank{rank}.json"), "w") as f:
        json.dump(errors, f)


def stage(names: list[str], value: float) -> nn.ModuleDict:
    """A pipeline stage: the layers ``names`` of a model, every parameter filled with
    ``value``."""
    stage = nn.ModuleDict({n: nn.Linear(2, 2) for n in names})
    with torch.no_grad():
        for p in stage.parameters():
            p.fill_(value)
    return stage


def saved_after_a_step(ck: Checkpointer, names: list[str]) -> nn.ModuleDict:
    """A stage of ``names`` after one AdamW step, saved with its optimizer as step 1."""
    saved = stage(names, 1.0)
    optimizer = torch.optim.AdamW(saved.parameters())
    sum(p.sum() for p in saved.parameters()).backward()
    optimizer.step()
    ck.save(1, {"model": saved, "optimizer": optimizer})
    return saved


def stages(root: str) -> None:
    """Two pipeline stages (rank 0 layer a, rank 1 layers b and c) save after a step; each
    loads its own layers back; then both hold layer a only, which strict loading refuses
    (layers b and c are no rank's) and strict=False loads. Every rank writes what it got."""
    rank = dist.get_rank()
    names = ["a"] if rank == 0 else ["b", "c"]
    ck = Checkpointer(root, async_save=False)
    saved = saved_after_a_step(ck, names)
    own = stage(names, 0.0)
    ck.load(1, {"model": own, "optimizer": torch.optim.AdamW(own.parameters())})
    pairs = zip(own.parameters(), saved.parameters(), strict=True)
    loaded = all(torch.equal(a, b) for a, b in pairs)
    fewer = stage(["a"], 0.0)
    try:
        ck.load(1, {"model": fewer})
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    untouched = all(not p.any() for p in fewer.parameters())
    ck.load(1, {"model": fewer}, strict=False)
    with open(os.path.join(root, f"stages_rank{rank}.json"), "w") as f:
        json.dump(
            {
                "loaded": loaded,
                "refused": refused,
                "untouched": untouched,
                "a": float(fewer["a"].weight[0, 0]),
                "saved_a": float(saved["a"].weight[0, 0]) if rank == 0 else None,
            },
            f,
        )


def object_collectives_sent() -> list[int]:
    """A list to which torch.distributed's object collectives, from now on, append the
    pickled size of what this rank passes them."""
    sent: list[int] = []

    def spy(collective: Callable[..., None], name: str) -> Callable[..., None]:
        def sending(*args: object, **kwargs: object) -> None:
            obj = inspect.signature(collective).bind(*args, **kwargs).arguments[name]
            sent.append(len(pickle.dumps(obj)))
            collective(*args, **kwargs)

        return sending

    dist.all_gather_object = spy(dist.all_gather_object, "obj")
    dist.broadcast_object_list = spy(dist.broadcast_object_list, "object_list")
    return sent


def replicas_strict(root: str) -> None:
    """Two data-parallel replicas (the same 64 layers on both ranks) save after a step and
    load back, recording the size of the objects each rank sends in the load; then both hold
    63 of the layers, which strict loading refuses; then rank 1 alone has an optimizer of
    another class, whose missing state both ranks refuse. Every rank writes what it got."""
    rank = dist.get_rank()
    names = [f"l{i:02d}" for i in range(64)]
    ck = Checkpointer(root, async_save=False)
    saved = saved_after_a_step(ck, names)
    own = stage(names, 0.0)
    sent = object_collectives_sent()
    ck.load(1, {"model": own, "optimizer": torch.optim.AdamW(own.parameters())})
    pairs = zip(own.parameters(), saved.parameters(), strict=True)
    got: dict[str, object] = {"loaded": all(torch.equal(a, b) for a, b in pairs)}
    got["sent"], got["keys_bytes"] = [*sent], len(pickle.dumps([*saved.state_dict()]))
    fewer = stage(names[:-1], 0.0)
    other = stage(names, 0.0)
    cases = {
        "fewer": {"model": fewer},
        "other_class": {
            "model": other,
            "optimizer": torch.optim.SGD(other.parameters(), momentum=0.9)
            if rank == 1
            else torch.optim.AdamW(other.parameters()),
        },
    }
    for case, state in cases.items():
        try:
            ck.load(1, state)
            got[case] = ""
        except CheckpointError as e:
            got[case] = str(e)
    got["untouched"] = all(not p.any() for p in [*fewer.parameters(), *other.parameters()])
    ck.close()
    with open(os.path.join(root, f"replicas_rank{rank}.json"), "w") as f:
        json.dump(got, f)


REPLICATED_NUMEL = 256 * 1024  # 1 MiB of fp32 per replicated tensor
SHARDED_NUMEL = 512 * 1024  # 2 MiB of fp32 in all, 1 MiB on each of the two ranks


def replicated(root: str) -> None:
    """Two ranks save a model holding a plain tensor and a ``Replicate()`` DTensor (the same
    on both ranks) and a ``Shard(0)`` DTensor, synchronously (step 1) and asynchronously
    (step 2); each rank writes the save stats it got."""
    from dataclasses import asdict

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # the same values on both ranks
    model = nn.Module()
    model.replicated = nn.Parameter(torch.randn(REPLICATED_NUMEL))
    whole = torch.randn(REPLICATED_NUMEL)
    model.replicated_dtensor = nn.Parameter(distribute_tensor(whole, mesh, [Replicate()]))
    whole = torch.randn(SHARDED_NUMEL)
    model.sharded = nn.Parameter(distribute_tensor(whole, mesh, [Shard(0)]))
    stats = []
    for step, async_save in ((1, False), (2, True)):
        ck = Checkpointer(root, keep_last=None, async_save=async_save, save_rng=False)
        ck.save(step, {"model": model})
        ck.close()
        stats.append(asdict(ck.last_save))
    with open(os.path.join(root, f"replicated_rank{rank}.json"), "w") as f:
        json.dump(stats, f)


def save_forever(root: str, async_save: bool) -> None:
    """Resume from the newest checkpoint, then save every step until killed. The weights of
    step N are all N, so a loaded checkpoint shows which step's data it holds."""
    torch.set_num_threads(1)  # small tensors; the test process runs beside it
    model = nn.Linear(256, 256)
    state = {"model": model, "progress": {"step": 0}}
    ck = Checkpointer(root, keep_last=2, async_save=async_save, save_rng=False)
    step = ck.load_latest(state) or 0
    while True:
        step += 1
        with torch.no_grad():
            model.weight.fill_(step)
            model.bias.fill_(step)
        state["progress"]["step"] = step
        ck.save(step, state)


def warm_up_saving() -> None:
    """Saves once in a scratch directory, so that what a first save imports (DCP, sympy:
    over a second) is imported, then stops the writer's thread."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        ck = Checkpointer(scratch, save_rng=False)
        ck.save(1, {"model": nn.Linear(4, 4)})
        ck.close()


def save_past_a_file_size_limit(root: str, async_save: bool, io_threads: int, results) -> None:
    """Saves step 1, then fails to write step 2 past a file size limit; puts the error's
    text (or "no error") on ``results``."""
    # Without SIG_IGN the kernel kills the process with SIGXFSZ instead of failing the write.
    torch.set_num_threads(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    ck = Checkpointer(root, async_save=async_save, io_threads=io_threads)
    state = {"model": torch.nn.Linear(256, 256)}
    ck.save(1, state)
    ck.wait()
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
    try:
        ck.save(2, state)
        ck.wait()
        results.put("no error")
    except CheckpointError as e:
        results.put(str(e))


if __name__ == "__main__":
    scenario, root_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    try:
        {
            "tp_save": tp_save,
            "dp_load": dp_load,
            "latest": latest,
            "fork": fork,
            "rewind": rewind,
            "stages": stages,
            "replicas_strict": replicas_strict,
            "replicated": replicated,
            "before_first_step": before_first_step,
            "unsaveable_on_one_rank": unsaveable_on_one_rank,
        }[scenario](root_dir)
    finally:
        dist.destroy_process_group()
    # Note: the work is saved and the process group destroyed; end before the interpreter's
    # finalization, where torch's threads of a destroyed group now and then abort a finished
    # rank (SIGABRT, "terminate called without an active exception"); hlat-train's CLI ends
    # the same way
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
