"""Parallel plans as plain data: parsing, matching to module names, and the shape checks
shared by both backends.

A plan maps module-name patterns to styles::

    {"embed_tokens": "embedding",
     "layers.*.attention.qkv_proj": {"style": "fused_colwise", "segments": [512, 64, 64],
                                     "groups": 8},
     "layers.*.attention.o_proj": "rowwise", "layers.*.attention_norm": "norm",
     "lm_head": "lm_head"}

``*`` matches exactly one component of a dotted module name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from hlat_parallel.dims import ParallelConfigError

STYLES = ("colwise", "rowwise", "fused_colwise", "embedding", "lm_head", "norm", "head_norm")


@dataclass(frozen=True)
class PlanEntry:
    """One plan rule: a module-name pattern and how to split the modules it matches.

    For ``fused_colwise`` the output rows are ``groups`` repeats of ``segments`` (e.g. q, k,
    v rows of one KV group); a contiguous row split is correct when tp divides ``groups``.
    For ``head_norm`` (a norm applied to each head of a colwise layer's local output, such
    as Qwen3's ``q_norm``), ``heads_dim`` is the heads dimension of its input.
    """

    pattern: str
    style: str
    segments: tuple[int, ...] = ()
    groups: int = 1
    heads_dim: int = -2

    def matches(self, name: str) -> bool:
        """True when the dotted module ``name`` fits the pattern (``*`` = one component)."""
        regex = "\\.".join(
            "[^.]+" if part == "*" else re.escape(part) for part in self.pattern.split(".")
        )
        return re.fullmatch(regex, name) is not None


def parse_plan(plan: Mapping[str, Any]) -> list[PlanEntry]:
    """Validate a plain-data plan and return its entries, in plan order."""
    if not isinstance(plan, Mapping):
        raise ParallelConfigError(
            f"a parallel plan is a dict of module-name pattern -> style, got {type(plan).__name__}"
        )
    entries = []
    for pattern, value in plan.items():
        spec = {"style": value} if isinstance(value, str) else dict(value)
        style = spec.pop("style", None)
        if style not in STYLES:
            raise ParallelConfigError(
                f"plan entry {pattern!r}: unknown style {style!r}; use one of {', '.join(STYLES)}"
            )
        segments = tuple(spec.pop("segments", ()))
        groups = spec.pop("groups", 1)
        heads_dim = spec.pop("heads_dim", -2)
        if spec:
            raise ParallelConfigError(
                f"plan entry {pattern!r}: unknown key(s) {', '.join(sorted(spec))}; "
                "a style dict holds 'style' and, for fused_colwise, 'segments' and 'groups', "
                "for head_norm 'heads_dim'"
            )
        if heads_dim != -2 and style != "head_norm":
            raise ParallelConfigError(
                f"plan entry {pattern!r}: 'heads_dim' only applies to head_norm"
            )
        if not isinstance(heads_dim, int) or isinstance(heads_dim, bool):
            raise ParallelConfigError(
                f"plan entry {pattern!r}: 'heads_dim' must be an integer, got {heads_dim!r}"
            )
        if style == "fused_colwise":
            if not segments or any(not isinstance(s, int) or s < 1 for s in segments):
                raise ParallelConfigError(
                    f"plan entry {pattern!r}: fused_colwise needs 'segments', a list of positive "
                    f"row counts (e.g. [q_rows, k_rows, v_rows]), got {list(segments)}"
                )
            if not isinstance(groups, int) or groups < 1:
                raise ParallelConfigError(
                    f"plan entry {pattern!r}: 'groups' must be a positive integer, got {groups!r}"
                )
        elif segments or groups != 1:
            raise ParallelConfigError(
                f"plan entry {pattern!r}: 'segments' and 'groups' only apply to fused_colwise"
            )
        entries.append(PlanEntry(pattern, style, segments, groups, heads_dim))
    return entries


def match_plan(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, PlanEntry]:
    """Module name -> entry for every module a plan entry matches.

    Every pattern must match at least one module and no module may match two patterns, so a
    renamed layer is an error rather than a silently unsplit weight.
    """
    names = [name for name, _ in model.named_modules() if name]
    return _match_names(parse_plan(plan), names, type(model).__name__)


def _match_names(entries: list[PlanEntry], names: list[str], owner: str) -> dict[str, PlanEntry]:
    """:func:`match_plan` on the module ``names`` of a model called ``owner``."""
    matched: dict[str, PlanEntry] = {}
    for entry in entries:
        hits = [name for name in names if entry.matches(name)]
        if not hits:
            sample = ", ".join(names[:6])
            raise ParallelConfigError(
                f"plan pattern {entry.pattern!r} matches no module of "
                f"{owner} (its modules are named like {sample}, ...); "
                "fix the pattern or the plan"
            )
        for name in hits:
            if name in matched:
                raise ParallelConfigError(
                    f"module {name!r} matches both {matched[name].pattern!r} and "
                    f"{entry.pattern!r}; make the patterns disjoint"
                )
            matched[name] = entry
    return matched


def computes_sequence_first(model: nn.Module) -> bool:
    """True when ``model`` says it computes sequence-first (``[S, B, H]`` activations):
    a boolean ``sequence_first`` attribute on the model or, failing that, on its
    ``config`` (as ``hlat_model.LlamaConfig`` has)."""
    for owner in (model, getattr(model, "config", None)):
        flag = getattr(owner, "sequence_first", None)
        if isinstance(flag, bool):
            return flag
    return False


def check_shapes(model: nn.Module, matched: Mapping[str, PlanEntry], tp: int) -> None:
    """Raise :class:`ParallelConfigError` unless every matched module can be split ``tp`` ways.

    Runs before any module is changed.
    """
    modules = dict(model.named_modules())
    for name, entry in matched.items():
        module = modules[name]
        where = f"{name} ({entry.style})"
        if entry.style == "embedding":
            if not isinstance(module, nn.Embedding):
                raise ParallelConfigError(
                    f"{where} must be an nn.Embedding, got {type(module).__name__}"
                )
            _divisible(module.num_embeddings, tp, f"{where}: vocabulary size", "pad the vocabulary")
            continue
        if entry.style in ("norm", "head_norm"):
            if not isinstance(getattr(module, "weight", None), nn.Parameter):
                raise ParallelConfigError(f"{where} has no 'weight' parameter to replicate")
            continue
        if not isinstance(module, nn.Linear):
            raise ParallelConfigError(f"{where} must be an nn.Linear, got {type(module).__name__}")
        if entry.style == "rowwise":
            _divisible(module.in_features, tp, f"{where}: in_features", "change the layer width")
        elif entry.style in ("colwise", "lm_head"):
            _divisible(module.out_features, tp, f"{where}: out_features", "pad the layer")
        else:
            rows = entry.groups * sum(entry.segments)
            if rows != module.out_features:
                raise ParallelConfigError(
                    f"{where}: groups {entry.groups} x segments {list(entry.segments)} = {rows} "
                    f"rows, but the layer has {module.out_features}; fix the plan"
                )
            if entry.groups % tp:
                raise ParallelConfigError(
                    f"{where}: tp {tp} does not divide its {entry.groups} groups (each "
                    f"of segments {list(entry.segments)}), so a contiguous split would cut a "
                    f"group; pick tp dividing {entry.groups}"
                )


def check_sequence_parallel(model: nn.Module, matched: Mapping[str, PlanEntry]) -> None:
    """Raise :class:`ParallelConfigError` naming every module of ``model`` that holds
    parameters of its own and that no plan entry matches.

    Under sequence parallelism such a module (a norm left out of the plan, a mistyped
    pattern) runs on this rank's part of the sequence, and nothing sums its gradients over
    tp. Runs before any module is changed.
    """
    uncovered = [
        name or f"{type(model).__name__} itself"
        for name, module in model.named_modules()
        if name not in matched and next(module.parameters(recurse=False), None) is not None
    ]
    if uncovered:
        raise ParallelConfigError(
            f"sequence parallelism runs every module on a part of the sequence, and "
            f"{', '.join(uncovered)} {'holds' if len(uncovered) == 1 else 'hold'} "
            "parameters that no plan entry matches: their gradients would not be summed "
            "over tp; add them to the plan (a norm is 'norm'), or set sp=False"
        )


def check_shared_parameters(model: nn.Module, names: list[str], why: str) -> None:
    """Raise :class:`ParallelConfigError` when a parameter of one of the modules ``names``
    (dotted names in ``model``) is also held by a module outside it (tied weights).

    The parallel backends replace the parameters of the modules they split, so the module
    outside would keep the old tensor and the tie would break without an error; ``why``
    ends the message (the backend's reason and fix). Runs before any module is changed.
    """
    modules = dict(model.named_modules())
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((f"{name}.{pname}" if name else pname, module))
    for name in names:
        inside = {id(m) for m in modules[name].modules()}
        for pname, param in modules[name].named_parameters(remove_duplicate=False):
            outside = [held for held, owner in holders[id(param)] if id(owner) not in inside]
            if outside:
                raise ParallelConfigError(
                    f"{name}.{pname} is the same parameter as {', '.join(outside)} (tied "
                    f"weights), outside the planned module {name}: {why}"
                )


def _divisible(size: int, tp: int, what: str, fix: str) -> None:
    if size % tp:
        raise ParallelConfigError(f"{what} {size} is not divisible by tp {tp}; {fix} or change tp")
