"""Gather a sharded checkpoint into one full state dict on one process, for export."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from . import state_json
from .lineage import current_ancestry
from .manifest import MANIFEST_NAME, IncompleteCheckpointError, read_manifest, scan, validate
from .storage import Storage, parse_dirname


def consolidate(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The full (unsharded) state of a checkpoint: ``{entry name: state dict}`` for its model
    and optimizer entries, with plain tensors assembled from every rank's shards; optimizer
    state in torch's nested form, keyed by parameter name (:func:`nest_optimizer_state`).

    ``url`` is a checkpoint directory (``.../step_0000001000``, or a copy of one under any
    name) or a root, in which case the newest complete checkpoint of its current run lineage
    is used (what resume would load). Every file is checked against the checksum in the
    manifest first (a directory that fails raises ``ValueError``; a root skips a damaged
    checkpoint, with a warning, for the one before it). Runs in one process without a process
    group; it needs memory for the whole model and optimizer state. Per-rank entries (data
    loaders, RNG states) are left out: they belong to a rank, not to the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    storage = Storage(url, storage_options)
    if storage.exists(MANIFEST_NAME):
        parent, name = storage.url.rsplit("/", 1) if "/" in storage.url else (".", storage.url)
        storage = Storage(parent, storage_options)
        dirname = name
        try:
            # a copy under another name (``best``) is checked too, at its manifest's step
            step = parse_dirname(name)
            if step is None:
                step = read_manifest(storage, dirname).step
            validate(storage, dirname, step, checksums=True)
        except IncompleteCheckpointError as e:
            raise ValueError(f"cannot consolidate: {e}") from None
    else:
        manifests, _ = scan(storage)
        chain = current_ancestry(m.commit(d) for d, m in manifests.items())
        newest = next((c for c in chain if _is_complete(storage, c.dirname, c.step)), None)
        if newest is None:
            raise FileNotFoundError(f"no complete checkpoint under {storage.url}")
        dirname = newest.dirname
    if storage.is_local:
        reader: dcp.StorageReader = dcp.FileSystemReader(storage.path(dirname))
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(storage.url_of(dirname), **storage.storage_options)
    metadata = reader.read_metadata().state_dict_metadata
    request = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.items()
        if isinstance(item, TensorStorageMetadata) and not key.startswith("_rank/")
    }
    dcp.load(request, storage_reader=reader, no_dist=True)
    skeleton = state_json.loads(request["_global/_json"].numpy().tobytes())
    return {
        name: nest_optimizer_state(state_json.join(skel, request, name))
        for name, skel in skeleton.items()
    }


def nest_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name, flattened as checkpoints store it
    (``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyperparameter>``), in torch's nested form:
    ``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``, the
    parameters with equal hyperparameters in one group. Anything else is returned as is.
    """
    if not state or not all(k.startswith(("state.", "param_groups.")) for k in state):
        return state
    nested: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        kind, rest = key.split(".", 1)
        fqn, name = rest.rsplit(".", 1)
        (nested if kind == "state" else hyper).setdefault(fqn, {})[name] = value
    groups: list[dict[str, Any]] = []
    for fqn, values in hyper.items():
        group = next((g for g in groups if _same_hyper(g, values)), None)
        if group is None:
            groups.append({**values, "params": [fqn]})
        else:
            group["params"].append(fqn)
    return {"state": nested, "param_groups": groups}


def _same_hyper(group: dict[str, Any], values: dict[str, Any]) -> bool:
    if set(group) - {"params"} != set(values):
        return False
    for key, value in values.items():
        other = group[key]
        if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
            if not (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor)):
                return False
            if not torch.equal(value, other):
                return False
        elif value != other:
            return False
    return True


def _is_complete(storage: Storage, dirname: str, step: int) -> bool:
    try:
        validate(storage, dirname, step, checksums=True)
    except IncompleteCheckpointError as e:
        warnings.warn(f"skipping incomplete or damaged checkpoint: {e}", stacklevel=3)
        return False
    return True
