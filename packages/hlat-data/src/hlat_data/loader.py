"""`PackedLoader`: ordered documents -> tokenized in worker processes -> packed batches."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from hlat_data.errors import DataError
from hlat_data.order import RankShare, ResumedShare, check_layout, check_seed, num_blocks
from hlat_data.packer import Batch, Chunk, Packer
from hlat_data.source import Source
from hlat_data.tokenizer import Tokenizer, usable_cores

STATE_FORMAT = "hlat-data/1"
MIXTURE_STATE_FORMAT = "hlat-data.mixture/1"  # hlat_data.mixture.MixedLoader's


def is_count(value: Any) -> bool:
    """Whether ``value`` is an integer of 1 or more (a bool is not): an epoch or token count."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class PackedLoader:
    """Packed, exactly resumable micro-batches of one data-parallel rank.

    Iterating yields :class:`~hlat_data.Batch` es of ``micro_batch_size`` rows of
    ``seq_len`` tokens. Documents come in a seeded order that changes every epoch
    (:mod:`hlat_data.order`); this rank reads its disjoint share, tokenizes it (with
    ``num_workers`` processes when > 0, keeping ``prefetch`` chunks per worker in flight),
    appends EOS (and BOS when asked) to each document and packs the stream into rows
    (:mod:`hlat_data.packer`). The stream runs on across epochs, so leftovers carry over.

    Args:
        source: the corpus.
        tokenizer: encodes the documents; its ``eos_id``/``bos_id`` are the separators.
        seq_len: tokens per row.
        micro_batch_size: rows per batch.
        dp_rank, dp_size: this rank and the number of data-parallel ranks.
        seed: seeds the order of every epoch.
        add_bos, add_eos: separators around each document (HLAT: EOS only).
        block_size: documents per shuffle block (see :mod:`hlat_data.order`).
        shuffle: False reads blocks and documents in corpus order.
        num_workers: tokenizer processes; 0 tokenizes in this process with threads.
        prefetch: chunks in flight per worker; bounds memory.
        chunk_docs: documents per unit of work sent to a worker.
        num_epochs: stop after this many epochs (None: run forever). Ranks' shares hold
            different numbers of tokens, so their streams then end after different numbers
            of batches: a data-parallel loop must stop all ranks together (or count steps).
        drop_last: at the end of the last epoch, drop the partial batch (True) or yield it
            padded with ``-100`` labels past ``doc_lens.sum(-1)`` (False; a single token
            left, with no next token to predict, makes no batch).
        mp_context: multiprocessing start method for the workers; by default
            ``"forkserver"`` where the platform has it (workers are forked from a server
            process that has imported this package once), else ``"spawn"``.

    Note:
        The state is a cursor into the document stream, not the leftover tokens: on
        resume, the document under the cursor is tokenized again and the tokens already
        emitted are skipped. So the state is a handful of integers, and it does not depend
        on ``num_workers``, ``chunk_docs``, ``micro_batch_size`` or even ``seq_len``.
    """

    def __init__(
        self,
        source: Source,
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
        num_epochs: int | None = None,
        drop_last: bool = True,
        mp_context: str | None = None,
    ) -> None:
        for name, value in (
            ("seq_len", seq_len),
            ("micro_batch_size", micro_batch_size),
            ("prefetch", prefetch),
            ("chunk_docs", chunk_docs),
        ):
            if value < 1:
                raise DataError(f"{name} must be at least 1, got {value}")
        if num_workers < 0:
            raise DataError(f"num_workers must be 0 or more, got {num_workers}")
        methods = multiprocessing.get_all_start_methods()
        if mp_context is None:
            mp_context = "forkserver" if "forkserver" in methods else "spawn"
        elif mp_context not in methods:
            raise DataError(
                f"mp_context {mp_context!r} is not a start method of this platform "
                f"(it has {', '.join(methods)})"
            )
        if num_epochs is not None and not is_count(num_epochs):
            raise DataError(
                f"num_epochs must be an integer of at least 1 or None, got {num_epochs!r}"
            )
        if add_eos and tokenizer.eos_id < 0:
            how = (
                "train it with an EOS id"
                if tokenizer.kind == "sentencepiece"
                else "pass eos_token= to Tokenizer.from_file"
            )
            raise DataError(f"add_eos=True but tokenizer {tokenizer.name} has no EOS token; {how}")
        if add_bos and tokenizer.bos_id < 0:
            raise DataError(f"add_bos=True but tokenizer {tokenizer.name} has no BOS token")
        check_seed(seed)
        check_layout(len(source), block_size, dp_rank, dp_size)
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.add_bos, self.add_eos = add_bos, add_eos
        self.block_size, self.shuffle = block_size, shuffle
        self.num_workers, self.prefetch, self.chunk_docs = num_workers, prefetch, chunk_docs
        self.num_epochs, self.drop_last, self.mp_context = num_epochs, drop_last, mp_context
        self._cursor = (0, 0, 0)  # epoch, share position, token offset of the next input
        self._resumed: dict[str, Any] | None = None  # old layout, after a dp_size change
        self._batches = 0
        self._active: weakref.ref[Iterator[Batch]] | None = None
        self.empty_documents = 0
        """Empty documents met (skipped; they add no tokens and no separator)."""
        self.bad_records = 0
        """Bad records met and read as empty documents (``on_bad_record="skip"``); they
        count in ``empty_documents`` too."""

    @property
    def epoch(self) -> int:
        """The epoch the next token comes from (0-based)."""
        return self._cursor[0]

    # --- the order -------------------------------------------------------------------------

    def share(self, epoch: int) -> RankShare | ResumedShare:
        """The documents this rank reads in ``epoch``, in order."""
        if self._resumed is not None and self._resumed["epoch"] == epoch:
            return ResumedShare(
                len(self.source),
                self.block_size,
                self.seed,
                epoch,
                self.dp_rank,
                self.dp_size,
                [tuple(c) for c in self._resumed["cursors"]],
                self.shuffle,
            )
        return RankShare(
            len(self.source),
            self.block_size,
            self.seed,
            epoch,
            self.dp_rank,
            self.dp_size,
            self.shuffle,
        )

    def _tasks(self) -> Iterator[tuple[int, int, np.ndarray, int]]:
        epoch, position, skip = self._cursor
        size = 1  # Note: chunks grow 1, 2, 4, ... to chunk_docs, so the first batch comes fast
        while self.num_epochs is None or epoch < self.num_epochs:
            share = self.share(epoch)
            while position < len(share):
                yield epoch, position, share.documents(position, position + size), skip
                position += size
                size, skip = min(2 * size, self.chunk_docs), 0
            epoch, position = epoch + 1, 0

    def _normalize(self, cursor: tuple[int, int, int]) -> tuple[int, int, int]:
        epoch, position, offset = cursor
        if offset == 0 and position >= len(self.share(epoch)):
            return epoch + 1, 0, 0
        return cursor

    # --- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        self._close_active()
        iterator = self._run()
        # Note: held weakly, so dropping the iterator (end of a for loop, an islice going
        # away) closes it and stops its workers at once instead of at the next GC cycle
        self._active = weakref.ref(iterator)
        return iterator

    def _close_active(self) -> None:
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()  # type: ignore[attr-defined]
        self._active = None

    def _run(self) -> Iterator[Batch]:
        packer = Packer(self.seq_len, self.micro_batch_size, pad_id=max(self.tokenizer.eos_id, 0))
        chunks = self._chunks()
        watch = _NoTokens(self)
        try:
            for chunk in chunks:
                self.empty_documents += int(np.count_nonzero(chunk.lens == 0))
                self.bad_records += chunk.bad
                watch.see(chunk)
                packer.push(chunk)
                while packer.ready():
                    batch = packer.pop()
                    self._advance(packer)
                    yield batch
            if not self.drop_last:
                batch_or_none = packer.pop_partial()
                if batch_or_none is not None:
                    self._advance(packer)
                    yield batch_or_none
        finally:
            chunks.close()  # type: ignore[attr-defined]

    def _advance(self, packer: Packer) -> None:
        cursor = packer.cursor()
        if cursor is not None:
            self._cursor = self._normalize(cursor)
        self._batches += 1

    def _chunks(self) -> Iterator[Chunk]:
        encode = _Encoder(self.source, self.tokenizer, self.add_bos, self.add_eos)
        if self.num_workers == 0:
            for task in self._tasks():
                yield encode(task)
            return
        context: Any = multiprocessing.get_context(self.mp_context)
        if self.mp_context == "forkserver":
            _preload_in_forkserver(context)
        inbox: Any = context.Queue()
        results: Any = context.Queue()
        stop = context.Event()
        worker_encode = _Encoder(
            self.source, self.tokenizer.with_threads(1), self.add_bos, self.add_eos
        )
        # Note: the encoder (tokenizer model, source index) goes through a queue, not the
        # process arguments: spawn writes arguments synchronously into a pipe the child
        # reads only once booted, which blocked start() for the whole interpreter start-up
        setup: Any = context.Queue()
        workers = [
            context.Process(
                target=_work,
                args=(setup, inbox, results, stop),
                daemon=True,
                name="hlat-data-tokenizer",
            )
            for _ in range(self.num_workers)
        ]
        starter = _Starter(workers, setup, worker_encode)
        # Note: once the workers run, this process helps only if they leave a core free;
        # on a machine they fill, a third encoder would compete for the cores and meet
        # every word anew in a word cache of its own
        helps = self.num_workers < usable_cores()
        interrupted = False
        try:
            tasks = enumerate(self._tasks())
            in_flight = 0
            for number, task in itertools.islice(tasks, self.num_workers * self.prefetch):
                inbox.put((number, task))
                in_flight += 1
            done: dict[int, Chunk] = {}
            wanted = 0
            while in_flight:
                while wanted not in done:
                    number, chunk = _next_result(results, inbox, starter, encode, helps)
                    done[number] = chunk
                yield done.pop(wanted)
                wanted += 1
                in_flight -= 1
                for number, task in itertools.islice(tasks, 1):
                    inbox.put((number, task))
                    in_flight += 1
        except BaseException as e:
            # Note: a KeyboardInterrupt (or SystemExit from a signal handler) can come in
            # the middle of reading a result, leaving the rest of that message in the pipe;
            # a closed generator (GeneratorExit) or an error stops between messages.
            interrupted = not isinstance(e, (GeneratorExit, Exception))
            raise
        finally:
            starter.join()
            _shut_down(starter.started(), inbox, results, stop, drain=not interrupted)
            _close_queues(inbox, results, setup)

    # --- state -----------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        """What the stream depends on: corpus, tokenizer, separators and shuffle layout."""
        return {
            "source": self.source.fingerprint(),
            "tokenizer": self.tokenizer.fingerprint(),
            "packing": {
                "add_bos": self.add_bos,
                "add_eos": self.add_eos,
                "block_size": self.block_size,
                "shuffle": self.shuffle,
            },
        }

    def state_dict(self) -> dict[str, Any]:
        """A small, plain-data state: where this rank's stream stands, and what it reads.

        ``epoch``/``position``/``offset`` locate the next input token: the document at
        ``position`` of this rank's share of ``epoch``, ``offset`` tokens in.
        """
        epoch, position, offset = self._cursor
        resumed = self._resumed if self._resumed and self._resumed["epoch"] == epoch else None
        return {
            "format": STATE_FORMAT,
            "resumed_from": resumed,
            "fingerprint": self.fingerprint(),
            "seed": self.seed,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "epoch": epoch,
            "position": position,
            "offset": offset,
            "batches": self._batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` left off.

        ``state`` is this rank's own :meth:`state_dict`, or :func:`merge_states` of all
        ranks' states. With a merged state and a different ``dp_size``, the documents of
        the current epoch that no old rank has read yet are dealt anew to the new ranks
        (:class:`~hlat_data.order.ResumedShare`); later epochs follow the new layout. That
        resume is not token-exact: the rest of each document an old rank had started and
        the tokens it held back for its next row are dropped, and an old rank's progress
        into a later epoch is read again.

        Raises :class:`DataError` naming what differs when the corpus, tokenizer,
        separators, shuffle layout, seed or data-parallel layout do not match.
        """
        if state.get("format") != STATE_FORMAT:
            raise DataError(
                f"not a PackedLoader state (format {state.get('format')!r}, expected {STATE_FORMAT!r})"
            )
        problems = _differences(state["fingerprint"], self.fingerprint())
        if state["seed"] != self.seed:
            problems.append(f"seed: state has {state['seed']}, this loader has {self.seed}")
        merged = "ranks" in state
        if not merged and (state["dp_rank"], state["dp_size"]) != (self.dp_rank, self.dp_size):
            problems.append(
                f"data-parallel layout: state is rank {state['dp_rank']} of {state['dp_size']}, "
                f"this loader is rank {self.dp_rank} of {self.dp_size}; load each rank's own "
                "state, or merge_states() of all ranks' states to change dp_size"
            )
        if problems:
            raise DataError("cannot resume the data loader: " + "; ".join(problems))
        self._close_active()
        if not merged:
            self._resumed = state.get("resumed_from")
            self._cursor = (int(state["epoch"]), int(state["position"]), int(state["offset"]))
            self._batches = int(state["batches"])
            return
        ranks = state["ranks"]
        if state["dp_size"] == self.dp_size:
            own = ranks[self.dp_rank]
            self._resumed = own.get("resumed_from")
            self._cursor = (int(own["epoch"]), int(own["position"]), int(own["offset"]))
            self._batches = int(own["batches"])
            return
        if any(r.get("resumed_from") for r in ranks):
            raise DataError(
                f"dp_size changed again ({state['dp_size']} -> {self.dp_size}) before the epoch "
                "of the previous change ended; resume with the previous dp_size until it ends"
            )
        cursors = [(int(r["epoch"]), int(r["position"]), int(r["offset"])) for r in ranks]
        epoch = min(c[0] for c in cursors)
        self._resumed = {"epoch": epoch, "cursors": [list(c) for c in cursors]}
        self._cursor = self._normalize((epoch, 0, 0))
        self._batches = max(int(r["batches"]) for r in ranks)

    def __repr__(self) -> str:
        return (
            f"PackedLoader({self.source!r}, seq_len={self.seq_len}, "
            f"micro_batch_size={self.micro_batch_size}, rank {self.dp_rank}/{self.dp_size})"
        )


class _NoTokens:
    """Stops a loader whose stream would never give a token again (every document empty, or
    a bad record skipped), which would otherwise read epoch after epoch for ever.

    A whole epoch of this rank's share (read from its start, in the epoch's own layout, not
    the rest of one dealt after a change of ``dp_size``) that gives no token marks its blocks
    as holding none. The error comes once every block of the corpus is marked (after the
    first such epoch with ``dp_size=1``; over a few epochs otherwise, since every epoch deals
    other blocks to the rank), or at once without shuffling, where the rank reads the same
    blocks every epoch. A rank whose share of one epoch is empty while other blocks hold
    tokens reads on.
    """

    def __init__(self, loader: PackedLoader) -> None:
        self.loader = loader
        self.epoch = -1
        self.share: RankShare | ResumedShare | None = None
        self.whole = False  # whether the epoch is read from its start in its own layout
        self.tokens = self.bad = 0  # in the epoch so far
        self.empty: np.ndarray | None = None  # per block: seen to hold no token

    def see(self, chunk: Chunk) -> None:
        if chunk.epoch != self.epoch:
            self.epoch, self.share = chunk.epoch, self.loader.share(chunk.epoch)
            self.whole = chunk.start == 0 and not chunk.skip and isinstance(self.share, RankShare)
            self.tokens = self.bad = 0
        self.tokens += int(chunk.lens.sum())
        self.bad += chunk.bad
        share = self.share
        if not self.whole or self.tokens or not isinstance(share, RankShare):
            return
        if chunk.start + len(chunk.lens) < len(share):
            return
        loader = self.loader
        if self.empty is None:
            self.empty = np.zeros(num_blocks(len(loader.source), loader.block_size), dtype=bool)
        self.empty[share.blocks] = True
        files = loader.source.files
        where = ", ".join(files[:3]) + (
            f" and {len(files) - 3} more files" if len(files) > 3 else ""
        )
        bad = (
            f"; {self.bad} of the {len(share)} documents this rank read in epoch {self.epoch} "
            "were bad records read as empty (on_bad_record='skip')"
            if self.bad
            else ""
        )
        if self.empty.all():
            raise DataError(
                f"the corpus {where} gives no tokens: all of its {len(loader.source)} "
                f"documents are empty{bad}, so the loader would read it for ever; check that "
                "the text column (text_column=, text_field=) holds the documents"
            )
        if not loader.shuffle:
            raise DataError(
                f"rank {loader.dp_rank} of {loader.dp_size} gets no tokens from {where}: all "
                f"{len(share)} documents of its share are empty{bad}, and without shuffling it "
                "reads the same blocks every epoch, so it would read them for ever; shuffle, "
                "lower block_size, or spread the empty documents"
            )


class _Encoder:
    """Reads and tokenizes one task; picklable, so it runs the same in a worker."""

    def __init__(self, source: Source, tokenizer: Tokenizer, add_bos: bool, add_eos: bool):
        self.source, self.tokenizer = source, tokenizer
        self.add_bos, self.add_eos = add_bos, add_eos

    def __call__(self, task: tuple[int, int, np.ndarray, int]) -> Chunk:
        epoch, start, ids, skip = task
        # Note: a source that reads bad records as empty documents says which; the count
        # travels back with the chunk, from whichever process encoded it
        read = getattr(self.source, "documents_with_bad", None)
        documents, bad = read(ids) if read is not None else (self.source.documents(ids), ())
        # a long document comes in pieces; its ids are those of its whole text
        flat, content = self.tokenizer.encode_documents(documents)
        # Note: a document is empty when it encodes to no tokens, which a text of whitespace
        # does under a normalising model: it gets no EOS (or BOS) of its own
        nonempty = np.flatnonzero(content > 0)
        content_end = np.cumsum(content)
        where: list[np.ndarray] = []
        values: list[np.ndarray] = []
        if self.add_bos:
            where.append(content_end[nonempty] - content[nonempty])
            values.append(np.full(len(nonempty), self.tokenizer.bos_id, dtype=np.int32))
        if self.add_eos:
            where.append(content_end[nonempty])
            values.append(np.full(len(nonempty), self.tokenizer.eos_id, dtype=np.int32))
        if where:
            # interleave so that at equal positions the EOS of a document precedes the BOS
            # of the next (np.insert keeps the given order among equal indices)
            at = np.stack(where, axis=1).reshape(-1)
            flat = np.insert(flat, at, np.stack(values, axis=1).reshape(-1))
        lens = content.copy()
        lens[nonempty] += int(self.add_bos) + int(self.add_eos)
        if skip and len(lens) and lens[0] == 0:
            # a state saved inside a document that encodes to no tokens, which versions
            # before 0.8 packed as BOS EOS: it resumes at the next document
            skip = 0
        if skip:
            if not len(lens) or skip >= lens[0]:
                raise DataError(
                    f"the loader state points {skip} tokens into document {int(ids[0]) if len(ids) else '?'} "
                    "which is shorter: the state does not belong to this corpus and tokenizer"
                )
            flat = flat[skip:]
            lens[0] -= skip
        return Chunk(epoch, start, flat, lens, skip, bad=len(bad))


def _preload_in_forkserver(context: Any) -> None:
    """Adds this module to what the fork server imports when it starts, so each worker
    forked from it begins with numpy, pyarrow and SentencePiece already imported.

    Note: the list is process-wide and read when the server starts (once per process);
    the default entry, ``__main__``, is kept for other users of the server, but a server
    that the workers start is not told the main module (:func:`_main_module_kept_out`).
    """
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    current = list(getattr(server, "_preload_modules", None) or ["__main__"])
    if __name__ not in current:
        context.set_forkserver_preload([*current, __name__])


class _Starter(threading.Thread):
    """Starts the worker processes, and sends each its encoder, off the calling thread.

    Note: with forkserver or spawn, ``Process.start()`` waits until the server or the child
    interpreter has booted and imported this package (about 0.3 s); meanwhile the caller
    encodes the first chunks itself instead of waiting for it.
    """

    def __init__(self, workers: list[Any], setup: Any, encoder: _Encoder) -> None:
        super().__init__(daemon=True, name="hlat-data-start-workers")
        self.workers, self.setup, self.encoder = workers, setup, encoder
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            # Note: the workers are not told the main module, so they never run it again:
            # a script needs no main guard, and -c, -m and torchrun work alike
            with _main_module_kept_out():
                for worker in self.workers:
                    worker.start()
                    self.setup.put(self.encoder)
        except BaseException as e:
            self.error = e

    def started(self) -> list[Any]:
        """The workers started so far."""
        return [w for w in self.workers if w.pid is not None]


_MAIN_ENTRIES = ("init_main_from_name", "init_main_from_path")
_keeping_out = threading.local()
_kept_out_lock = threading.Lock()
_kept_out_users = 0
_kept_out_patch: tuple[Any, Any] | None = None  # (our wrapper, what it wraps)


@contextlib.contextmanager
def _main_module_kept_out() -> Iterator[None]:
    """Processes that multiprocessing starts in this thread meanwhile (and the fork server,
    if it starts now) are not told the main module's name or path.

    Note:
        With forkserver and spawn, a new process gets "preparation data" from its parent
        (``multiprocessing.spawn.get_preparation_data``): its ``init_main_from_name``
        (``python -m``) or ``init_main_from_path`` (a script; torchrun runs one per rank)
        makes the child run the parent's main module again, as ``__mp_main__``, before it
        unpickles its target. A script without an ``if __name__ == "__main__":`` guard then
        builds a loader and starts workers again inside each worker (multiprocessing
        refuses, the worker dies, and its semaphores leak), and any script pays its imports
        again in every worker. A worker needs only :func:`_work` and what it is sent, so
        while this thread starts workers those two entries are left out, and the child
        keeps the bare ``__main__`` of the interpreter that runs it, as with
        ``python -c``. The stdlib has no per-process switch for this, hence the wrapper:
        installed while any thread is inside this block (restored after the last), and
        acting only in such threads, so processes that other code starts meanwhile get
        their data unchanged. Consequently, a source or tokenizer class defined in the main
        script cannot be unpickled in a worker (:func:`_work` says so).
    """
    global _kept_out_users, _kept_out_patch
    with _kept_out_lock:
        if _kept_out_users == 0:
            wrapped = multiprocessing.spawn.get_preparation_data

            def preparation_data(name: str) -> dict[str, Any]:
                data: dict[str, Any] = wrapped(name)
                if getattr(_keeping_out, "on", False):
                    for key in _MAIN_ENTRIES:
                        data.pop(key, None)
                return data

            multiprocessing.spawn.get_preparation_data = preparation_data
            _kept_out_patch = (preparation_data, wrapped)
        _kept_out_users += 1
    _keeping_out.on = True
    try:
        yield
    finally:
        _keeping_out.on = False
        with _kept_out_lock:
            _kept_out_users -= 1
            if _kept_out_users == 0 and _kept_out_patch is not None:
                ours, wrapped = _kept_out_patch
                if multiprocessing.spawn.get_preparation_data is ours:  # else: leave theirs
                    multiprocessing.spawn.get_preparation_data = wrapped
                _kept_out_patch = None


def _end_with_the_loader_process() -> None:
    """Makes this worker end when the process that iterates the loader ends, however it
    ends (SIGKILL, SIGTERM, a crash), and leaves Ctrl-C to that process.

    Note:
        The loader's process holds the write end of a pipe whose read end is this worker's
        ``multiprocessing.parent_process().sentinel`` (forkserver, spawn and fork alike);
        the kernel closes it when that process dies, so a thread that waits on it learns of
        the death at once and ends the worker. Neither ``PR_SET_PDEATHSIG`` nor polling
        ``os.getppid()`` would do: with forkserver a worker's parent is the fork server,
        which outlives the loader's process (it exits only when every process holding its
        "alive" pipe has, workers included), and with spawn the death signal follows the
        thread that started the worker, which ends as soon as the workers are started. With
        the workers gone, the fork server and the resource tracker exit by themselves. On
        Ctrl-C the whole process group gets SIGINT; the loader's process stops the workers,
        so they ignore it instead of each printing a KeyboardInterrupt traceback.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(1)  # nothing is left to flush to or clean up for

    threading.Thread(target=watch, daemon=True, name="hlat-data-watch-loader").start()


def _work(setup: Any, inbox: Any, results: Any, stop: Any) -> None:
    # Note: the loader's process, not this process's parent (the fork server), is what
    # this worker must not outlive
    _end_with_the_loader_process()
    try:
        encode = setup.get()
    except Exception as e:
        results.put(
            (
                -1,
                DataError(
                    f"a tokenizer worker could not load the source and tokenizer ({e}); "
                    "workers do not import the main script, so define custom sources and "
                    "tokenizers in an importable module, or run with num_workers=0"
                ),
            )
        )
        return
    tokenizer = getattr(encode, "tokenizer", None)
    if getattr(tokenizer, "kind", None) == "hf" and getattr(tokenizer, "num_threads", 0) == 1:
        # Note: a worker encodes on one thread (its tokenizer is the loader's with_threads(1));
        # Hugging Face tokenizers size their thread pool to every core of the process
        # instead, so workers would contend for the cores; this process is ours to set
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    while True:
        item = inbox.get()
        if item is None or stop.is_set():
            # Note: exiting flushes what was put; the parent drains it, so no message is
            # cut short (a half-written message would block the parent's next read)
            return
        number, task = item
        try:
            results.put((number, encode(task)))
        except BaseException as e:
            try:
                results.put((number, e))
            except Exception:
                results.put((number, RuntimeError(f"{type(e).__name__}: {e}")))


def _shut_down(
    workers: list[Any], inbox: Any, results: Any, stop: Any, *, drain: bool = True
) -> None:
    """Stops the workers: asks them to end and drains their results while they do, or,
    without ``drain``, terminates them at once.

    Note:
        Without ``drain`` the results pipe may hold the rest of a message whose start was
        read when an interrupt came; reading on would take those bytes for a length and
        wait for data that never comes, so the workers (which hold nothing of value) are
        terminated instead.
    """
    if drain:
        stop.set()
        for _ in workers:
            inbox.put(None)
        deadline = time.monotonic() + 10
        while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
            # a worker blocked on a full pipe exits once drained
            with contextlib.suppress(queue.Empty):
                results.get(timeout=0.05)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()  # stuck: nothing more is read from its pipe after this
        worker.join()


def _close_queues(*queues: Any, timeout: float = 1.0) -> None:
    """Closes ``queues`` and waits up to ``timeout`` seconds in all for their feeder threads
    to end.

    Note:
        A queue's feeder thread (started by its first ``put`` in this process) holds the
        queue's write lock and slot semaphore. When it holds the last references, they are
        released in that thread, and releasing one removes its named semaphore and then
        tells multiprocessing's resource tracker, in a pipe write that lets other threads
        run. A thread caught between the two when the interpreter exits (a daemon thread
        is stopped there, as after a Ctrl-C that ends the program) leaves the name on the
        tracker's list, which warns of a leaked semaphore at the end. Waiting for the
        feeders here, while this thread still holds the queues, releases every semaphore in
        this thread instead. A feeder blocked on a full pipe (a worker that died before it
        read its setup) is not waited for beyond ``timeout``; ``cancel_join_thread`` keeps
        the exit from waiting for it. The feeder is CPython's ``Queue._thread``; where a
        queue has no such attribute, nothing is waited for.
    """
    for q in queues:
        q.cancel_join_thread()
        q.close()
    deadline = time.monotonic() + timeout
    for q in queues:
        feeder = getattr(q, "_thread", None)
        if isinstance(feeder, threading.Thread):
            feeder.join(max(0.0, deadline - time.monotonic()))


def _poll(q: Any, timeout: float) -> Any:
    """An item of ``q``, or None when none comes within ``timeout`` seconds (0: now)."""
    try:
        return q.get(timeout=timeout) if timeout else q.get_nowait()
    except queue.Empty:
        return None


def _next_result(
    results: Any, inbox: Any, starter: _Starter, encode: _Encoder, helps: bool
) -> tuple[int, Chunk]:
    """The next finished chunk, in any order.

    Note:
        While no worker result is ready and the workers are still starting (or, with
        ``helps``, all busy), this process takes a pending task from the shared inbox and
        encodes it itself: it would otherwise sit idle, since the caller is waiting for data
        anyway.
    """
    waited = 0.0
    while True:
        # Note: nothing here runs inside an ``except queue.Empty`` block, so an error of
        # ``encode`` or a KeyboardInterrupt while waiting is reported alone, not chained to
        # an empty queue
        got = _poll(results, 0.0)
        if got is None:
            item = _poll(inbox, 0.0) if helps or starter.is_alive() else None
            if item is not None:
                number, task = item
                return number, encode(task)
            got = _poll(results, 0.01)  # short waits: a task put moments ago can be taken here
        if got is None:
            waited += 0.01
            if starter.error is not None:
                raise DataError(
                    f"the tokenizer workers could not be started: {starter.error}; "
                    "run with num_workers=0 to tokenize in this process"
                ) from starter.error
            dead = [w for w in starter.started() if not w.is_alive()] if waited >= 1 else []
            if dead:
                raise DataError(
                    f"a tokenizer worker died (exit code {dead[0].exitcode}); "
                    "see its output above, or run with num_workers=0 to debug"
                )
            waited = 0.0 if waited >= 1 else waited
            continue
        number, payload = got
        if isinstance(payload, BaseException):
            raise payload
        return number, payload


# what a part's hash covers beyond the fields it names
_HASHED = {
    "source": "the files' base names, sizes or row counts differ",
    "tokenizer": "the model file differs",
}


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, each part with the fields of it that differ."""
    out = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if old == new:
            continue
        if not (isinstance(old, dict) and isinstance(new, dict)):
            out.append(f"{key} changed: state has {old}, this loader has {new}")
            continue
        # Note: a field only one side has (a state saved before the field was named) is
        # left out; the hash covers it
        fields = [
            f"{k}: state has {old[k]}, this loader has {new[k]}"
            for k in sorted(set(old) & set(new))
            if k != "hash" and old[k] != new[k]
        ]
        if not fields and old.get("hash") != new.get("hash"):
            fields.append(
                f"{_HASHED.get(key, 'the hash differs')} (hash: state has {old.get('hash')}, "
                f"this loader has {new.get('hash')})"
            )
        if fields:
            out.append(f"{key} changed: " + ", ".join(fields))
    return out


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state for all data-parallel ranks, from each rank's :meth:`PackedLoader.state_dict`.

    Gather the ranks' states (e.g. ``torch.distributed.all_gather_object``) and merge them
    (:class:`~hlat_data.mixture.MixedLoader` states too)
    to checkpoint one global object, or to resume with a different ``dp_size``.
    """
    if not states:
        raise DataError("merge_states needs the state of every rank, got none")
    first = states[0]
    if first.get("format") == MIXTURE_STATE_FORMAT:
        from hlat_data.mixture import merge_mixture_states

        return merge_mixture_states(states)
    size = first["dp_size"]
    by_rank = {s["dp_rank"]: s for s in states}
    if sorted(by_rank) != list(range(size)):
        raise DataError(f"merge_states needs ranks 0..{size - 1}, got {sorted(by_rank)}")
    for s in states:
        if (s["fingerprint"], s["seed"], s["dp_size"]) != (
            first["fingerprint"],
            first["seed"],
            size,
        ):
            raise DataError(f"rank {s['dp_rank']}'s state reads other data than rank 0's")
    keys = ("epoch", "position", "offset", "batches", "resumed_from")
    return {
        "format": STATE_FORMAT,
        "fingerprint": first["fingerprint"],
        "seed": first["seed"],
        "dp_size": size,
        "ranks": [{k: by_rank[r][k] for k in keys} for r in range(size)],
    }
