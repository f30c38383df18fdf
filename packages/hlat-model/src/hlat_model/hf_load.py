"""Load a Hugging Face Llama directory (``save_pretrained`` safetensors) into a model that may
already be split over ranks, each rank reading only the rows and columns it holds.

The model's parameters may be plain tensors (one process, or a pipeline rank's stages under
the whole model's names) or DTensors of any placement (tensor-parallel ``Shard``, FSDP2's
``Shard`` and ``_StridedShard``, ``Replicate``). Which global rows and columns a rank holds
is read off the DTensor itself: an index vector laid out like the parameter
(``distribute_tensor(arange, ..., src_data_rank=None)``, no communication) names them, so
every layout torch can build is covered by torch's own split rules. Each hlat row is then
mapped to its Hugging Face tensor and row (q/k/v fused per KV group, gate/up interleaved),
and runs of consecutive rows are read through safetensors' lazy slices.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hlat_model.config import LlamaConfig

_HF_PREFIX = "model."
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def hf_files(path: str) -> dict[str, str]:
    """``{tensor name: file}`` of a ``save_pretrained`` directory: one ``model.safetensors``,
    or the shards its ``model.safetensors.index.json`` lists."""
    index = os.path.join(path, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_NAME)
    if not os.path.exists(single):
        raise FileNotFoundError(
            f"{path} has neither {SINGLE_NAME} nor {INDEX_NAME}: not a safetensors "
            "save_pretrained directory"
        )
    safe_open = _safe_open()

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def _safe_open() -> Any:
    """safetensors' ``safe_open``, or an error that says how to install it."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ImportError(
            "hlat_model.hf_load reads safetensors files: pip install 'hlat-model[hf]'"
        ) from None
    return safe_open


RowSource = Callable[[int], tuple[str, int]]


def _row_sources(name: str, config: LlamaConfig, hf_names: set[str]) -> RowSource:
    """For an hlat parameter, a function of its row: the Hugging Face tensor and row."""

    def hf(key: str) -> str:
        for candidate in (_HF_PREFIX + key, key):
            if candidate in hf_names:
                return candidate
        raise KeyError(f"{key} is missing from the Hugging Face checkpoint")

    if name == "lm_head.weight":
        if {"lm_head.weight", _HF_PREFIX + "lm_head.weight"} & hf_names:
            source = hf("lm_head.weight")
            return lambda r: (source, r)
        if not config.tie_embeddings:
            raise KeyError(
                "lm_head.weight is missing from the Hugging Face checkpoint and the model "
                "does not tie its embeddings (tie_embeddings=False)"
            )
        source = hf("embed_tokens.weight")  # tied
        return lambda r: (source, r)
    parts = name.split(".")
    if parts[0] != "layers":
        source = hf(name)
        return lambda r: (source, r)
    layer = f"layers.{parts[1]}."
    tail = ".".join(parts[2:])
    if tail == "attention.qkv_proj.weight":
        hd, per = config.head_dim, config.q_per_kv
        q, k, v = (hf(layer + f"self_attn.{p}_proj.weight") for p in "qkv")

        def qkv(r: int) -> tuple[str, int]:
            group, within = divmod(r, (per + 2) * hd)
            if within < per * hd:
                return q, group * per * hd + within
            if within < (per + 1) * hd:
                return k, group * hd + within - per * hd
            return v, group * hd + within - (per + 1) * hd

        return qkv
    if tail == "mlp.gate_up_proj.weight":
        gate, up = hf(layer + "mlp.gate_proj.weight"), hf(layer + "mlp.up_proj.weight")
        return lambda r: (gate if r % 2 == 0 else up, r // 2)
    renamed = {
        "attention.o_proj.weight": "self_attn.o_proj.weight",
        "mlp.down_proj.weight": "mlp.down_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "mlp_norm.weight": "post_attention_layernorm.weight",
    }
    if tail not in renamed:
        raise KeyError(f"no Hugging Face tensor for {name}")
    source = hf(layer + renamed[tail])
    return lambda r: (source, r)


def held_indices(param: torch.Tensor) -> list[torch.Tensor | None]:
    """Per dimension, the global indices this rank holds (None: all of them)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if not isinstance(param, DTensor):
        return [None] * param.dim()
    out: list[torch.Tensor | None] = []
    for dim in range(param.dim()):
        placements = [
            p if getattr(p, "dim", None) == dim and not p.is_replicate() else Replicate()
            for p in param.placements
        ]
        if all(p.is_replicate() for p in placements):
            out.append(None)
            continue
        index = torch.arange(param.shape[dim], device=param.to_local().device)
        shape = [1] * param.dim()
        shape[dim] = -1
        # the same split rules as the parameter's (size 1 on the other dimensions, which
        # are replicated here), without communication
        local = distribute_tensor(
            index.view(shape), param.device_mesh, placements, src_data_rank=None
        ).to_local()
        out.append(local.flatten().cpu())
    return out


def _runs(rows: list[tuple[str, int]]) -> Iterator[tuple[str, int, int, int]]:
    """(source, first source row, stop, how many hlat rows) for consecutive runs."""
    start = 0
    while start < len(rows):
        source, first = rows[start]
        end = start + 1
        while end < len(rows) and rows[end] == (source, first + end - start):
            end += 1
        yield source, first, first + end - start, end - start
        start = end


def _hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors of a Llama of ``config`` (names without ``model.``) and
    their shapes."""
    d, f, hd = config.dim, config.ffn_dim, config.head_dim
    q, kv = config.n_heads * hd, config.kv_heads * hd
    out: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (config.vocab_size, d),
        "norm.weight": (d,),
    }
    if not config.tie_embeddings:
        out["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.n_layers):
        layer = f"layers.{i}."
        for tail, shape in (
            ("self_attn.q_proj.weight", (q, d)), ("self_attn.k_proj.weight", (kv, d)),
            ("self_attn.v_proj.weight", (kv, d)), ("self_attn.o_proj.weight", (d, q)),
            ("mlp.gate_proj.weight", (f, d)), ("mlp.up_proj.weight", (f, d)),
            ("mlp.down_proj.weight", (d, f)), ("input_layernorm.weight", (d,)),
            ("post_attention_layernorm.weight", (d,)),
        ):  # fmt: skip
            out[layer + tail] = shape
    return out


# the fields of the directory's config.json that must be the model's
_CONFIG_FIELDS = (
    "vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "ffn_dim", "rope_theta",
    "norm_eps", "tie_embeddings",
)  # fmt: skip


def _check_config_json(path: str, config: LlamaConfig) -> bool:
    """Refuse a ``config.json`` in ``path`` (if any) that is not ``config`` (see
    :data:`_CONFIG_FIELDS`) or that hlat-model cannot run (``config_from_hf``'s refusals).
    Returns whether there is one."""
    from hlat_model.hf import config_from_hf

    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        return False
    with open(config_path) as f:
        try:
            theirs = config_from_hf(json.load(f))
        except ValueError as e:
            raise ValueError(f"{config_path}: {e}") from None
    for field in _CONFIG_FIELDS:
        mine, hf = getattr(config, field), getattr(theirs, field)
        if mine != hf:
            raise ValueError(
                f"{config_path}: its {field} is {hf}, the model's is {mine}; is the "
                "checkpoint's config the model's?"
            )
    return True


def _check_tensors(
    path: str, files: dict[str, str], config: LlamaConfig, open_: Any, tied_by_json: bool
) -> None:
    """Refuse a checkpoint whose tensors are not exactly those of a Llama of ``config``, of
    their whole shapes (read from the files' headers). ``tied_by_json``: its ``config.json``
    says the embeddings are tied, so a head saved as well is the embedding's copy."""
    expected = _hf_shapes(config)
    unused, wrong = [], []
    found = set()
    for name, file in files.items():
        key = name.removeprefix(_HF_PREFIX)
        if key.endswith("rotary_emb.inv_freq"):  # a buffer older transformers saved
            continue
        if key == "lm_head.weight" and tied_by_json and "lm_head.weight" not in expected:
            # a tied model's head saved as well (transformers ties it to the embedding and
            # so does the model): checked for its shape, not read
            expected_head = expected["embed_tokens.weight"]
            shape = tuple(open_(file).get_slice(name).get_shape())
            if shape != expected_head:
                wrong.append(f"{name} {shape} (expected {expected_head})")
            continue
        if key not in expected:
            unused.append(name)
            continue
        found.add(key)
        shape = tuple(open_(file).get_slice(name).get_shape())
        if shape != expected[key]:
            wrong.append(f"{name} {shape} (expected {expected[key]})")
    missing = [key for key in expected if key not in found]
    if missing:
        raise KeyError(
            f"{path} lacks {len(missing)} tensor(s) of a model of this config, such as "
            f"{missing[:3]}; is the checkpoint's config the model's?"
        )
    if unused:
        raise ValueError(
            f"{path} holds {len(unused)} tensor(s) that a model of this config has no "
            f"parameter for, such as {unused[:3]}; is the checkpoint's config the model's "
            f"({config.n_layers} layers, tie_embeddings={config.tie_embeddings})?"
        )
    if wrong:
        raise ValueError(
            f"{path} holds {len(wrong)} tensor(s) of another shape than this config's, such "
            f"as {wrong[:3]}; is the checkpoint's config the model's?"
        )


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, path: str, config: LlamaConfig) -> int:
    """Copy the weights of the Hugging Face Llama directory ``path`` into ``model``'s
    parameters (hlat names; plain tensors or DTensors), reading only what this rank holds.
    Returns the number of elements read. Every parameter of ``model`` must be found.

    Before anything is read, the directory must be a checkpoint of ``config``: its
    ``config.json``, when there is one, with the same shape, ``rope_theta``, ``norm_eps``
    and tying (plain RoPE only), and its tensors exactly those of ``config``, of their whole
    shapes (a pipeline rank's model may hold some of them); the model's parameters must be
    those of ``config``."""
    from hlat_model.model import Llama

    safe_open = _safe_open()

    files = hf_files(path)
    names = set(files)
    handles: dict[str, Any] = {}

    def open_(file: str) -> Any:
        if file not in handles:
            handles[file] = safe_open(file, "pt")
        return handles[file]

    has_json = _check_config_json(path, config)
    sources = {name: _row_sources(name, config, names) for name, _ in model.named_parameters()}
    _check_tensors(path, files, config, open_, has_json and config.tie_embeddings)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Llama(config).named_parameters()}
    for name, param in model.named_parameters():
        if name not in shapes or param.shape != shapes[name]:
            raise ValueError(
                f"the model's {name} of shape {tuple(param.shape)} is not a parameter of a "
                f"Llama of this config ({tuple(shapes[name]) if name in shapes else 'none'})"
            )
    read = 0
    for name, param in model.named_parameters():
        rows_sources = sources[name]
        index = held_indices(param)
        local = param.to_local() if hasattr(param, "to_local") else param
        rows = index[0].tolist() if index[0] is not None else range(param.shape[0])
        columns = index[1] if param.dim() > 1 else None
        pieces = []
        for source, first, stop, _count in _runs([rows_sources(r) for r in rows]):
            view = open_(files[source]).get_slice(source)
            if columns is None:
                piece = view[first:stop]
            else:
                lo, hi = int(columns.min()), int(columns.max()) + 1
                piece = view[first:stop, lo:hi]
                if hi - lo != len(columns):
                    piece = piece[:, columns - lo]
            read += piece.numel()
            pieces.append(piece)
        value = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if tuple(value.shape) != tuple(local.shape):
            raise ValueError(
                f"{name}: read {tuple(value.shape)} from {path}, this rank holds "
                f"{tuple(local.shape)}; is the checkpoint's config the model's?"
            )
        local.copy_(value.to(local.dtype))
    return read
