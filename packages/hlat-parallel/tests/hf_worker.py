"""One rank of a Hugging Face ``LlamaForCausalLM`` trained through hlat-parallel, launched by
tests/test_parity.py with torchrun's environment.

Usage: hf_worker.py OUT.json TP. Tensor parallelism over TP ranks with sequence parallelism
(none at TP 1), the plan written for transformers' module names, ``position_ids`` passed (a
model that derives positions from the hidden state's length would see its rank's part of the
sequence), three AdamW steps on one batch; rank 0 writes the losses and gradient norms to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from spawn import end_worker
from transformers import LlamaConfig, LlamaForCausalLM

from hlat_optim import clip_grad_norm_
from hlat_parallel import init_parallel, loss_parallel, parallelize, shard_optimizer

PLAN = {
    "model.embed_tokens": "embedding",
    "model.layers.*.input_layernorm": "norm",
    "model.layers.*.post_attention_layernorm": "norm",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.norm": "norm",
    "lm_head": "lm_head",
}


def main() -> None:
    out, tp = sys.argv[1], int(sys.argv[2])
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
        use_cache=False,
    )
    dims = init_parallel(tp=tp, sp=tp > 1)
    torch.manual_seed(0)
    model = parallelize(LlamaForCausalLM(config), dims, PLAN)
    optimizer = shard_optimizer(torch.optim.AdamW, model.parameters(), dims, lr=1e-2)
    # one batch, three times: the loss falls as the model fits it
    ids = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1))
    losses, norms = [], []
    for _ in range(3):
        positions = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
        with loss_parallel(dims):
            logits = model(ids[:, :-1], position_ids=positions).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        norm = clip_grad_norm_(model.parameters(), 1.0, **dims.norm_groups())
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach()
        losses.append(float(value.full_tensor() if hasattr(value, "full_tensor") else value))
        norms.append(float(norm))
    if dims.rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "norms": norms}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
