"""Which checkpoints to delete after a commit: keep the last K, every M-th step, and always the
one just committed."""

from __future__ import annotations

from collections.abc import Iterable


def steps_to_delete(
    complete: Iterable[int],
    committed: int,
    keep_last: int | None,
    keep_every: int | None = None,
) -> list[int]:
    """The complete checkpoints to delete once step ``committed`` has been committed.

    Keeps the ``keep_last`` newest complete checkpoints (``None``: keep all), every step that is
    a multiple of ``keep_every`` (kept permanently), and ``committed`` itself, even if a newer
    step from an earlier run exists.

    Note: only called after ``committed`` is durable, so an old checkpoint is never deleted
    before its successor exists, and the newest complete one is always among the kept.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    steps = sorted(set(complete) | {committed})
    if keep_last is None:
        return []
    keep = set(steps[-keep_last:]) | {committed}
    if keep_every is not None:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def incomplete_to_delete(incomplete: Iterable[int], committed: int) -> list[int]:
    """Leftovers of interrupted saves (no valid manifest) older than the committed step.

    Note: newer leftovers are kept: they can only come from another writer, and deleting its
    work in progress would be worse than leaving a few stale files.
    """
    return sorted(s for s in set(incomplete) if s < committed)
