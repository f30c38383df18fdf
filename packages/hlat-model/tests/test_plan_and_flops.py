"""The parallel plan describes the real module tree, and fused shards hold matching slices."""

import fnmatch

import pytest
import torch

from hlat_model import Llama, LlamaConfig, flops_per_token
from hlat_model.hf import state_dict_from_hf, state_dict_to_hf


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_every_plan_pattern_matches_modules_and_every_weight_is_covered(kv_heads):
    model = Llama(LlamaConfig.preset("tiny", n_kv_heads=kv_heads))
    plan = model.parallel_plan()
    modules = dict(model.named_modules())
    for pattern in plan:
        assert any(fnmatch.fnmatchcase(name, pattern) for name in modules), pattern
    for name, _ in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        assert any(fnmatch.fnmatchcase(owner, p) for p in plan), f"{name} has no plan entry"


@pytest.mark.parametrize(("kv_heads", "tp"), [(8, 2), (8, 4), (2, 2), (4, 4)])
def test_contiguous_shards_of_fused_weights_hold_matching_q_k_v_and_gate_up(kv_heads, tp):
    config = LlamaConfig.preset("tiny", n_layers=1, n_kv_heads=kv_heads)
    model = Llama(config)
    entry = model.parallel_plan()["layers.*.attention.qkv_proj"]
    rows = model.layers[0].attention.qkv_proj.weight.shape[0]
    assert entry["groups"] % tp == 0 and sum(entry["segments"]) * entry["groups"] == rows
    hf = state_dict_to_hf(model.state_dict(), config)
    hd, heads_per_rank, kv_per_rank = config.head_dim, config.n_heads // tp, kv_heads // tp
    qkv = model.layers[0].attention.qkv_proj.weight.chunk(tp)
    gate_up = model.layers[0].mlp.gate_up_proj.weight.chunk(tp)
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    ffn_per_rank = config.ffn_dim // tp
    for rank in range(tp):
        # A rank's shard, read with the model's own per-shard view, is Megatron's q/k/v split.
        shard = qkv[rank].unflatten(0, (kv_per_rank, config.q_per_kv + 2, hd))
        assert torch.equal(shard[:, : config.q_per_kv].flatten(0, 2), q.chunk(tp)[rank])
        assert torch.equal(shard[:, config.q_per_kv].flatten(0, 1), k.chunk(tp)[rank])
        assert torch.equal(shard[:, config.q_per_kv + 1].flatten(0, 1), v.chunk(tp)[rank])
        assert heads_per_rank * hd == q.chunk(tp)[rank].shape[0]
        pairs = gate_up[rank].unflatten(0, (ffn_per_rank, 2))
        assert torch.equal(pairs[:, 0], gate.chunk(tp)[rank])
        assert torch.equal(pairs[:, 1], up.chunk(tp)[rank])


def test_hf_conversion_is_inverse_of_itself():
    config = LlamaConfig.preset("tiny", n_layers=2, n_kv_heads=4)
    state = Llama(config).state_dict()
    back = state_dict_from_hf(state_dict_to_hf(state, config), config)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_flops_per_token_is_six_times_matmul_params_plus_attention():
    config = LlamaConfig.preset("hlat-7b")
    with torch.device("meta"):
        model = Llama(config)
    matmul_params = model.num_params() - model.embed_tokens.weight.numel()
    norms = config.dim * (2 * config.n_layers + 1)
    expected = 6 * (matmul_params - norms) + 12 * 32 * 4096 * 4096
    assert flops_per_token(config, 4096) == expected
    # The well-known figure for a 7B model at 4k context: about 4.6e10 FLOPs per token.
    assert 4.5e10 < flops_per_token(config, 4096) < 4.8e10
