"""hlat-model against Hugging Face transformers' LlamaForCausalLM with the same weights."""

import dataclasses
import json

import pytest
import torch

from hlat_model import cross_entropy_loss
from hlat_model.hf import config_from_hf, config_to_hf, from_hf, to_hf

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "mha": dict(num_attention_heads=8, num_key_value_heads=8),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
}


def _hf_model(kind: str, **extra):
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=3,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
        **CONFIGS[kind],
        **extra,
    )
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # HF initialises norms to ones: make them non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("kind", CONFIGS)
def test_logits_match_transformers_in_fp32(kind):
    hf = _hf_model(kind)
    ours = from_hf(hf.state_dict(), hf.config).eval()
    tokens = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", CONFIGS)
def test_export_returns_the_original_hf_state_dict(kind):
    hf = _hf_model(kind)
    original = hf.state_dict()
    exported = to_hf(from_hf(original, hf.config))
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("kind", CONFIGS)
def test_loss_gradients_match_transformers(kind):
    hf = _hf_model(kind)
    ours = from_hf(hf.state_dict(), hf.config)
    tokens = torch.randint(0, 512, (2, 33))
    hf_loss = hf(tokens, labels=tokens).loss
    hf_loss.backward()
    loss = cross_entropy_loss(ours(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-6)
    ours_grads = to_hf_grads(ours)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(ours_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def to_hf_grads(model):
    from hlat_model.hf import state_dict_to_hf

    grads = {name: p.grad for name, p in model.named_parameters()}
    return state_dict_to_hf(grads, model.config)


def test_tied_embeddings_round_trip():
    hf = _hf_model("gqa")
    hf.config.tie_word_embeddings = True
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    ours = from_hf(state, hf.config)
    assert ours.lm_head.weight is ours.embed_tokens.weight
    assert set(to_hf(ours)) == set(state)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_training_the_converted_model_leaves_the_hf_tensors_as_they_were(tied):
    hf = _hf_model("gqa")
    hf.config.tie_word_embeddings = tied
    state = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    before = {k: v.clone() for k, v in state.items()}
    ours = from_hf(state, hf.config)
    tokens = torch.randint(0, 512, (2, 17))
    ours(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    torch.optim.SGD(ours.parameters(), lr=1.0).step()
    for name, value in state.items():
        assert torch.equal(value, before[name]), name
    assert not torch.equal(ours.embed_tokens.weight, before["model.embed_tokens.weight"])


def test_config_round_trips_through_hf_json():
    hf = _hf_model("gqa")
    config = config_from_hf(hf.config)
    as_json = config_to_hf(config)
    assert config_from_hf(as_json) == config
    rebuilt = transformers.LlamaConfig(**as_json)
    assert rebuilt.num_key_value_heads == 2 and rebuilt.intermediate_size == 344


def test_non_llama_or_biased_configs_are_refused():
    with pytest.raises(ValueError, match="expected a Llama config"):
        config_from_hf({"model_type": "mistral"})
    base = config_to_hf(config_from_hf(_hf_model("mha").config))
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        config_from_hf({**base, "attention_bias": True})
    with pytest.raises(ValueError, match="rope_scaling"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        config_from_hf({**base, "hidden_act": "gelu"})


def test_a_scaled_rope_in_a_saved_config_json_is_refused(tmp_path):
    # a Llama-3.1-style config as transformers writes it (v5: under rope_parameters)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        rope_theta=500000.0,
        rope_scaling=scaling,
    )
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"'rope_type': 'llama3'.*plain RoPE only"):
        config_from_hf(saved)
    with pytest.raises(ValueError, match=r"'rope_type': 'llama3'.*plain RoPE only"):
        config_from_hf(hf)


def test_bos_and_eos_come_from_the_caller_and_are_never_guessed():
    config = config_from_hf(_hf_model("gqa").config)
    assert "bos_token_id" not in config_to_hf(config)
    assert "eos_token_id" not in config_to_hf(config)
    llama3 = config_to_hf(config, bos_token_id=128000, eos_token_id=128001)
    rebuilt = transformers.LlamaConfig(**llama3)
    assert (rebuilt.bos_token_id, rebuilt.eos_token_id) == (128000, 128001)


@pytest.mark.parametrize("kind", CONFIGS)
def test_under_cpu_autocast_loss_and_gradients_follow_transformers(kind):
    """Under ``torch.autocast("cpu", bfloat16)`` hlat's fp32 model runs the operators
    autocast casts (its hand-fused CPU paths, which autocast would not cast, stand aside):
    forward and backward run, and the loss and gradients stay within bf16 rounding of
    Hugging Face's under the same autocast (norm-wise)."""
    hf = _hf_model(kind)
    ours = from_hf(hf.state_dict(), hf.config)
    tokens = torch.randint(0, 512, (2, 33))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hf_loss = hf(tokens, labels=tokens).loss
        loss = ours(tokens[:, :-1], labels=tokens[:, 1:])
    hf_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss.float(), hf_loss.float(), rtol=1e-2, atol=1e-2)
    ours_grads = to_hf_grads(ours)
    for name, p in hf.named_parameters():
        assert ours_grads[name].dtype == torch.float32, name
        error = (ours_grads[name] - p.grad).norm() / p.grad.norm()
        assert error < 0.05, (name, error.item())


def test_loading_safetensors_reads_the_head_and_refuses_an_untied_model_without_one(tmp_path):
    from safetensors.torch import save_file

    from hlat_model import Llama
    from hlat_model.hf_load import load_hf_weights

    hf = _hf_model("gqa")
    config = config_from_hf(hf.config)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    model = Llama(config)
    load_hf_weights(model, str(tmp_path), config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"lm_head.weight is missing .*\(tie_embeddings=False\)"):
        load_hf_weights(Llama(config), str(tmp_path), config)


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("change", "with_json", "needle"),
    [
        ({"n_layers": 2}, True, r"config.json: its n_layers is 3, the model's is 2"),
        ({"n_kv_heads": 8}, True, r"config.json: its kv_heads is 2, the model's is 8"),
        ({"vocab_size": 256}, True, r"config.json: its vocab_size is 512, the model's is 256"),
        ({"n_layers": 2}, False, r"9 tensor\(s\) .* no parameter for, such as \['model.layers.2"),
        ({"n_kv_heads": 8}, False, r"k_proj.weight \(32, 128\) \(expected \(128, 128\)\)"),
        ({"vocab_size": 256}, False, r"embed_tokens.weight \(512, 128\) \(expected \(256, 128"),
        ({"tie_embeddings": True}, False, r"no parameter for, such as \['lm_head.weight'\]"),
    ],
    ids=["layers", "kv-heads", "vocab", "layers-no-json", "kv-no-json", "vocab-no-json", "tied"],
)
def test_loading_refuses_a_checkpoint_of_another_config_before_reading(
    tmp_path, change, with_json, needle
):
    from hlat_model import Llama
    from hlat_model.hf_load import load_hf_weights

    hf = _hf_model("gqa")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    if not with_json:
        (tmp_path / "config.json").unlink()
    config = dataclasses.replace(config_from_hf(hf.config), **change)
    model = Llama(config)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=needle):
        load_hf_weights(model, str(tmp_path), config)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_tied_checkpoint_that_saved_its_head_as_well_loads(tmp_path):
    """Some tied checkpoints hold ``lm_head.weight`` too; their config.json says they are
    tied, and transformers loads them tied, as hlat does (the head is not read)."""
    from safetensors.torch import save_file

    from hlat_model import Llama
    from hlat_model.hf_load import load_hf_weights

    hf = _hf_model("gqa")
    hf.config.tie_word_embeddings = True
    hf.tie_weights()
    config = config_from_hf(hf.config)
    state = {k: v.clone().contiguous() for k, v in hf.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    model = Llama(config)
    load_hf_weights(model, str(tmp_path), config)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_loading_refuses_a_scaled_rope_and_a_model_of_another_config(tmp_path):
    from hlat_model import Llama
    from hlat_model.hf_load import load_hf_weights

    hf = _hf_model("gqa")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = config_from_hf(hf.config)
    model = Llama(dataclasses.replace(config, n_kv_heads=8))
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"layers.0.attention.qkv_proj.weight of shape \(384"):
        load_hf_weights(model, str(tmp_path), config)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"config.json: rope_scaling .*plain RoPE only"):
        load_hf_weights(Llama(config), str(tmp_path), config)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_model_holding_some_layers_loads_them_from_the_whole_checkpoint(tmp_path):
    """A pipeline rank's stages, under the whole model's names, read their own tensors."""
    from hlat_model import Llama
    from hlat_model.hf_load import load_hf_weights

    hf = _hf_model("gqa")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = config_from_hf(hf.config)
    whole = Llama(config)
    stage = torch.nn.Module()
    stage.layers = torch.nn.ModuleDict({"2": whole.layers[2]})
    stage.norm, stage.lm_head = whole.norm, whole.lm_head
    load_hf_weights(stage, str(tmp_path), config)
    expected = from_hf(hf.state_dict(), hf.config).state_dict()
    for name, value in stage.state_dict().items():
        assert torch.equal(value, expected[name]), name
