import io
import math

import torch

from hlat_model import Llama, LlamaConfig


def _std_ok(t: torch.Tensor, std: float) -> bool:
    # The sample std of n normals has standard error std / sqrt(2n); allow 6 of them.
    n = t.numel()
    return abs(t.float().std().item() - std) < 6 * std / math.sqrt(2 * n) and abs(
        t.float().mean().item()
    ) < 6 * std / math.sqrt(n)


def test_meta_build_then_init_weights_gives_configured_and_scaled_std():
    config = LlamaConfig.preset("tiny", init_std=0.021)
    with torch.device("meta"):
        model = Llama(config)
    assert model.lm_head.weight.is_meta
    model.to_empty(device="cpu")
    model.init_weights()
    scaled = 0.021 / math.sqrt(2 * config.n_layers)
    assert _std_ok(model.embed_tokens.weight, 0.021)
    assert _std_ok(model.lm_head.weight, 0.021)
    for block in model.layers:
        assert _std_ok(block.attention.qkv_proj.weight, 0.021)
        assert _std_ok(block.mlp.gate_up_proj.weight, 0.021)
        assert _std_ok(block.attention.o_proj.weight, scaled)
        assert _std_ok(block.mlp.down_proj.weight, scaled)
        assert torch.equal(block.attention_norm.weight, torch.ones(config.dim))
    assert torch.equal(model.norm.weight, torch.ones(config.dim))


def test_scaled_init_can_be_turned_off():
    model = Llama(LlamaConfig.preset("tiny", init_std=0.02, scaled_init=False))
    assert _std_ok(model.layers[0].attention.o_proj.weight, 0.02)


def test_tied_embeddings_share_one_tensor():
    model = Llama(LlamaConfig.preset("tiny", tie_embeddings=True))
    assert model.lm_head.weight is model.embed_tokens.weight
    untied = Llama(LlamaConfig.preset("tiny"))
    assert model.num_params() == untied.num_params() - untied.lm_head.weight.numel()


def test_tied_embeddings_stay_tied_when_materialised_from_the_meta_device():
    config = LlamaConfig.preset("tiny", tie_embeddings=True)
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    assert model.lm_head.weight is model.embed_tokens.weight
    model.init_weights()
    assert _std_ok(model.lm_head.weight, config.init_std)
    with torch.device("meta"):
        wrapped = torch.nn.Sequential(Llama(config))
    wrapped.to_empty(device="cpu").to(torch.bfloat16)  # materialised through a parent
    inner = wrapped[0]
    assert inner.lm_head.weight is inner.embed_tokens.weight
    assert inner.num_params() == Llama(config).num_params()
    # a state loaded by assignment (its head and embedding are distinct tensors here)
    with torch.device("meta"):
        assigned = Llama(config)
    state = {k: v.clone() for k, v in Llama(config).state_dict().items()}
    assigned.load_state_dict(state, assign=True)
    assert assigned.lm_head.weight is assigned.embed_tokens.weight
    assert torch.equal(assigned.embed_tokens.weight, state["embed_tokens.weight"])


def test_the_model_pickles_and_keeps_its_tie():
    """``torch.save(model)`` round trips: the same values, the head still the embedding."""
    model = Llama(LlamaConfig.preset("tiny", n_layers=1, tie_embeddings=True))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    state = loaded.state_dict()
    assert list(state) == list(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    # loading a state by assignment still ties them again
    state = {k: v.clone() for k, v in model.state_dict().items()}
    loaded.load_state_dict(state, assign=True)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
