"""The config's keys as help text: every field of every section with its type, default and
docstring, read once from the dataclasses' source (the field docstrings are the docs)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import typing
from typing import Any

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :func:`x` -> x
_LITERAL = re.compile(r"``([^`]+)``")  # ``x`` -> x


def plain(text: str) -> str:
    """reST inline markup as plain text: ``x`` and :func:`x` become x."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass, from the string literal after each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _type_name(hint: Any) -> str:
    text = str(hint) if typing.get_origin(hint) else getattr(hint, "__name__", str(hint))
    return text.replace("typing.", "").replace("NoneType", "None")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def keys_help(config_cls: type, width: int = 100) -> str:
    """Every key of ``config_cls`` (a dataclass of section dataclasses), grouped by section:
    ``--section.key`` with its type and default, then the docstring, wrapped to ``width``."""
    lines = ["config keys (override any with --section.key=value; a bare --section.flag sets a",
             "bool to true, --no-section.flag to false):"]  # fmt: skip
    hints = typing.get_type_hints(config_cls)
    for section in dataclasses.fields(config_cls):
        cls = hints[section.name]
        docs = field_docs(cls)
        title = plain((cls.__doc__ or "").strip().split("\n\n")[0])
        lines.append("")
        lines.extend(
            textwrap.wrap(
                f"[{section.name}] " + " ".join(title.split()),
                width,
                subsequent_indent="    ",
                break_on_hyphens=False,
            )
        )
        section_hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = _default(f)
            shown = "(preset)" if default is None else repr(default)
            lines.append(
                f"  --{section.name}.{f.name}  {_type_name(section_hints[f.name])}, default {shown}"
            )
            doc = plain(docs.get(f.name, ""))
            if doc:
                lines.extend(
                    textwrap.wrap(
                        doc,
                        width,
                        initial_indent=" " * 6,
                        subsequent_indent=" " * 6,
                        break_on_hyphens=False,
                    )
                )
    return "\n".join(lines)


def bool_keys(config_cls: type) -> dict[str, bool]:
    """``{"section.key": True}`` for every boolean key (``bool`` or ``bool | None``)."""
    out: dict[str, bool] = {}
    hints = typing.get_type_hints(config_cls)
    for section in dataclasses.fields(config_cls):
        section_hints = typing.get_type_hints(hints[section.name])
        for name, hint in section_hints.items():
            args = set(typing.get_args(hint)) - {type(None)}
            if hint is bool or args == {bool}:
                out[f"{section.name}.{name}"] = True
    return out
