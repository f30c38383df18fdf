"""`export_hf`: a Hugging Face Llama directory from any hlat checkpoint, whatever parallel
layout wrote it (``hlat_ckpt.consolidate`` assembles the shards)."""

from __future__ import annotations

import json
import os
from typing import Any

from hlat_train.config import ConfigError, TrainConfig

CONFIG_NAME = "hlat-train-config.toml"
TOKENIZER_NAME = "tokenizer.model"
HF_TOKENIZER_NAME = "tokenizer.json"


def save_run_files(config: TrainConfig, checkpoint_dir: str) -> None:
    """Write the run's config and a copy of its tokenizer next to its checkpoints, so a
    checkpoint root is self-contained for :func:`export_hf`."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/{CONFIG_NAME}", "w") as f:
        f.write(config.to_toml())
    kept = {".model": TOKENIZER_NAME, ".json": HF_TOKENIZER_NAME}
    suffix = os.path.splitext(config.data.tokenizer)[1]
    if config.data.tokenizer and suffix in kept:
        with (
            fsspec.open(config.data.tokenizer, "rb") as src,
            fs.open(f"{root}/{kept[suffix]}", "wb") as dst,
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
    ``generation_config.json`` and the tokenizer files (SentencePiece's as a
    ``LlamaTokenizer``, or a Hugging Face ``tokenizer.json`` as a
    ``PreTrainedTokenizerFast``), loadable by ``transformers.LlamaForCausalLM.from_pretrained``
    and ``AutoTokenizer``.

    Args:
        checkpoint: a checkpoint root (the newest complete checkpoint is used) or one
            ``step_<N>`` directory; local or fsspec URL.
        out_dir: local output directory (created).
        dtype: ``bfloat16``, ``float16`` or ``float32`` for the weights.
        tokenizer: SentencePiece ``.model`` or ``tokenizer.json`` to ship; default: the
            copy saved with the run.

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
    tokenizer_path = (
        tokenizer or _find(fs, path, TOKENIZER_NAME) or _find(fs, path, HF_TOKENIZER_NAME)
    )
    if tokenizer_path is None:
        raise ConfigError(
            f"{checkpoint}: no {TOKENIZER_NAME} or {HF_TOKENIZER_NAME} saved with the run; "
            "pass tokenizer="
        )
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
    os.makedirs(out_dir, exist_ok=True)
    if tokenizer_path.endswith(".json"):
        files = _hf_tokenizer_files(tokenizer_bytes, out_dir)
    else:
        files = _sentencepiece_files(tokenizer_bytes, out_dir)
    llama = config.llama_config(files.vocab_size)

    state = consolidate(checkpoint, storage_options)["model"]
    tensors = state_dict_to_hf(state, llama)
    tensors = {k: v.to(dtypes[dtype]).contiguous() for k, v in tensors.items()}

    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    bos = files.bos_id if files.bos_id >= 0 else None
    eos = files.eos_id if files.eos_id >= 0 else None
    hf_config = config_to_hf(llama, torch_dtype=dtype, bos_token_id=bos, eos_token_id=eos)
    _write_json(os.path.join(out_dir, "config.json"), hf_config)
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False},
    )
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), files.special)
    _write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            **files.config,
            **files.special,
            "pad_token": None,
            "model_max_length": llama.max_seq_len,
        }
        | (
            # training added EOS after each document and no BOS (unless data.add_bos)
            {"add_bos_token": config.data.add_bos, "add_eos_token": False, "legacy": False}
            if files.config["tokenizer_class"] == "LlamaTokenizer"
            else {}
        ),
    )
    return out_dir


class _TokenizerFiles:
    """What export needs of a tokenizer once its files are written."""

    def __init__(
        self, vocab_size: int, bos_id: int, eos_id: int, special: dict[str, str], config: dict
    ) -> None:
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, bos_id, eos_id
        self.special, self.config = special, config


def _sentencepiece_files(data: bytes, out_dir: str) -> _TokenizerFiles:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    sp.LoadFromSerializedProto(data)
    with open(os.path.join(out_dir, TOKENIZER_NAME), "wb") as f:
        f.write(data)
    ids = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id()}
    special = {k: sp.id_to_piece(i) for k, i in ids.items() if i >= 0}
    return _TokenizerFiles(
        sp.get_piece_size(),
        sp.bos_id(),
        sp.eos_id(),
        special,
        {"tokenizer_class": "LlamaTokenizer"},
    )


def _hf_tokenizer_files(data: bytes, out_dir: str) -> _TokenizerFiles:
    """A ``tokenizer.json`` ships as it is, as a ``PreTrainedTokenizerFast``: its own
    normalizer, pre-tokenizer, post-processor and special tokens decide what it encodes;
    BOS and EOS are the ones ``hlat_data.Tokenizer`` trained with."""
    from hlat_data import Tokenizer

    path = os.path.join(out_dir, HF_TOKENIZER_NAME)
    with open(path, "wb") as f:
        f.write(data)
    import tokenizers

    tokenizer = Tokenizer.from_file(path, num_threads=1)
    impl = tokenizers.Tokenizer.from_file(path)
    special = {
        key: str(impl.id_to_token(i))
        for key, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))
        if i >= 0
    }
    return _TokenizerFiles(
        tokenizer.vocab_size,
        tokenizer.bos_id,
        tokenizer.eos_id,
        special,
        {"tokenizer_class": "PreTrainedTokenizerFast"},
    )


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
