"""Conversion to and from Hugging Face ``LlamaForCausalLM`` naming and layout.

Pure tensor reshuffling: nothing here imports ``transformers``. Hugging Face keeps q, k, v,
gate and up as separate matrices; hlat fuses them in the TP-independent grouped layouts
described in :mod:`hlat_model.model`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hlat_model.config import LlamaConfig
from hlat_model.model import Llama

_HF_PREFIX = "model."


def config_from_hf(hf_config: Any, **overrides: Any) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Hugging Face Llama config (object or ``config.json`` dict)."""
    get = (
        hf_config.get
        if isinstance(hf_config, Mapping)
        else lambda k, d=None: getattr(hf_config, k, d)
    )
    model_type = get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"expected a Llama config (model_type 'llama'), got {model_type!r}")
    n_heads = get("num_attention_heads")
    head_dim = get("head_dim", None)
    if head_dim is not None and head_dim * n_heads != get("hidden_size"):
        raise ValueError(
            f"head_dim {head_dim} x {n_heads} heads != hidden_size {get('hidden_size')}; "
            "hlat-model requires head_dim = hidden_size / num_attention_heads"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if get(flag, False):
            raise ValueError(f"{flag}=True is not supported: hlat-model's linears have no bias")
    # transformers 5 writes RoPE's settings under rope_parameters, earlier ones rope_scaling
    for key in ("rope_scaling", "rope_parameters"):
        scaling = get(key, None)
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(
                f"{key} {scaling!r} is not supported: hlat-model computes plain RoPE only "
                "(rope_type 'default'), and a scaled model's positions would be wrong"
            )
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported: hlat-model's MLP is SwiGLU (silu)")
    fields: dict[str, Any] = dict(
        vocab_size=get("vocab_size"),
        dim=get("hidden_size"),
        n_layers=get("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads", None) or n_heads,
        ffn_dim=get("intermediate_size"),
        max_seq_len=get("max_position_embeddings", 4096),
        norm_eps=get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(get),
        init_std=get("initializer_range", 0.02),
        scaled_init=False,
        tie_embeddings=bool(get("tie_word_embeddings", False)),
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def _rope_theta(get: Any) -> float:
    theta = get("rope_theta", None)
    if theta is None:  # newer transformers keep it under rope_parameters
        theta = (get("rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def config_to_hf(
    config: LlamaConfig,
    torch_dtype: str = "bfloat16",
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict for ``LlamaForCausalLM``.

    The BOS and EOS ids belong to the tokenizer, not the model (Llama-2's are 1 and 2,
    Llama-3's 128000 and 128001): pass them, or they are left out of the dict rather than
    guessed.
    """
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
    }
    if bos_token_id is not None:
        out["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        out["eos_token_id"] = eos_token_id
    return out


def state_dict_from_hf(
    hf_state: Mapping[str, torch.Tensor], config: LlamaConfig
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> hlat-model tensors (fusing q/k/v and gate/up)."""
    hd, groups, per = config.head_dim, config.kv_heads, config.q_per_kv
    sd = {k.removeprefix(_HF_PREFIX): v for k, v in hf_state.items()}
    out: dict[str, torch.Tensor] = {
        "embed_tokens.weight": sd.pop("embed_tokens.weight"),
        "norm.weight": sd.pop("norm.weight"),
    }
    lm_head = sd.pop("lm_head.weight", None)
    if not config.tie_embeddings:
        if lm_head is None:
            raise KeyError("lm_head.weight missing from an untied Hugging Face state dict")
        out["lm_head.weight"] = lm_head
    for i in range(config.n_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        q = sd.pop(src + "self_attn.q_proj.weight").unflatten(0, (groups, per * hd))
        k = sd.pop(src + "self_attn.k_proj.weight").unflatten(0, (groups, hd))
        v = sd.pop(src + "self_attn.v_proj.weight").unflatten(0, (groups, hd))
        out[dst + "attention.qkv_proj.weight"] = torch.cat([q, k, v], dim=1).flatten(0, 1)
        out[dst + "attention.o_proj.weight"] = sd.pop(src + "self_attn.o_proj.weight")
        gate = sd.pop(src + "mlp.gate_proj.weight")
        up = sd.pop(src + "mlp.up_proj.weight")
        out[dst + "mlp.gate_up_proj.weight"] = torch.stack([gate, up], dim=1).flatten(0, 1)
        out[dst + "mlp.down_proj.weight"] = sd.pop(src + "mlp.down_proj.weight")
        out[dst + "attention_norm.weight"] = sd.pop(src + "input_layernorm.weight")
        out[dst + "mlp_norm.weight"] = sd.pop(src + "post_attention_layernorm.weight")
    leftover = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise KeyError(f"unexpected Hugging Face tensors (not a plain Llama?): {leftover[:5]}")
    return out


def state_dict_to_hf(
    state: Mapping[str, torch.Tensor], config: LlamaConfig
) -> dict[str, torch.Tensor]:
    """hlat-model tensors -> Hugging Face tensors; every tensor contiguous and unshared,
    ready for ``safetensors.torch.save_file``."""
    hd, groups, per = config.head_dim, config.kv_heads, config.q_per_kv
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": state["embed_tokens.weight"],
        "model.norm.weight": state["norm.weight"],
    }
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        qkv = state[src + "attention.qkv_proj.weight"].unflatten(0, (groups, per + 2, hd))
        out[dst + "self_attn.q_proj.weight"] = qkv[:, :per].flatten(0, 2)
        out[dst + "self_attn.k_proj.weight"] = qkv[:, per].flatten(0, 1)
        out[dst + "self_attn.v_proj.weight"] = qkv[:, per + 1].flatten(0, 1)
        out[dst + "self_attn.o_proj.weight"] = state[src + "attention.o_proj.weight"]
        gate_up = state[src + "mlp.gate_up_proj.weight"].unflatten(0, (-1, 2))
        out[dst + "mlp.gate_proj.weight"] = gate_up[:, 0]
        out[dst + "mlp.up_proj.weight"] = gate_up[:, 1]
        out[dst + "mlp.down_proj.weight"] = state[src + "mlp.down_proj.weight"]
        out[dst + "input_layernorm.weight"] = state[src + "attention_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "mlp_norm.weight"]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_hf(hf_state: Mapping[str, torch.Tensor], hf_config: Any, **overrides: Any) -> Llama:
    """A :class:`Llama` holding the weights of a Hugging Face Llama state dict.

    ``overrides`` set hlat-only fields such as ``checkpointing`` or ``attention``. The
    model's parameters are copies: training it leaves the tensors of ``hf_state`` as they were.
    """
    config = config_from_hf(hf_config, **overrides)
    with torch.device("meta"):
        model = Llama(config)
    state = state_dict_from_hf(hf_state, config)
    # the fused tensors are new; copy those that are (views of) the caller's
    given = {t.untyped_storage().data_ptr() for t in hf_state.values()}
    for key, value in state.items():
        if value.untyped_storage().data_ptr() in given:
            state[key] = value.detach().clone()
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_embeddings:  # assign=True replaced both parameters: share them again
        model.lm_head.weight = model.embed_tokens.weight
    return model


def to_hf(model: Llama) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of ``model`` (use :func:`config_to_hf` for its config)."""
    return state_dict_to_hf(model.state_dict(), model.config)
