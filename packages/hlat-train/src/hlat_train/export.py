"""`export_hf`: a Hugging Face Llama directory from any hlat checkpoint, whatever parallel
layout wrote it (``hlat_ckpt.consolidate`` assembles the shards)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import warnings
from typing import Any

from hlat_train.config import ConfigError, TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_NAME = "hlat-train-config.toml"
TOKENIZER_NAME = "tokenizer.model"
HF_TOKENIZER_NAME = "tokenizer.json"
_KEPT = {".model": TOKENIZER_NAME, ".json": HF_TOKENIZER_NAME}


def save_run_files(config: TrainConfig, checkpoint_dir: str) -> None:
    """Write the run's config and a copy of its tokenizer next to its checkpoints, so a
    checkpoint root is self-contained for :func:`export_hf`."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/{CONFIG_NAME}", "w") as f:
        f.write(config.to_toml())
    _copy_tokenizer(config, fs, root)


def save_step_config(config: TrainConfig, step_url: str) -> None:
    """Write the config a checkpoint was trained with, and a copy of its tokenizer, into its
    directory ``step_url``: a root whose runs trained with different tokenizers exports each
    checkpoint with its own."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(step_url)
    path = path.rstrip("/")
    with fs.open(f"{path}/{CONFIG_NAME}", "w") as f:
        f.write(config.to_toml())
    _copy_tokenizer(config, fs, path)


def _tokenizer_name(config: TrainConfig) -> str | None:
    """The name a run's tokenizer is kept under beside its checkpoints, by its kind."""
    return _KEPT.get(os.path.splitext(config.data.tokenizer)[1]) if config.data.tokenizer else None


def _copy_tokenizer(config: TrainConfig, fs: Any, folder: str) -> None:
    """Copy the run's tokenizer file into ``folder`` of ``fs`` (nothing for a run without
    one)."""
    import fsspec

    name = _tokenizer_name(config)
    if name is not None:
        with (
            fsspec.open(config.data.tokenizer, "rb") as src,
            fs.open(f"{folder}/{name}", "wb") as dst,
        ):
            dst.write(src.read())


def read_trained_config(step_url: str) -> tuple[str | None, str, bool]:
    """``(TOML text, where it was read, whether it is the checkpoint's own)`` of the config
    the checkpoint ``step_url`` was trained with: its own copy, or for a checkpoint without
    one (hlat-train before 0.24) the root's; ``(None, "", False)`` when there is neither."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(step_url)
    found = _find(fs, path.rstrip("/"), CONFIG_NAME)
    if found is None:
        return None, "", False
    with fs.open(found, "r") as f:
        return f.read(), found, found == f"{path.rstrip('/')}/{CONFIG_NAME}"


def parse_config(text: str, where: str) -> dict[str, Any]:
    """A saved config's TOML as plain data; a parse error names ``where``."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: {e}") from None


def _read_config(fs: Any, path: str) -> TrainConfig:
    with fs.open(path, "r") as f:
        return TrainConfig.from_dict(parse_config(f.read(), path), source=path)


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
    ``generation_config.json`` and the tokenizer files (a SentencePiece model with its
    conversion to ``tokenizer.json``, or a Hugging Face ``tokenizer.json`` as it is, both as a
    ``PreTrainedTokenizerFast``), loadable by ``transformers.LlamaForCausalLM.from_pretrained``
    and ``AutoTokenizer``.

    Args:
        checkpoint: a checkpoint root (the newest complete checkpoint is used) or one
            ``step_<N>`` directory; local or fsspec URL. A checkpoint exports with the config
            it was trained with: the copy in its directory, or the root's for one written
            before hlat-train 0.24.
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

    from hlat_model.hf import config_to_hf, state_dict_to_hf

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in dtypes:
        raise ConfigError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    if "://" in out_dir:
        raise ConfigError(f"{out_dir}: the export is written to a local directory; give a path")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{out_dir} exists and is not a directory; give a directory to export to")
    options = storage_options or {}
    fs, path = fsspec.core.url_to_fs(checkpoint, **options)
    path = path.rstrip("/")
    # a root is read at its newest complete checkpoint; each checkpoint with the config it
    # was trained with (its own copy, else the root's)
    directories = _checkpoint_dirs(checkpoint, fs, path, options) or [checkpoint]
    config_paths = [
        _find(fs, fsspec.core.url_to_fs(d, **options)[1].rstrip("/"), CONFIG_NAME)
        for d in directories
    ]
    if config_paths[0] is None:
        raise ConfigError(
            f"{checkpoint}: no {CONFIG_NAME} in it or its parent; point at a checkpoint "
            "directory written by hlat-train (the root given as checkpoint.dir)"
        )
    config = _read_config(fs, config_paths[0])
    tokenizer_path = tokenizer or _trained_tokenizer(fs, directories[0], config, options)

    state, used = _consolidate(directories, config_paths, options)
    if used:  # an older checkpoint: the newest failed its checks
        config = _read_config(fs, config_paths[used])  # type: ignore[arg-type]
        tokenizer_path = tokenizer or _trained_tokenizer(fs, directories[used], config, options)
    tok_fs = fs if tokenizer is None else fsspec.core.url_to_fs(tokenizer)[0]
    with tok_fs.open(tokenizer_path, "rb") as f:
        tokenizer_bytes = f.read()
    with tempfile.TemporaryDirectory() as staging:  # out_dir only gets a checked export
        if tokenizer_path.endswith(".json"):
            files = _hf_tokenizer_files(tokenizer_bytes, staging)
        else:
            files = _sentencepiece_files(tokenizer_bytes, staging, config.data.add_bos)
        llama = config.llama_config(files.vocab_size)
        rows = state["embed_tokens.weight"].shape[0]
        if rows != llama.vocab_size or files.vocab_size > rows:
            raise ConfigError(
                f"{checkpoint}: its embedding has {rows} rows, but the config says "
                f"vocab_size {llama.vocab_size} and the tokenizer {tokenizer_path} has "
                f"{files.vocab_size} pieces; pass the tokenizer it was trained with "
                "(tokenizer=)"
            )
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(staging):
            shutil.move(os.path.join(staging, name), os.path.join(out_dir, name))
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
        },
    )
    return out_dir


def _checkpoint_dirs(checkpoint: str, fs: Any, path: str, options: dict[str, Any]) -> list[str]:
    """The checkpoint directories export may read: ``checkpoint`` itself, or those of a
    root's current lineage, newest first (what ``consolidate`` of the root would try)."""
    import torch.distributed as dist

    from hlat_ckpt import MANIFEST_NAME, Checkpointer

    if fs.exists(f"{path}/{MANIFEST_NAME}"):
        return [checkpoint]
    if not fs.isdir(path):
        return []
    # Note: listing makes no collective; an existing group is passed so that none is created
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    lister = Checkpointer(
        checkpoint, async_save=False, storage_options=options, process_group=group
    )
    try:
        return [info.url for info in reversed(lister.list()) if info.current]
    finally:
        lister.close()


def _trained_tokenizer(
    fs: Any, directory: str, config: TrainConfig, options: dict[str, Any]
) -> str:
    """The tokenizer file the checkpoint ``directory`` was trained with: the copy of the kind
    its config's ``data.tokenizer`` names, in the directory, else beside it (the root)."""
    import fsspec

    name = _tokenizer_name(config)
    path = fsspec.core.url_to_fs(directory, **options)[1].rstrip("/")
    found = _find(fs, path, name) if name is not None else None
    if found is None:
        raise ConfigError(
            f"{directory}: no {name or 'tokenizer file'} saved with it or its root (its "
            f"data.tokenizer is {config.data.tokenizer!r}); pass tokenizer="
        )
    return found


def _consolidate(
    directories: list[str], config_paths: list[str | None], options: dict[str, Any]
) -> tuple[dict[str, Any], int]:
    """The model state of the first of ``directories`` that passes ``consolidate``'s checks
    (a damaged one is skipped with a warning, as ``consolidate`` of a root does) and its
    index."""
    from hlat_ckpt import consolidate

    for i, (directory, config_path) in enumerate(zip(directories, config_paths, strict=True)):
        try:
            state = consolidate(directory, options)["model"]
        except ValueError as error:
            if i == len(directories) - 1:
                raise
            warnings.warn(f"skipping {directory}: {error}", stacklevel=3)
            continue
        if config_path is None:
            raise ConfigError(f"{directory}: no {CONFIG_NAME} in it or its parent")
        return state, i
    raise AssertionError("unreachable")


class _TokenizerFiles:
    """What export needs of a tokenizer once its files are written."""

    def __init__(
        self, vocab_size: int, bos_id: int, eos_id: int, special: dict[str, str], config: dict
    ) -> None:
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, bos_id, eos_id
        self.special, self.config = special, config


def _sentencepiece_files(data: bytes, out_dir: str, add_bos: bool) -> _TokenizerFiles:
    """``tokenizer.model`` as it is, and a ``tokenizer.json`` that encodes as it does, shipped
    as a ``PreTrainedTokenizerFast``.

    Note: transformers' ``LlamaTokenizer`` builds a ``Metaspace`` pre-tokenizer, which adds
    SentencePiece's dummy prefix only to text that does not start with a space, so text that
    starts with whitespace (indented code) got other ids than the run trained on.
    """
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    sp.LoadFromSerializedProto(data)
    fast = _fast_sentencepiece(data)
    with open(os.path.join(out_dir, TOKENIZER_NAME), "wb") as f:
        f.write(data)
    bos = sp.bos_id()
    if add_bos and bos >= 0:
        from tokenizers import processors

        piece = sp.id_to_piece(bos)
        fast.post_processor = processors.TemplateProcessing(
            single=f"{piece} $A", pair=f"{piece} $A {piece} $B", special_tokens=[(piece, bos)]
        )
    fast.save(os.path.join(out_dir, HF_TOKENIZER_NAME))
    ids = {"bos_token": bos, "eos_token": sp.eos_id(), "unk_token": sp.unk_id()}
    special = {k: sp.id_to_piece(i) for k, i in ids.items() if i >= 0}
    return _TokenizerFiles(
        sp.get_piece_size(),
        bos,
        sp.eos_id(),
        special,
        # training added EOS after each document and no BOS (unless data.add_bos)
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": add_bos,
            "add_eos_token": False,
        },
    )


def _fast_sentencepiece(data: bytes) -> Any:
    """The SentencePiece model ``data`` as a ``tokenizers.Tokenizer`` with the same pieces,
    ids and normalisation, laid out as Llama 2's ``tokenizer.json``: BPE merges ranked by
    the score of the piece they make (or a unigram model), byte fallback, the dummy prefix
    prepended to every text, spaces as ``▁``; control pieces special."""
    try:
        import tokenizers
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:
        raise ConfigError(
            f"exporting a SentencePiece tokenizer needs tokenizers and protobuf ({e}): "
            "pip install 'hlat-train[hf]'"
        ) from None
    from tokenizers import AddedToken, Regex, decoders, normalizers

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]
    proto.ParseFromString(data)
    trainer, spec = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score) for p in proto.pieces]
    unk = trainer.unk_id if 0 <= trainer.unk_id < len(pieces) else None
    if trainer.model_type == trainer.UNIGRAM:
        model: Any = tokenizers.models.Unigram(pieces, unk, trainer.byte_fallback)
    elif trainer.model_type == trainer.BPE:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        normal = [(p.piece, p.score) for p in proto.pieces if p.type == p.NORMAL]
        merges = []
        for piece, score in normal:
            splits = [(piece[:k], piece[k:], score) for k in range(1, len(piece))]
            found = [m for m in splits if m[0] in vocab and m[1] in vocab]
            merges += sorted(found, key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
        model = tokenizers.models.BPE(
            vocab,
            [(left, right) for left, right, _ in merges],
            unk_token=None if unk is None else pieces[unk][0],
            fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
        )
    else:
        raise ConfigError(
            "export_hf converts SentencePiece BPE and unigram models; this one is "
            f"{trainer.ModelType.Name(trainer.model_type)}"
        )
    fast = tokenizers.Tokenizer(model)
    steps: list[Any] = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps += [
            normalizers.Replace(Regex("^ +| +$"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    fast.normalizer = normalizers.Sequence(steps)
    fast.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if spec.add_dummy_prefix else [])
    )
    types = {proto.SentencePiece.CONTROL: True, proto.SentencePiece.UNKNOWN: True}
    types[proto.SentencePiece.USER_DEFINED] = False
    fast.add_tokens(
        [
            AddedToken(p.piece, special=types[p.type], normalized=False)
            for p in proto.pieces
            if p.type in types
        ]
    )
    return fast


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
