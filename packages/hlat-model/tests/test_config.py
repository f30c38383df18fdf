import math

import pytest
import torch

from hlat_model import PRESETS, ConfigError, Llama, LlamaConfig


def _meta_params(config: LlamaConfig) -> int:
    with torch.device("meta"):
        return Llama(config).num_params()


def test_hlat_7b_has_exactly_the_parameters_of_hf_llama2_7b():
    assert _meta_params(LlamaConfig.preset("hlat-7b")) == 6_738_415_616


def test_llama3_8b_has_exactly_the_parameters_of_meta_llama3_8b():
    assert _meta_params(LlamaConfig.preset("llama3-8b")) == 8_030_261_248


def test_llama2_70b_has_exactly_the_parameters_of_hf_llama2_70b():
    assert _meta_params(LlamaConfig.preset("llama2-70b")) == 68_976_648_192


def test_llama3_70b_has_exactly_the_parameters_of_meta_llama3_70b():
    assert _meta_params(LlamaConfig.preset("llama3-70b")) == 70_553_706_496


def test_hlat_7b_preset_carries_the_recipe_numerics():
    c = LlamaConfig.preset("hlat-7b")
    assert (c.n_layers, c.dim, c.n_heads, c.kv_heads, c.ffn_dim) == (32, 4096, 32, 32, 11008)
    assert (c.vocab_size, c.max_seq_len, c.rope_theta, c.norm_eps) == (32000, 4096, 1e4, 1e-5)
    assert c.init_std == 0.021 and c.scaled_init and not c.tie_embeddings


def test_every_preset_builds_on_meta_without_memory():
    for name in PRESETS:
        assert _meta_params(LlamaConfig.preset(name)) > 0


def test_tiny_preset_has_a_few_million_parameters():
    assert 1e6 < _meta_params(LlamaConfig.preset("tiny")) < 2e7


def test_preset_overrides_fields():
    assert LlamaConfig.preset("tiny", n_layers=2).n_layers == 2


def test_a_multi_head_preset_stays_multi_head_when_only_n_heads_changes():
    for name, heads in (("hlat-7b", 64), ("tiny", 4)):
        config = LlamaConfig.preset(name, n_heads=heads)
        assert (config.n_heads, config.kv_heads) == (heads, heads), name
    # a grouped-query preset keeps its key/value heads; naming them keeps them too
    assert LlamaConfig.preset("llama3-8b", n_heads=16).kv_heads == 8
    assert LlamaConfig.preset("hlat-7b", n_heads=64, n_kv_heads=16).kv_heads == 16


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown preset 'llama9'.*hlat-7b"):
        LlamaConfig.preset("llama9")


def test_unknown_override_field_is_named():
    with pytest.raises(ConfigError, match=r"unknown LlamaConfig field.*hidden_size"):
        LlamaConfig.preset("tiny", hidden_size=10)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            dict(dim=250, n_heads=8),
            r"n_heads 8 does not divide dim 250; .*e\.g\. 2 for head_dim 125",
        ),
        (dict(dim=100, n_heads=3), r"e\.g\. 1 for head_dim 100\)"),  # not 0 heads
        (dict(dim=4096, n_heads=24), r"e\.g\. 32 for head_dim 128\)"),
        (dict(n_heads=8, n_kv_heads=3), "n_kv_heads 3 does not divide n_heads 8"),
        (dict(dim=24, n_heads=8), "head_dim dim/n_heads = 3 is odd"),
        (dict(n_layers=0), "n_layers must be a positive integer"),
        (dict(vocab_size=-1), "vocab_size must be a positive integer"),
        (dict(ffn_dim=1.5), "ffn_dim must be a positive integer"),
        (dict(n_kv_heads=0), "n_kv_heads must be a positive integer"),
        (dict(norm_eps=0.0), "norm_eps must be a positive number"),
        (dict(rope_theta=-1.0), "rope_theta must be a positive number"),
        (dict(norm_eps=math.nan), "norm_eps must be a positive number, got nan"),
        (dict(rope_theta=math.inf), "rope_theta must be a positive number, got inf"),
        (dict(init_std=math.nan), "init_std must be a positive number, got nan"),
        (dict(init_std=-math.inf), "init_std must be a positive number, got -inf"),
        (dict(norm_eps=True), "norm_eps must be a positive number, got True"),
        (dict(n_kv_heads=True), "n_kv_heads must be a positive integer, got True"),
        (dict(checkpointing="some"), "checkpointing must be 'none', 'selective' or 'full'"),
        (dict(attention="xformers"), "attention must be 'auto', 'sdpa', 'flex' or 'blocked'"),
        (dict(tie_embeddings="false"), "tie_embeddings must be True or False, got 'false'"),
        (dict(sequence_first=1), "sequence_first must be True or False, got 1"),
        (dict(scaled_init=None), "scaled_init must be True or False, got None"),
    ],
)
def test_invalid_config_is_rejected_with_a_specific_message(fields, message):
    base = dict(vocab_size=128, dim=64, n_layers=2, n_heads=8, ffn_dim=128, max_seq_len=64)
    with pytest.raises(ConfigError, match=message):
        LlamaConfig(**{**base, **fields})


def test_sequence_longer_than_max_seq_len_is_refused_before_compute():
    model = Llama(LlamaConfig.preset("tiny", n_layers=1, max_seq_len=16))
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_a_meta_model_runs_forward_and_backward_for_shapes_alone():
    """On the meta device (shapes without memory: a 7B model here) forward and backward
    run and give meta gradients of the parameters' shapes; autocast knows no meta device,
    so asking it whether it is on there must not raise."""
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("hlat-7b"))
        tokens = torch.randint(0, 32_000, (2, 65))
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    assert loss.device.type == "meta" and loss.shape == ()
    weight = model.layers[0].mlp.gate_up_proj.weight
    assert weight.grad is not None and weight.grad.shape == weight.shape
