"""Weighted mixtures of sources, blended row by row.

Each source is packed on its own (one :class:`~hlat_data.PackedLoader` per source, with a
seed of its own derived from the loader's seed and the source's name), and the packed rows
are interleaved by a deterministic schedule: row ``n`` of the mixture comes from the source
``d`` that is furthest behind its share, ``argmax_d(w_d * (n + 1) - rows_d)`` (ties go to
the first listed), the rule of Megatron-Core's blended datasets. Every row holds ``seq_len``
tokens, so the realised *token* shares follow the weights to within about one row per
source at every point of the stream (a little over one for some skewed mixtures of three
or more sources), whatever the documents' lengths; no source's tokenization waits on
another's.

A source may be capped with ``epochs`` (passes over it) or ``max_tokens`` (tokens drawn
from it across all data-parallel ranks); without either it repeats, each epoch in a new
order. When a source ends, the schedule starts a new segment with the remaining sources'
weights renormalised. Caps are met per rank, at the point where that rank's share of the
source ends, so ranks keep yielding the same number of batches as long as any source is left.
On a resume at another ``dp_size`` the tokens the old ranks drew from each source are shared
out among the new ones, so a ``max_tokens`` cap still holds over all ranks.

The state (:meth:`MixedLoader.state_dict`) is the mixture's spec, the schedule's counters, the
tokens drawn from each source and each source's own loader state, keyed by the source's name;
it resumes at another ``seq_len`` too, the caps counted in tokens. Resuming with another spec (a
source added or removed, a weight or cap changed) is refused unless asked for with
``on_change="continue"``: then the sources kept by name continue where they stood, new
sources start at their beginning, removed ones are dropped, and the blend restarts from the
new weights.
"""

from __future__ import annotations

import hashlib
import math
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hlat_data.errors import DataError
from hlat_data.loader import MIXTURE_STATE_FORMAT, PackedLoader, is_count, merge_states
from hlat_data.order import check_layout, check_seed
from hlat_data.packer import Batch
from hlat_data.tokenizer import Tokenizer

MIXTURE_FORMAT = MIXTURE_STATE_FORMAT
_CHANGES = ("error", "continue")


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture.

    Attributes:
        name: unique within the mixture; it keys the source's state and its metrics.
        source: an :class:`~hlat_data.ArrowSource` (or any source a PackedLoader reads).
        weight: relative share of the mixture's tokens (normalised over the sources).
        epochs: stop drawing from it after this many passes (None: repeat it).
        max_tokens: stop after this many of its tokens across all data-parallel ranks
            (None: no cap).
    """

    name: str
    source: Any
    weight: float
    epochs: int | None = None
    max_tokens: int | None = None

    def spec(self) -> dict[str, Any]:
        """What the blend depends on (the source's own files are in its loader's state)."""
        return {
            "name": self.name,
            "weight": float(self.weight),
            "epochs": self.epochs,
            "max_tokens": self.max_tokens,
        }


def source_seed(seed: int, name: str) -> int:
    """The seed of one source's document order: stable, and distinct per name."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def check_mixture(sources: Sequence[MixtureSource]) -> None:
    """Raise :class:`DataError` naming the first problem of a mixture's spec."""
    if not sources:
        raise DataError("a mixture needs at least one source")
    seen: set[str] = set()
    for i, s in enumerate(sources):
        where = f"mixture source {i} ({s.name!r})"
        if not s.name or not isinstance(s.name, str):
            raise DataError(f"mixture source {i} needs a name (it keys its state and metrics)")
        if s.name in seen:
            raise DataError(f"{where}: the name is used twice; names must be unique")
        seen.add(s.name)
        if not (isinstance(s.weight, int | float) and math.isfinite(s.weight) and s.weight > 0):
            raise DataError(f"{where}: weight must be a positive number, got {s.weight!r}")
        for field, value in (("epochs", s.epochs), ("max_tokens", s.max_tokens)):
            if value is not None and not is_count(value):
                raise DataError(
                    f"{where}: {field} must be an integer of at least 1 or None, got {value!r}"
                )


class MixedLoader:
    """Packed micro-batches of one data-parallel rank, drawn from weighted sources.

    Takes the arguments of :class:`~hlat_data.PackedLoader`, with ``sources`` (a list of
    :class:`MixtureSource`) in place of one source. A micro-batch's rows may come from
    different sources; each row comes whole from one. ``num_workers > 0`` gives each source
    ``max(1, round(num_workers * share))`` tokenizer processes. At the end of the last source
    the partial micro-batch is dropped.

    Args:
        on_change: what :meth:`load_state_dict` does with a state saved under another spec:
            ``"error"`` (the default) refuses and names what differs; ``"continue"``
            carries on (see the module's doc).
    """

    def __init__(
        self,
        sources: Sequence[MixtureSource],
        tokenizer: Tokenizer,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        add_bos: bool = False,
        add_eos: bool = True,
        *,
        block_size: int = 1024,
        shuffle: bool = True,
        num_workers: int = 0,
        prefetch: int = 4,
        chunk_docs: int = 64,
        mp_context: str | None = None,
        on_change: str = "error",
    ) -> None:
        check_mixture(sources)
        if on_change not in _CHANGES:
            raise DataError(f"on_change must be one of {', '.join(_CHANGES)}, got {on_change!r}")
        if micro_batch_size < 1:
            raise DataError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        check_seed(seed)
        # Note: block_size and dp_rank are checked first on a corpus of exactly enough
        # documents, so that only a source too small for the layout is named in an error
        check_layout(block_size * dp_size, block_size, dp_rank, dp_size)
        for s in sources:
            try:
                check_layout(len(s.source), block_size, dp_rank, dp_size)
            except DataError as e:
                raise DataError(f"mixture source {s.name!r}: {e}") from None
        total = float(sum(s.weight for s in sources))
        self.sources = list(sources)
        self.shares = [s.weight / total for s in sources]
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.on_change = on_change
        self.loaders = [
            PackedLoader(
                s.source,
                tokenizer,
                seq_len,
                1,
                dp_rank,
                dp_size,
                seed=source_seed(seed, s.name),
                add_bos=add_bos,
                add_eos=add_eos,
                block_size=block_size,
                shuffle=shuffle,
                num_workers=max(1, round(num_workers * share)) if num_workers > 0 else 0,
                prefetch=prefetch,
                chunk_docs=chunk_docs,
                num_epochs=s.epochs,
                drop_last=True,
                mp_context=mp_context,
            )
            for s, share in zip(self.sources, self.shares, strict=True)
        ]
        # tokens per rank a max_tokens cap allows (the cap is over all data-parallel ranks)
        self._max_tokens = [
            -(-s.max_tokens // dp_size) if s.max_tokens is not None else None for s in self.sources
        ]
        n = len(self.sources)
        self._tokens = [0] * n  # tokens drawn from each source since the start of the run
        self._segment = [0] * n  # rows drawn since the schedule's current segment began
        self._done = [False] * n
        self._batches = 0
        self._active: weakref.ref[Iterator[Batch]] | None = None

    # --- the schedule ----------------------------------------------------------------------

    def _pick(self) -> int | None:
        live = [d for d in range(len(self.sources)) if not self._done[d]]
        if not live:
            return None
        total = sum(self.shares[d] for d in live)
        n = sum(self._segment[d] for d in live)
        deficits = [self.shares[d] / total * (n + 1) - self._segment[d] for d in live]
        return live[int(np.argmax(deficits))]

    def _end(self, d: int) -> None:
        self._done[d] = True
        self._segment = [0] * len(self.sources)

    # --- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        self._close_active()
        iterator = self._run()
        self._active = weakref.ref(iterator)
        return iterator

    def _close_active(self) -> None:
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()  # type: ignore[attr-defined]
        self._active = None

    def _run(self) -> Iterator[Batch]:
        streams: list[Iterator[Batch] | None] = [None] * len(self.sources)
        try:
            rows: list[Batch] = []
            while True:
                d = self._pick()
                if d is None:
                    return
                if self._at_cap(d):
                    self._end(d)
                    continue
                stream = streams[d]
                if stream is None:
                    stream = streams[d] = iter(self.loaders[d])
                row = next(stream, None)
                if row is None:
                    self._end(d)
                    continue
                rows.append(row)
                self._tokens[d] += self.seq_len
                self._segment[d] += 1
                if len(rows) == self.micro_batch_size:
                    batch = _stack(rows)
                    rows = []
                    self._batches += 1
                    yield batch
        finally:
            for stream in streams:
                if stream is not None:
                    stream.close()  # type: ignore[attr-defined]

    # --- what it read ----------------------------------------------------------------------

    @property
    def empty_documents(self) -> int:
        """Empty documents met in all sources (skipped)."""
        return sum(loader.empty_documents for loader in self.loaders)

    @property
    def bad_records(self) -> int:
        """Bad records skipped in all sources (``on_bad_record="skip"``)."""
        return sum(getattr(loader, "bad_records", 0) for loader in self.loaders)

    def composition(self) -> dict[str, dict[str, Any]]:
        """Per source: its weight's share, the tokens this rank drew from it (after a resume
        at another ``dp_size``, counting its part of what the old ranks drew), their share of
        this rank's tokens, the epoch it is in, and whether it has ended."""
        total = max(1, sum(self._tokens))
        return {
            s.name: {
                "weight": share,
                "tokens": tokens,
                "share": tokens / total,
                "epoch": loader.epoch,
                "ended": done,
            }
            for s, share, tokens, loader, done in zip(
                self.sources, self.shares, self._tokens, self.loaders, self._done, strict=True
            )
        }

    # --- state -----------------------------------------------------------------------------

    def spec(self) -> list[dict[str, Any]]:
        """The mixture as plain data: names, weights and caps, in order."""
        return [s.spec() for s in self.sources]

    def state_dict(self) -> dict[str, Any]:
        """The spec, the schedule's counters, the tokens drawn from each source and each
        source's loader state (by name)."""
        return {
            "format": MIXTURE_FORMAT,
            "mixture": self.spec(),
            "seed": self.seed,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seq_len": self.seq_len,
            "tokens": list(self._tokens),
            "segment": list(self._segment),
            "done": list(self._done),
            "batches": self._batches,
            "sources": {
                s.name: loader.state_dict()
                for s, loader in zip(self.sources, self.loaders, strict=True)
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off: this rank's own :meth:`state_dict`, or
        :func:`~hlat_data.merge_states` of every rank's. That also resumes at another
        ``dp_size``: each source's documents are dealt as :meth:`PackedLoader.load_state_dict`
        describes; the tokens all old ranks drew from each source are shared out among the
        new ranks, so a ``max_tokens`` cap holds over all ranks; a source ends only where this
        rank has reached its cap or read its last epoch; and the blend goes on where the old
        ranks stood if they stood alike, else it starts a new segment. The tokens drawn are
        kept as tokens, so the caps hold at another ``seq_len`` too.

        Raises :class:`DataError` before changing anything when the state is not a mixture's,
        when the seed differs, when the spec differs and ``on_change`` is ``"error"``, or when
        a source kept by name reads other files or another tokenizer, or for a state of
        hlat-data before 0.7 (rows drawn, not tokens) without the ``seq_len`` it was saved
        with: set ``state["seq_len"]`` to it.
        """
        if state.get("format") != MIXTURE_FORMAT:
            raise DataError(
                f"not a mixture's loader state (format {state.get('format')!r}, expected "
                f"{MIXTURE_FORMAT!r}); a run saved from one source continues on a mixture "
                "only from a fresh start"
            )
        if state["seed"] != self.seed:
            raise DataError(
                f"cannot resume the mixture: seed: state has {state['seed']}, this loader has "
                f"{self.seed}"
            )
        saved = [dict(entry) for entry in state["mixture"]]
        same = saved == self.spec()
        if not same and self.on_change == "error":
            raise DataError(
                "the mixture differs from the one the state was saved with: "
                + "; ".join(_spec_differences(saved, self.spec()))
                + '. Changing a mixture is deliberate: pass on_change="continue" (hlat-train: '
                'data.mixture_change = "continue") to keep the sources by name where they '
                "stand, start new ones at their beginning and blend by the new weights"
            )
        moved = False  # resumed at another dp_size
        if "ranks" in state:
            ranks = state["ranks"]
            moved = state["dp_size"] != self.dp_size
            schedule = ranks[0] if moved else ranks[self.dp_rank]
        else:
            if (state["dp_rank"], state["dp_size"]) != (self.dp_rank, self.dp_size):
                raise DataError(
                    f"cannot resume the mixture: data-parallel layout: state is rank "
                    f"{state['dp_rank']} of {state['dp_size']}, this loader is rank "
                    f"{self.dp_rank} of {self.dp_size}; load each rank's own state, or "
                    "merge_states() of all ranks' states to change dp_size"
                )
            schedule = state
            ranks = [state]
        drawn = [_drawn_tokens(r, state.get("seq_len"), self.seq_len) for r in ranks]
        names = [entry["name"] for entry in saved]
        # every kept source's state is checked before any loader changes
        for s, loader in zip(self.sources, self.loaders, strict=True):
            if s.name in state["sources"]:
                _check_loadable(loader, state["sources"][s.name], s.name)
        self._close_active()
        n = len(self.sources)
        self._tokens, self._segment, self._done = [0] * n, [0] * n, [False] * n
        for d, (s, loader) in enumerate(zip(self.sources, self.loaders, strict=True)):
            if s.name not in state["sources"]:
                continue
            loader.load_state_dict(state["sources"][s.name])
            old = names.index(s.name)
            if moved:
                # this rank's part of the tokens all old ranks drew, in whole rows and the
                # rest to one rank, so that the caps, which are met per rank, hold over all
                total = sum(tokens[old] for tokens in drawn)
                rows, rest = divmod(total, self.seq_len)
                extra = rows % self.dp_size
                share = rows // self.dp_size + int(self.dp_rank < extra)
                self._tokens[d] = share * self.seq_len + (rest if self.dp_rank == extra else 0)
            else:
                self._tokens[d] = drawn[self.dp_rank if "ranks" in state else 0][old]
            if same and not moved:
                self._segment[d] = int(schedule["segment"][old])
                self._done[d] = bool(schedule["done"][old])
        if moved or not same:
            # a source ends where its cap is reached or its last epoch is read, as this
            # rank now stands, not where one old rank stood
            self._done = [self._exhausted(d) for d in range(n)]
        if moved and same:
            # ranks step through the schedule alike until a source ends on one of them;
            # then, or when the sources that ended differ, a new segment starts
            segments = {tuple(int(v) for v in r["segment"]) for r in ranks}
            ended = {tuple(bool(v) for v in r["done"]) for r in ranks}
            if len(segments) == 1 and ended == {tuple(self._done)}:
                self._segment = [int(v) for v in ranks[0]["segment"]]
        self._batches = max(int(r["batches"]) for r in ranks) if moved else int(schedule["batches"])

    def _at_cap(self, d: int) -> bool:
        """Whether this rank has drawn its share of source ``d``'s ``max_tokens`` cap."""
        cap = self._max_tokens[d]
        return cap is not None and self._tokens[d] >= cap

    def _exhausted(self, d: int) -> bool:
        """Whether source ``d`` has nothing left for this rank: its token cap is reached, or
        its loader is past its last epoch."""
        loader = self.loaders[d]
        past_epochs = loader.num_epochs is not None and loader.epoch >= loader.num_epochs
        return self._at_cap(d) or past_epochs

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{s.name}={w:.3g}" for s, w in zip(self.sources, self.shares, strict=True)
        )
        return (
            f"MixedLoader({parts}, seq_len={self.seq_len}, "
            f"micro_batch_size={self.micro_batch_size}, rank {self.dp_rank}/{self.dp_size})"
        )


def _drawn_tokens(entry: dict[str, Any], seq_len: int | None, current: int) -> list[int]:
    """The tokens one rank's state entry drew from each source; a state of hlat-data before
    0.7 counts rows, converted with the ``seq_len`` it was saved with, which such a state
    does not hold unless added: without it, this loader's ``current`` one (what a resume
    with unchanged settings saved), with a warning."""
    if "tokens" in entry:
        return [int(v) for v in entry["tokens"]]
    if seq_len is None:
        warnings.warn(
            "the mixture state counts the rows drawn from each source (saved by hlat-data "
            f"before 0.7), not tokens; taking them as rows of this loader's seq_len {current}. "
            'If it was saved with another seq_len, set state["seq_len"] to it',
            stacklevel=3,
        )
        seq_len = current
    return [int(v) * int(seq_len) for v in entry["rows"]]


def _check_loadable(loader: PackedLoader, state: dict[str, Any], name: str) -> None:
    try:
        # Note: loads into a twin that shares nothing mutable, so a refusal leaves this
        # loader untouched
        twin = PackedLoader.__new__(PackedLoader)
        twin.__dict__.update(loader.__dict__)
        twin._active = None
        twin.load_state_dict(state)
    except DataError as e:
        raise DataError(f"mixture source {name!r}: {e}") from None


def _spec_differences(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[str]:
    old = {e["name"]: e for e in saved}
    new = {e["name"]: e for e in current}
    out = [f"source {name!r} added" for name in new if name not in old]
    out += [f"source {name!r} removed" for name in old if name not in new]
    for name in new:
        if name in old:
            for key in ("weight", "epochs", "max_tokens"):
                if old[name].get(key) != new[name].get(key):
                    out.append(
                        f"source {name!r} {key}: state has {old[name].get(key)}, "
                        f"this loader has {new[name].get(key)}"
                    )
    if not out:
        out.append("the sources are listed in another order")
    return out


def merge_mixture_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One mixture state for all data-parallel ranks (what :func:`merge_states` returns for
    :class:`MixedLoader` states)."""
    first = states[0]
    size = first["dp_size"]
    by_rank = {s["dp_rank"]: s for s in states}
    if sorted(by_rank) != list(range(size)):
        raise DataError(f"merge_states needs ranks 0..{size - 1}, got {sorted(by_rank)}")
    for s in states:
        if (s.get("format"), s["mixture"], s["seed"]) != (
            MIXTURE_FORMAT,
            first["mixture"],
            first["seed"],
        ):
            raise DataError(f"rank {s['dp_rank']}'s state reads another mixture than rank 0's")
    seq_lens = {s.get("seq_len") for s in states}
    if len(seq_lens) > 1:
        raise DataError(
            f"the ranks' states were saved with different seq_len: {sorted(seq_lens, key=str)}"
        )
    keys = ("tokens", "rows", "segment", "done", "batches")  # rows: before 0.7
    return {
        "format": MIXTURE_FORMAT,
        "mixture": first["mixture"],
        "seed": first["seed"],
        "dp_size": size,
        "seq_len": first.get("seq_len"),
        "ranks": [{k: by_rank[r][k] for k in keys if k in by_rank[r]} for r in range(size)],
        "sources": {
            name: merge_states([by_rank[r]["sources"][name] for r in range(size)])
            for name in first["sources"]
        },
    }


def _stack(rows: list[Batch]) -> Batch:
    width = max(r.doc_lens.shape[1] for r in rows)
    doc_lens = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        doc_lens[i, : r.doc_lens.shape[1]] = r.doc_lens[0]
    return Batch(
        np.concatenate([r.input_ids for r in rows]),
        np.concatenate([r.labels for r in rows]),
        np.concatenate([r.position_ids for r in rows]),
        doc_lens,
    )


def mixture_stats(
    sources: Sequence[MixtureSource],
    tokenizer: Tokenizer,
    *,
    max_documents: int | None = None,
    planned_tokens: int | None = None,
) -> dict[str, Any]:
    """A mixture's composition, per source (``"sources"``): documents, tokens (as the loader
    reads them, an EOS after each document; counted, or estimated from the first
    ``max_documents``), weight share, and with ``planned_tokens`` (the run's
    training tokens) the tokens it will give and the epochs that takes, capped by its
    ``epochs`` and ``max_tokens``. What ``hlat-data stats --mixture`` prints."""
    from hlat_data.convert import corpus_stats

    check_mixture(sources)
    if planned_tokens is not None and planned_tokens < 0:
        raise DataError(f"planned_tokens must be 0 or more, got {planned_tokens}")
    total = float(sum(s.weight for s in sources))
    out: dict[str, dict[str, Any]] = {}
    caps: dict[str, float] = {}
    left = 0.0
    for s in sources:
        stats = corpus_stats(s.source, tokenizer, max_documents=max_documents)
        read = max(1, stats["documents_read"])
        # the loader's tokens, EOS included: what max_tokens and the plan count
        tokens = stats["tokens_with_eos"] * stats["documents"] / read
        out[s.name] = {
            "documents": stats["documents"],
            "tokens": round(tokens),
            "estimated": stats["documents_read"] < stats["documents"],
            "weight": s.weight / total,
            "epochs_cap": s.epochs,
            "max_tokens": s.max_tokens,
        }
        limits = [math.inf]
        if s.epochs is not None:
            limits.append(s.epochs * tokens)
        if s.max_tokens is not None:
            limits.append(float(s.max_tokens))
        caps[s.name] = min(limits)
    if planned_tokens is not None:
        # the loader's rule: a source that reaches its cap ends, and the others share what
        # is left by their weights
        given = dict.fromkeys(caps, 0.0)
        left, live = float(planned_tokens), list(sources)
        while left > 0 and live:
            weights = sum(s.weight for s in live)
            ended = [s for s in live if caps[s.name] - given[s.name] <= left * s.weight / weights]
            if not ended:
                for s in live:
                    given[s.name] += left * s.weight / weights
                left = 0.0
                break
            # the first to end is the one whose cap comes soonest at the current rates
            first = min(ended, key=lambda s: (caps[s.name] - given[s.name]) / s.weight)
            step = (caps[first.name] - given[first.name]) * weights / first.weight
            for s in live:
                given[s.name] += step * s.weight / weights
            given[first.name] = caps[first.name]
            left -= step
            live.remove(first)
        for name, entry in out.items():
            entry["planned_tokens"] = round(given[name])
            entry["epochs"] = round(given[name] / max(entry["tokens"], 1), 3)
            entry["ends_early"] = given[name] >= caps[name]
    return {
        "sources": out,
        "planned_tokens": planned_tokens,
        # tokens of the plan no source can give once every source has ended
        "unmet_tokens": round(left) if planned_tokens is not None else 0,
    }


def read_mixture(
    path: str, text_field: str = "text", *, on_bad_record: str = "error"
) -> list[MixtureSource]:
    """The sources of a mixture file: ``[[sources]]`` tables, or an hlat-train config's
    ``[[data.sources]]``, each with ``name``, ``paths``, ``weight`` and optionally
    ``epochs``, ``max_tokens`` (``valid_paths`` is ignored here). Paths open through
    :func:`~hlat_data.open_source`."""
    import sys

    from hlat_data.jsonl import open_source

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise DataError(f"mixture file {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise DataError(f"mixture file {path} is not valid TOML: {e}") from None
    tables = data.get("sources") or data.get("data", {}).get("sources")
    if not tables:
        raise DataError(f"{path} has no [[sources]] (or [[data.sources]]) tables")
    known = {"name", "paths", "weight", "epochs", "max_tokens", "valid_paths"}
    sources = []
    for i, table in enumerate(tables):
        unknown = set(table) - known
        if unknown:
            raise DataError(
                f"{path}: source {i} has unknown keys {sorted(unknown)} (keys: {sorted(known)})"
            )
        if not table.get("paths"):
            raise DataError(f"{path}: source {i} ({table.get('name', '?')}) has no paths")
        sources.append(
            MixtureSource(
                str(table.get("name", "")),
                open_source(table["paths"], text_field, on_bad_record=on_bad_record),
                table.get("weight", 1.0),
                table.get("epochs"),
                table.get("max_tokens"),
            )
        )
    check_mixture(sources)
    return sources
