"""One rank of a Hugging Face ``Qwen3ForCausalLM`` under tensor parallelism, launched by
tests/test_parity.py with torchrun's environment.

Usage: qwen3_worker.py. It runs TP 2 without, then with, sequence parallelism, both on one
process group (the second ``init_parallel`` reuses it). Qwen3 normalises each query and key
head (``q_norm``, ``k_norm``) between the colwise projections and the rowwise ``o_proj``; the
plan marks them ``head_norm``. Every rank compares the loss and every gradient (gathered over
tp) with the same model in this process, unsplit, and exits non-zero when they differ.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from hf_worker import PLAN as LLAMA_PLAN
from spawn import end_worker
from torch.distributed.tensor import DTensor
from transformers import Qwen3Config, Qwen3ForCausalLM

from hlat_parallel import init_parallel, loss_parallel, parallelize

PLAN = {  # the Llama plan, and Qwen3's norm of each query and key head
    **LLAMA_PLAN,
    "model.layers.*.self_attn.q_norm": "head_norm",
    "model.layers.*.self_attn.k_norm": "head_norm",
}


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def main() -> None:
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    for sp in (False, True):  # one rendezvous: init_parallel reuses the group it finds
        check(config, init_parallel(tp=2, sp=sp))
    dist.destroy_process_group()


def check(config: Qwen3Config, dims) -> None:
    """The model at ``dims`` against one process: the loss and every gradient."""
    torch.manual_seed(0)
    reference = Qwen3ForCausalLM(config)
    with torch.no_grad():  # norm weights away from 1, so that their gradients matter
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    model = parallelize(copy.deepcopy(reference), dims, PLAN)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).expand(2, -1)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        logits = m(ids[:, :-1], position_ids=positions).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    expected = loss_of(reference)
    expected.backward()
    with loss_parallel(dims):
        loss = loss_of(model)
        loss.backward()
    torch.testing.assert_close(full(loss), expected.detach(), rtol=1e-5, atol=0)
    for (name, param), (_, ref) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert param.grad is not None, name
        torch.testing.assert_close(
            full(param.grad), ref.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )


if __name__ == "__main__":
    main()
    end_worker()
