"""Run lineage: which checkpoints belong to the run being continued.

A run that resumes from its newest checkpoint continues that checkpoint's *lineage*. A run
that resumes from an older one (a damaged newest checkpoint, an explicit
:meth:`~hlat_ckpt.Checkpointer.load` of an earlier step) starts a new lineage whose parent
is the checkpoint it resumed from. Every manifest records its lineage id, the lineage's
parent and a commit sequence number ``seq`` (one more than the highest under the root when
it was committed), so the order of commits is known without trusting step numbers or file
times. From that:

- the *head* is the newest commit (highest ``(seq, step)``), and the *current lineage* the
  head's;
- the *ancestry* of a checkpoint is its lineage's commits up to it, then its lineage's
  parent and that parent's ancestry: what a run resumed from it has actually trained through.
  Every manifest records the whole chain of parents (the parent, its lineage's parent, and so
  on), so the ancestry reaches the oldest lineage even after retention has deleted every
  commit of a lineage between (manifests of hlat-ckpt before 0.10 record the parent only;
  the chain then goes on through the parent lineage's own commits while they exist);
- every other commit is *abandoned*: resume never picks it, and retention deletes it once
  the current lineage has committed a step at least as new (until then it is left, so that
  nothing is lost before the new lineage has got as far).

Manifests written before lineage was recorded read as lineage ``""`` with ``seq`` 0, so
they order by step among themselves and before every newer commit.

Everything here is pure: the checkpointer lists and reads, this module decides.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .retention import steps_to_delete

LEGACY_LINEAGE = ""
"""The lineage of manifests that record none (hlat-ckpt before 0.5)."""


@dataclass(frozen=True)
class Parent:
    """The checkpoint a lineage resumed from: its lineage, step and commit number."""

    lineage: str
    step: int
    seq: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.lineage, "step": self.step, "seq": self.seq}


@dataclass(frozen=True)
class Commit:
    """One committed checkpoint as lineage sees it."""

    step: int
    dirname: str
    lineage: str = LEGACY_LINEAGE
    seq: int = 0
    parent: Parent | None = None
    ancestors: tuple[Parent, ...] = ()
    """The parents beyond ``parent``, as recorded: its lineage's parent, then that one's,
    and so on (empty where the manifest records the parent only)."""

    @property
    def order(self) -> tuple[int, int]:
        """Commit order: by sequence number, then (for legacy manifests) by step."""
        return (self.seq, self.step)

    def as_parent(self) -> Parent:
        return Parent(self.lineage, self.step, self.seq)


def new_lineage_id() -> str:
    """A fresh lineage id (8 hex digits; safe in a directory name)."""
    return secrets.token_hex(4)


def lineage_record(
    lineage: str, seq: int, parent: Parent | None, ancestors: Iterable[Parent] = ()
) -> dict[str, Any]:
    """The manifest's ``lineage`` field: ``ancestors`` are the parents beyond ``parent``
    (:func:`parents`)."""
    return {
        "id": lineage,
        "seq": seq,
        "parent": None if parent is None else parent.to_json(),
        "ancestors": [a.to_json() for a in ancestors],
    }


def _parent_from(record: Any) -> Parent:
    if not (
        isinstance(record, dict)
        and isinstance(record.get("id"), str)
        and isinstance(record.get("step"), int)
        and isinstance(record.get("seq"), int)
    ):
        raise ValueError(f"lineage parent mistyped: {record!r}")
    return Parent(record["id"], record["step"], record["seq"])


def commit_from_record(step: int, dirname: str, record: dict[str, Any]) -> Commit:
    """A :class:`Commit` from a manifest's ``lineage`` field (``{}`` for a legacy manifest).
    Raises ``ValueError`` for a malformed field."""
    if not record:
        return Commit(step, dirname)
    lineage, seq, parent = record.get("id"), record.get("seq"), record.get("parent")
    ancestors = record.get("ancestors", [])
    if (
        not isinstance(lineage, str)
        or not isinstance(seq, int)
        or seq < 0
        or not isinstance(ancestors, list)
    ):
        raise ValueError(f"lineage field mistyped: {record!r}")
    found = None if parent is None else _parent_from(parent)
    beyond = tuple(_parent_from(a) for a in ancestors) if found is not None else ()
    return Commit(step, dirname, lineage, seq, found, beyond)


def head(commits: Iterable[Commit]) -> Commit | None:
    """The newest commit, or ``None`` when there is none."""
    return max(commits, key=lambda c: c.order, default=None)


def next_seq(commits: Iterable[Commit]) -> int:
    """The sequence number of the next commit."""
    return max((c.seq for c in commits), default=0) + 1


def ancestry(commits: Iterable[Commit], tip: Commit) -> list[Commit]:
    """The commits a run resumed from ``tip`` has trained through, ``tip`` first, then
    older ones (newest first): ``tip``'s lineage up to it, then its parent's up to the
    parent checkpoint, and so on."""
    return _walk(commits, tip)[0]


def parents(commits: Iterable[Commit], tip: Commit) -> tuple[Parent, ...]:
    """The chain of parents of ``tip``'s lineage: its parent, that lineage's parent, and so
    on to a lineage without one (what a manifest records: the parent, then ``ancestors``)."""
    return _walk(commits, tip)[1]


def _walk(commits: Iterable[Commit], tip: Commit) -> tuple[list[Commit], tuple[Parent, ...]]:
    """(:func:`ancestry`, :func:`parents`) of ``tip``: the chain of parents is the
    fullest one that ``tip`` or a commit of its lineage records, continued, where it stops
    at the parent (manifests of hlat-ckpt before 0.10 record the parent only), by the
    chains that the parent lineages' own commits record."""
    by_lineage: dict[str, list[Commit]] = {}
    for c in commits:
        by_lineage.setdefault(c.lineage, []).append(c)

    def recorded(lineage: str, *more: Commit) -> tuple[Parent | None, list[Parent]]:
        # a lineage's commits share one chain; those of hlat-ckpt before 0.10 record its
        # first link only, so the fullest record counts
        own = [*by_lineage.get(lineage, []), *more]
        fullest = max(own, key=lambda c: (c.parent is not None, len(c.ancestors)), default=None)
        return (None, []) if fullest is None else (fullest.parent, list(fullest.ancestors))

    chain: list[Commit] = []
    links: list[Parent] = []
    lineage, upto = tip.lineage, tip.order
    parent, beyond = recorded(tip.lineage, tip)
    seen: set[str] = set()
    while lineage not in seen:
        seen.add(lineage)
        members = sorted(
            (c for c in by_lineage.get(lineage, []) if c.order <= upto),
            key=lambda c: c.order,
            reverse=True,
        )
        chain += members
        if parent is None:
            break
        links.append(parent)
        lineage, upto = parent.lineage, (parent.seq, parent.step)
        if beyond:
            parent = beyond.pop(0)
        else:  # the parent lineage's own parent, as its commits record it
            parent, beyond = recorded(lineage)
    return chain, tuple(links)


def current_ancestry(commits: Iterable[Commit]) -> list[Commit]:
    """The ancestry of the head (empty when there is no commit): what resume may pick,
    newest first."""
    commits = list(commits)
    tip = head(commits)
    return [] if tip is None else ancestry(commits, tip)


def abandoned(commits: Iterable[Commit], tip: Commit) -> list[Commit]:
    """The commits outside ``tip``'s ancestry, oldest first."""
    commits = list(commits)
    kept = {c.dirname for c in ancestry(commits, tip)}
    return sorted((c for c in commits if c.dirname not in kept), key=lambda c: c.order)


def to_delete(
    commits: Iterable[Commit],
    committed: Commit,
    keep_last: int | None,
    keep_every: int | None = None,
) -> list[Commit]:
    """The commits retention deletes right after ``committed`` was committed.

    - In ``committed``'s ancestry: keep the ``keep_last`` newest, every step that is a
      multiple of ``keep_every``, and ``committed`` itself (:func:`steps_to_delete`).
    - Abandoned: delete those whose step is at most ``committed``'s; newer ones wait until
      the current lineage gets past them.
    - ``keep_last=None`` keeps everything (abandoned checkpoints too): resume ignores them.
    """
    if keep_last is None:
        return []
    commits = list(commits)
    chain = ancestry(commits, committed)
    # steps_to_delete works on numbers: the chain's positions stand in for its steps, so
    # keep_last counts commits, and keep_every is applied to the real steps below
    position = {c.dirname: i for i, c in enumerate(reversed(chain))}
    doomed_positions = set(
        steps_to_delete(position.values(), position[committed.dirname], keep_last)
    )
    doomed = [
        c
        for c in chain
        if position[c.dirname] in doomed_positions
        and not (keep_every is not None and c.step % keep_every == 0)
    ]
    doomed += [c for c in abandoned(commits, committed) if c.step <= committed.step]
    return sorted(doomed, key=lambda c: c.order)
