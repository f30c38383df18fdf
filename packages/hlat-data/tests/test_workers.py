"""Tokenizer worker processes start from any kind of main program (a script without a main
guard, ``python -c``, ``python -m``, torchrun) and end with the loader's process.

Each test runs a real Python process on a small script that has no
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# Iterates one loader with 2 workers partly (left open at exit), one fully, and drops a
# third after a few batches; each against the batches of num_workers=0. Under torchrun each
# rank reads its own share.
SCRIPT = """
import gc, itertools, multiprocessing, os, sys
import numpy as np
from hlat_data import ArrowSource, PackedLoader, Tokenizer

# one write per line: torchrun's ranks share one stdout
sys.stdout.write(f"main module ran in {multiprocessing.current_process().name}\\n")
sys.stdout.flush()
corpus, tokenizer_path, *context = sys.argv[1:]
rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
source, tokenizer = ArrowSource(corpus), Tokenizer.from_file(tokenizer_path, num_threads=1)

def make(workers, epochs):
    return PackedLoader(
        source, tokenizer, 64, 2, rank, size, seed=3, block_size=4,
        num_workers=workers, num_epochs=epochs, mp_context=(context or [None])[0],
    )

def same(a, b):
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        for field in x._fields:
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field))

reference = list(make(0, 1))
partly = iter(make(2, None))
head = []
while len(multiprocessing.active_children()) < 2:  # the workers have started
    head.append(next(partly))
head += itertools.islice(partly, 40)
same(head, list(itertools.islice(make(0, None), len(head))))
same(list(make(2, 1)), reference)
dropped = make(2, None)
same(list(itertools.islice(dropped, 5)), reference[:5])
del dropped
gc.collect()
sys.stdout.write(f"ok {len(head)} {len(reference)}\\n")
sys.stdout.flush()
"""

# Iterates a loader with 2 workers until they run, prints their pids, and goes on iterating
# until a signal ends it.
RUNNING = """
import multiprocessing, signal, sys
from hlat_data import ArrowSource, PackedLoader, Tokenizer

loader = PackedLoader(
    ArrowSource(sys.argv[1]), Tokenizer.from_file(sys.argv[2], num_threads=1), 64, 2,
    block_size=4, num_workers=2,
)
signal.signal(signal.SIGINT, signal.default_int_handler)  # even where it came in ignored
shown = False
for batch in loader:
    workers = multiprocessing.active_children()
    if not shown and len(workers) == 2:
        print(*(w.pid for w in workers), flush=True)
        shown = True
"""

FORBIDDEN = ("leaked", "resource_tracker", "Traceback")


def run(args, cwd, timeout=120, **kwargs):
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, **kwargs
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for word in FORBIDDEN:
        assert word not in result.stderr, result.stderr
    return result


def check(result, processes=1):
    lines = result.stdout.splitlines()
    # the main module ran once per process, in the main process, never in a worker
    ran = [line for line in lines if line.startswith("main module ran")]
    assert ran == ["main module ran in MainProcess"] * processes, result.stdout
    assert sum(line.startswith("ok ") for line in lines) == processes, result.stdout


@pytest.mark.parametrize("context", ["default", "spawn"])
def test_a_script_without_a_main_guard(tmp_path, corpus, tokenizer_path, context):
    (tmp_path / "script.py").write_text(SCRIPT)
    chosen = [] if context == "default" else [context]
    check(run(["script.py", str(corpus), tokenizer_path, *chosen], tmp_path))


def test_python_dash_c(tmp_path, corpus, tokenizer_path):
    check(run(["-c", SCRIPT, str(corpus), tokenizer_path], tmp_path))


def test_a_module_run_with_dash_m(tmp_path, corpus, tokenizer_path):
    (tmp_path / "read_corpus.py").write_text(SCRIPT)
    check(run(["-m", "read_corpus", str(corpus), tokenizer_path], tmp_path))


def test_each_rank_of_torchrun(tmp_path, corpus, tokenizer_path):
    pytest.importorskip("torch")
    (tmp_path / "script.py").write_text(SCRIPT)
    launch = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run([*launch, "script.py", str(corpus), tokenizer_path], tmp_path, env=env)
    check(result, processes=2)


def _alive(pid):
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _children(pid):
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize(
    "signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["kill", "term", "ctrl-c"]
)
def test_workers_end_with_the_loader_s_process(tmp_path, corpus, tokenizer_path, signum):
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        loader = subprocess.Popen(
            [sys.executable, "-c", RUNNING, str(corpus), tokenizer_path],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    workers, helpers = [], []
    stuck = threading.Timer(60, loader.kill)  # ends the read below if no line comes
    stuck.start()
    try:
        assert loader.stdout is not None
        workers = [int(pid) for pid in loader.stdout.readline().split()]
        stuck.cancel()
        assert len(workers) == 2, "the loader's process ended before its workers ran"
        # its children (the fork server and the resource tracker) and theirs (the workers)
        helpers = _children(loader.pid)
        assert set(workers) <= {p for h in [loader.pid, *helpers] for p in _children(h)}
    finally:
        if signum == signal.SIGINT:
            # Note: after the workers' start-up (a worker ignores SIGINT from its first
            # line of hlat-data code on; one interrupted while its interpreter still boots
            # prints its own KeyboardInterrupt)
            time.sleep(2)
            os.killpg(loader.pid, signum)  # to the whole process group, as a terminal does
        else:
            loader.send_signal(signum)
        loader.wait(timeout=30)
        loader.stdout.close()
    left = [*workers, *helpers]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.05)
    lingering = [p for p in left if _alive(p)]
    for pid in lingering:  # not to leave them behind when this fails
        os.kill(pid, signal.SIGKILL)
    assert not lingering, "processes of the loader outlived it"
    if signum == signal.SIGINT:
        # the loader's process stopped its workers; they printed nothing of their own
        text = _without_names_already_gone(stderr.read_text())
        assert text.count("Traceback") == 1 and text.rstrip().endswith("KeyboardInterrupt")
        assert "leaked" not in text and "resource_tracker" not in text, text


_TRACKER_COUNT = re.compile(
    r"^.*UserWarning: resource_tracker: There appear to be (\d+) leaked semaphore objects.*\n"
    r"\s*warnings\.warn\(.*\n?",
    re.MULTILINE,
)
_SEMAPHORE_ALREADY_GONE = re.compile(
    r"^.*UserWarning: resource_tracker: '/mp-[^']*': \[Errno 2\] No such file or directory\n"
    r"\s*warnings\.warn\(.*\)\n?",
    re.MULTILINE,
)


def _without_names_already_gone(text: str) -> str:
    """``text`` without multiprocessing's resource tracker's report when every semaphore it
    lists at the end had already been removed (its unlink found nothing, so nothing leaked:
    the name was removed, but the tracker was not told). A semaphore the tracker removes
    itself, a real leak, leaves the report in."""
    counts = [int(m.group(1)) for m in _TRACKER_COUNT.finditer(text)]
    if counts and sum(counts) == len(_SEMAPHORE_ALREADY_GONE.findall(text)):
        text = _TRACKER_COUNT.sub("", _SEMAPHORE_ALREADY_GONE.sub("", text))
    return text


def test_a_tracker_report_is_let_through_only_when_nothing_leaked():
    count = (
        "/x/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be "
        "{} leaked semaphore objects to clean up at shutdown\n"
        "  warnings.warn('resource_tracker: There appear to be %d '\n"
    )
    gone = (
        "/x/resource_tracker.py:267: UserWarning: resource_tracker: '/mp-ab_12': "
        "[Errno 2] No such file or directory\n"
        "  warnings.warn('resource_tracker: %r: %s' % (name, e))\n"
    )
    end = "Traceback (most recent call last):\nKeyboardInterrupt\n"
    assert _without_names_already_gone(end + count.format(1) + gone) == end
    assert _without_names_already_gone(end + count.format(2) + gone + gone) == end
    # removed by the tracker: leaked until the end
    assert "leaked" in _without_names_already_gone(end + count.format(1))
    assert "leaked" in _without_names_already_gone(end + count.format(2) + gone)


def _half_sent_message(results) -> None:
    """The start of a message in ``results``' pipe whose rest never comes, as an interrupt
    in the middle of reading one leaves it: a length of 1000 bytes, then 10 of them."""
    import struct

    os.write(results._writer.fileno(), struct.pack("!i", 1000) + b"x" * 10)


def test_an_interrupted_read_leaves_the_workers_terminated_not_drained():
    import multiprocessing

    from hlat_data.loader import _shut_down

    context = multiprocessing.get_context("spawn")
    inbox, results, stop = context.Queue(), context.Queue(), context.Event()
    worker = context.Process(target=time.sleep, args=(120,), daemon=True)
    worker.start()
    _half_sent_message(results)
    # Note: in a thread, so that a hang fails this test instead of stopping the suite;
    # draining would read the 10 bytes and wait for 990 more that never come
    done = threading.Thread(
        target=_shut_down, args=([worker], inbox, results, stop), kwargs={"drain": False}
    )
    done.start()
    done.join(timeout=60)
    hung = done.is_alive()
    if hung:
        worker.kill()
    assert not hung, "_shut_down(drain=False) read the results pipe"
    assert not worker.is_alive() and worker.exitcode is not None


def test_closing_the_queues_waits_for_their_feeder_threads():
    import multiprocessing

    from hlat_data.loader import _close_queues

    context = multiprocessing.get_context("spawn")
    read, unread = context.Queue(), context.Queue()
    read.put("a task")
    assert read.get(timeout=10) == "a task"
    # more than a pipe holds, never read: its feeder stays blocked on the pipe
    unread.put(b"x" * (4 << 20))
    feeders = [q._thread for q in (read, unread)]
    assert all(f is not None and f.is_alive() for f in feeders)
    done = threading.Thread(target=_close_queues, args=(read, unread), kwargs={"timeout": 0.5})
    done.start()
    done.join(timeout=60)  # a hang fails this test instead of stopping the suite
    assert not done.is_alive(), "waited for a feeder blocked on a full pipe"
    # the feeder of the drained queue ended before _close_queues returned, so the
    # queue's semaphores are released by the thread that drops the queue
    assert not feeders[0].is_alive()
    assert feeders[1].is_alive()
