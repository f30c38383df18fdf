"""`CollectiveLog`: which collectives a region of code issues, and how many bytes each moves.

For checking that an optimisation removed a collective (gradient accumulation, sequence
parallelism) and for comparing measured traffic with an analytic count.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


@dataclass(frozen=True)
class Collective:
    """One collective call: its kind, the bytes of the full (unsplit) tensor it works on,
    and the size of the group."""

    kind: str
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``gather``, ``scatter`` or the op's
    own name."""
    payload_bytes: int
    group_size: int

    @property
    def bytes_per_rank(self) -> float:
        """Bytes each rank sends with ring algorithms: ``(n-1)/n`` of the payload for
        all-gather and reduce-scatter, twice that for all-reduce."""
        share = (self.group_size - 1) / self.group_size if self.group_size else 0.0
        return self.payload_bytes * share * (2 if self.kind == "all_reduce" else 1)


_COLLECTIVE_WORDS = ("gather", "scatter", "reduce", "broadcast", "all_to_all", "alltoall")


def _kind(name: str) -> str:
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    for kind in ("gather", "scatter"):
        if kind in name:
            return kind
    return name


def _group_size(args: list[Any]) -> int:
    for arg in args:
        if isinstance(arg, str):
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group

                return int(_resolve_process_group(arg).size())  # type: ignore[arg-type]
            except Exception:
                continue
        if isinstance(arg, torch.ScriptObject):
            # c10d ops get the group boxed; the other script objects are reduce ops
            if not arg._type().qualified_name().endswith(".ProcessGroup"):
                continue
            from torch._C._distributed_c10d import ProcessGroup

            return int(ProcessGroup.unbox(arg).size())
        size = getattr(arg, "size", None)
        if callable(size) and not isinstance(arg, torch.Tensor):
            try:
                return int(size())
            except Exception:
                continue
    return 0


def _payload(namespace: str, kind: str, args: list[Any], group_size: int) -> int:
    """Bytes of the whole tensor: the largest argument (a tensor or a list of tensors,
    summed), or one rank's piece times the group where no argument holds the whole (a c10d
    gather or scatter off its root, a functional all-gather)."""
    sizes = []
    for arg in args:
        tensors = [t for t in tree_flatten(arg)[0] if isinstance(t, torch.Tensor)]
        if tensors:
            sizes.append(sum(t.numel() * t.element_size() for t in tensors))
    payload = max(sizes, default=0)
    split = ("all_gather", "gather", "reduce_scatter", "scatter")
    if sizes and kind in split and (namespace == "c10d" or kind == "all_gather"):
        payload = max(payload, min(sizes) * group_size)
    return payload


class CollectiveLog(TorchDispatchMode):
    """A context manager recording every c10d / functional collective issued inside it
    (by DTensor, FSDP2 or direct ``torch.distributed`` calls)::

        with CollectiveLog() as log:
            loss.backward()
        print(log.counts(), log.bytes_per_rank())
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if func.namespace in _NAMESPACES and any(w in name for w in _COLLECTIVE_WORDS):
            flat, _ = tree_flatten((args, kwargs))
            kind, group_size = _kind(name), _group_size(flat)
            payload = _payload(func.namespace, kind, [*args, *kwargs.values()], group_size)
            self.calls.append(Collective(kind, payload, group_size))
        return func(*args, **kwargs)

    def counts(self) -> Counter[str]:
        """Number of calls per kind."""
        return Counter(call.kind for call in self.calls)

    def bytes_per_rank(self) -> dict[str, float]:
        """Bytes sent per rank, per kind (see :attr:`Collective.bytes_per_rank`)."""
        totals: dict[str, float] = {}
        for call in self.calls:
            totals[call.kind] = totals.get(call.kind, 0.0) + call.bytes_per_rank
        return totals
