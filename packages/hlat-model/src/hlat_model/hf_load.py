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
        if "lm_head.weight" in hf_names:
            return lambda r: ("lm_head.weight", r)
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


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, path: str, config: LlamaConfig) -> int:
    """Copy the weights of the Hugging Face Llama directory ``path`` into ``model``'s
    parameters (hlat names; plain tensors or DTensors), reading only what this rank holds.
    Returns the number of elements read. Every parameter of ``model`` must be found."""
    safe_open = _safe_open()

    files = hf_files(path)
    names = set(files)
    handles: dict[str, Any] = {}

    def open_(file: str) -> Any:
        if file not in handles:
            handles[file] = safe_open(file, "pt")
        return handles[file]

    read = 0
    for name, param in model.named_parameters():
        rows_sources = _row_sources(name, config, names)
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
