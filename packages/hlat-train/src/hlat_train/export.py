"""`export_hf`: a Hugging Face Llama directory from any hlat checkpoint, whatever parallel
layout wrote it (``hlat_ckpt.consolidate`` assembles the shards)."""

from __future__ import annotations

import json
import os
from typing import Any

from hlat_train.config import ConfigError, TrainConfig

CONFIG_NAME = "hlat-train-config.toml"
TOKENIZER_NAME = "tokenizer.model"


def save_run_files(config: TrainConfig, checkpoint_dir: str) -> None:
    """Write the run's config and a copy of its tokenizer next to its checkpoints, so a
    checkpoint root is self-contained for :func:`export_hf`."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/{CONFIG_NAME}", "w") as f:
        f.write(config.to_toml())
    if config.data.tokenizer and config.data.tokenizer.endswith(".model"):
        with (
            fsspec.open(config.data.tokenizer, "rb") as src,
            fs.open(f"{root}/{TOKENIZER_NAME}", "wb") as dst,
        ):
            dst.write(src.read())


def _find(fs: Any, path: str, name: str) -> str | None:
    for folder in (path, path.rstrip("/").rsplit("/", 1)[0]):
        if fs.exists(f"{folder}/{name}"):
            return f"{folder}/{name}"
    return None


def export_hf(
    checkpoint: str,
    out_dir: str,
    *,
    dtype: str = "bfloat16",
    tokenizer: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write ``out_dir`` with ``model.safetensors``, ``config.json``,
    ``generation_config.json`` and the SentencePiece tokenizer files, loadable by
    ``transformers.LlamaForCausalLM.from_pretrained`` and ``AutoTokenizer``.

    Args:
        checkpoint: a checkpoint root (the newest complete checkpoint is used) or one
            ``step_<N>`` directory; local or fsspec URL.
        out_dir: local output directory (created).
        dtype: ``bfloat16``, ``float16`` or ``float32`` for the weights.
        tokenizer: SentencePiece ``.model`` to ship; default: the copy saved with the run.

    Returns:
        ``out_dir``.
    """
    import fsspec
    import torch
    from safetensors.torch import save_file

    from hlat_ckpt import consolidate
    from hlat_model.hf import config_to_hf, state_dict_to_hf

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in dtypes:
        raise ConfigError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    fs, path = fsspec.core.url_to_fs(checkpoint, **(storage_options or {}))
    config_path = _find(fs, path, CONFIG_NAME)
    if config_path is None:
        raise ConfigError(
            f"{checkpoint}: no {CONFIG_NAME} in it or its parent; point at a checkpoint "
            "directory written by hlat-train (the root given as checkpoint.dir)"
        )
    tokenizer_path = tokenizer or _find(fs, path, TOKENIZER_NAME)
    if tokenizer_path is None:
        raise ConfigError(f"{checkpoint}: no {TOKENIZER_NAME} saved with the run; pass tokenizer=")
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    with fs.open(config_path, "rb") as f:
        config = TrainConfig.from_dict(tomllib.load(f), source=config_path)
    tok_fs = fs if tokenizer is None else fsspec.core.url_to_fs(tokenizer)[0]
    with tok_fs.open(tokenizer_path, "rb") as f:
        tokenizer_bytes = f.read()
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    sp.LoadFromSerializedProto(tokenizer_bytes)
    llama = config.llama_config(sp.get_piece_size())

    state = consolidate(checkpoint, storage_options)["model"]
    tensors = state_dict_to_hf(state, llama)
    tensors = {k: v.to(dtypes[dtype]).contiguous() for k, v in tensors.items()}

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    hf_config = config_to_hf(
        llama, torch_dtype=dtype, bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id()
    )
    _write_json(os.path.join(out_dir, "config.json"), hf_config)
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "do_sample": False},
    )
    with open(os.path.join(out_dir, TOKENIZER_NAME), "wb") as f:
        f.write(tokenizer_bytes)
    special = {
        "bos_token": sp.id_to_piece(sp.bos_id()),
        "eos_token": sp.id_to_piece(sp.eos_id()),
        "unk_token": sp.id_to_piece(sp.unk_id()),
    }
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), special)
    _write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "LlamaTokenizer",
            **special,
            "pad_token": None,
            # training added EOS after each document and no BOS (unless data.add_bos)
            "add_bos_token": config.data.add_bos,
            "add_eos_token": False,
            "legacy": False,
            "model_max_length": llama.max_seq_len,
        },
    )
    return out_dir


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
