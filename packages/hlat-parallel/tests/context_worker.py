"""One rank of a context-parallel run, launched by tests/test_context.py with torchrun's
environment.

Usage: context_worker.py WORKDIR. Reads WORKDIR/input.pt (initial weights, a batch and the
model configs to run), and for each config applies context parallelism over all processes
(the world group for the first config, a 1-D "cp" DeviceMesh for the others), runs forward
and backward on this rank's shard of the batch with the loss scaled by 1/cp, sums the
gradients over the cp group by hand, and writes WORKDIR/<name>-rank<r>.pt: this rank's
logits and loss, the summed gradients, and the errors raised by applying context
parallelism twice and by a document-masked forward.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from spawn import end_worker
from torch.distributed.device_mesh import init_device_mesh

from hlat_model import Llama, LlamaConfig, cross_entropy_loss
from hlat_parallel import ParallelConfigError, apply_context_parallel, cp_indices, shard_sequence


def run(data: dict, config: LlamaConfig, group) -> dict:
    cp, cp_rank = dist.get_world_size(), dist.get_rank()
    model = Llama(config)
    model.load_state_dict(data["state"])
    apply_context_parallel(model, group)
    tokens = data["tokens"]
    ids, labels = (
        shard_sequence(tokens[:, :-1], cp, cp_rank),
        shard_sequence(tokens[:, 1:], cp, cp_rank),
    )
    positions = cp_indices(tokens.shape[1] - 1, cp, cp_rank).expand(tokens.shape[0], -1)
    logits = model(ids, position_ids=positions)
    loss = cross_entropy_loss(logits, labels)  # the mean over this rank's tokens
    (loss / cp).backward()
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)  # what FSDP over the (dp x) cp mesh does
        grads[name] = param.grad
    out = {"logits": logits.detach(), "loss": loss.detach(), "grads": grads}
    try:
        apply_context_parallel(model, group)
    except ParallelConfigError as error:
        out["twice_error"] = str(error)
    try:
        model(ids, doc_lens=torch.tensor([[4, 4]] * tokens.shape[0]))
    except ParallelConfigError as error:
        out["document_mask_error"] = str(error)
    return out


def main() -> None:
    workdir = Path(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    data = torch.load(workdir / "input.pt", weights_only=False)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    for i, (name, config) in enumerate(data["configs"].items()):
        group = None if i == 0 else mesh["cp"]
        result = run(data, LlamaConfig(**config), group)
        torch.save(result, workdir / f"{name}-rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
