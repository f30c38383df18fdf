"""Split a state dict into tensors (for DCP) and a JSON skeleton (for everything else).

Non-tensor state (learning rates, betas, step counters, a data loader's positions, Python and
NumPy RNG states) is stored as JSON rather than pickled, so loading a checkpoint never
unpickles anything beyond DCP's own metadata file. Each tensor in the tree is replaced by a
reference ``{"__tensor__": key, ...}`` and handed to DCP under ``key``.

Supported leaves: tensors (DTensor included), ``None``, bools, ints, floats (NaN and
infinities included), strings, bytes, NumPy arrays and scalars; containers: dicts (any
JSON-encodable keys), lists and tuples. Anything else is refused at save time with the path
of the offending value.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import torch

_MARK = "__hlat__"  # key of every non-plain JSON object; user dict keys never collide with it


def tensor_key(prefix: str, path: tuple[Any, ...]) -> str:
    """The DCP key of the tensor at ``path`` in the tree saved under ``prefix``."""
    parts = [prefix]
    for p in path:
        text = p if isinstance(p, str) else f"{type(p).__name__}:{p}"
        parts.append(text.replace("%", "%25").replace("/", "%2F"))
    return "/".join(parts)


def split(tree: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(skeleton, tensors)``: ``skeleton`` is JSON-encodable; ``tensors`` maps DCP keys to
    the tensors of ``tree`` (not copied)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(tree, (), prefix, tensors)
    return skeleton, tensors


def join(skeleton: Any, tensors: dict[str, torch.Tensor], where: str = "state") -> Any:
    """Rebuild the tree of :func:`split` from its skeleton and the (loaded) tensors."""
    return _decode(skeleton, tensors, where)


def dumps(skeleton: Any) -> bytes:
    """A skeleton as strict JSON bytes."""
    return json.dumps(skeleton, allow_nan=False, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """Parse skeleton bytes (plain JSON: no code runs)."""
    return json.loads(data)


def tensor_refs(skeleton: Any) -> list[str]:
    """The DCP keys a skeleton refers to."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            if node.get(_MARK) == "tensor":
                found.append(node["key"])
            else:
                for value in node.values():
                    walk(value)

    walk(skeleton)
    return found


def _where(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path)


def _encode(obj: Any, path: tuple[Any, ...], prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = tensor_key(prefix, path)
        tensors[key] = obj
        return {_MARK: "tensor", "key": key, "dtype": str(obj.dtype).removeprefix("torch.")}
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_MARK: "float", "value": repr(obj)}
    if isinstance(obj, bytes | bytearray):
        return {_MARK: "bytes", "b64": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, list):
        return [_encode(v, (*path, i), prefix, tensors) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [_encode(v, (*path, i), prefix, tensors) for i, v in enumerate(obj)]
        return {_MARK: "tuple", "items": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k != _MARK for k in obj):
            return {k: _encode(v, (*path, k), prefix, tensors) for k, v in obj.items()}
        pairs = []
        for k, v in obj.items():
            if not isinstance(k, bool | int | float | str | tuple) and k is not None:
                raise TypeError(
                    f"{prefix}{_where(path)}: dict key {k!r} of type {type(k).__name__} cannot "
                    "be saved; use str, int, float, bool, None or tuple keys"
                )
            pairs.append([_encode(k, path, prefix, {}), _encode(v, (*path, k), prefix, tensors)])
        return {_MARK: "dict", "items": pairs}
    if type(obj).__module__ == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError(f"{prefix}{_where(path)}: NumPy object arrays cannot be saved")
            data = base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode()
            return {_MARK: "ndarray", "dtype": obj.dtype.str, "shape": list(obj.shape), "b64": data}
        if isinstance(obj, np.generic):
            return {
                _MARK: "npscalar",
                "dtype": obj.dtype.str,
                "value": _encode(obj.item(), path, prefix, {}),
            }
    raise TypeError(
        f"{prefix}{_where(path)}: cannot save a {type(obj).__module__}.{type(obj).__qualname__}; "
        "checkpoint state may hold tensors, NumPy arrays, numbers, strings, bytes, None and "
        "dicts/lists/tuples of them (convert other objects in state_dict())"
    )


def _decode(node: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors, where) for v in node]
    if not isinstance(node, dict):
        return node
    kind = node.get(_MARK)
    if kind is None:
        return {k: _decode(v, tensors, where) for k, v in node.items()}
    if kind == "tensor":
        key = node["key"]
        if key not in tensors:
            raise KeyError(f"{where}: tensor {key} was not loaded")
        return tensors[key]
    if kind == "float":
        return float(node["value"])
    if kind == "bytes":
        return base64.b64decode(node["b64"])
    if kind == "tuple":
        return tuple(_decode(v, tensors, where) for v in node["items"])
    if kind == "dict":
        return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in node["items"]}
    if kind in ("ndarray", "npscalar"):
        import numpy as np

        dtype = np.dtype(node["dtype"])
        if dtype.hasobject:
            raise ValueError(f"{where}: refusing a NumPy object dtype")
        if kind == "npscalar":
            return dtype.type(_decode(node["value"], tensors, where))
        raw = base64.b64decode(node["b64"])
        return np.frombuffer(raw, dtype=dtype).reshape(node["shape"]).copy()
    raise ValueError(f"{where}: unknown entry kind {kind!r} (written by a newer hlat-ckpt?)")
