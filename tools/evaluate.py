"""Score an hlat checkpoint with lm-evaluation-harness, offline, on CPU: ``nox -s eval``.

    python tools/evaluate.py runs/demo/checkpoints              # the demo's newest checkpoint
    python tools/evaluate.py                                    # a short tiny-check run first
    python tools/evaluate.py CKPT --out runs/eval --limit 8 --batch-size 4

Steps, each announced as it starts:

1. Write the task ``stdlib_completion`` into ``OUT/tasks``: ``--items`` two-way
   multiple-choice items (which of two 40-character continuations follows a 300-character
   prefix; the other one comes from elsewhere in the same file) as JSON lines, and the task's
   YAML, whose ``dataset_kwargs.data_files`` names that file. The items are built
   deterministically from the standard-library files that ``hlat-train demo`` holds out for
   validation (2 % of the files, chosen by a hash of the path), so neither the demo nor the
   run of step 2 trained on them; a window whose text also occurs in a trained file is
   skipped. The correct choice alternates between the two positions.
2. Without a checkpoint root, train the ``tiny-check`` Llama (2 layers, width 64; 256-token
   sequences here) for ``--train-steps`` steps on one thread, on the first 150 of the
   standard library's ``.py`` files with a 4,096-piece SentencePiece tokenizer, both built
   and cached as ``hlat-train demo`` does (``hlat_train.demo``), into ``OUT/train``. A rerun
   resumes from it (nothing left to train).
3. Export the newest complete checkpoint with ``hlat_train.export_hf(..., dtype="float32")``
   into ``OUT/hf``.
4. Run lm-evaluation-harness through its Python API (``lm_eval.simple_evaluate``, model
   ``hf``, ``device="cpu"``) with ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` set
   before it is imported: nothing is downloaded.
5. Print one line (task, accuracy ± its standard error, items scored, seconds spent scoring
   and in all) and write the JSON-serialisable parts of lm_eval's results (with each item's
   log-likelihoods) into ``OUT/results.json``.

Needs ``hlat-train[hf]``, ``lm_eval`` (0.4.9 or newer), ``accelerate`` and ``transformers``;
``nox -s eval`` installs them. Exit status: 0 done; 1 the checkpoint cannot be exported (none
complete); 2 usage error (found before any work).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

TASK = "stdlib_completion"
PREFIX_CHARS = 300
CHOICE_CHARS = 40
DEFAULT_ITEMS = 40
# hlat-train demo's validation split: a file is held out when a hash of its path relative to
# the standard library falls in the first 2 of 100 buckets (hlat_train.demo.build_corpus)
HELD_OUT_PERCENT = 2
# a file gives one item per this many characters (the window, a distractor elsewhere)
CHARS_PER_ITEM = 2 * (PREFIX_CHARS + CHOICE_CHARS)

TRAIN_STEPS = 100
TRAIN_FILES = 150  # standard-library modules for the short run: about 4 MB of text
TRAIN_VOCAB = 4096  # the demo's: 340 characters are about 120 tokens
TRAIN_SEQ_LEN = 256  # the prefix and a choice fit without truncation

INSTALL_HINT = (
    'pip install "lm_eval>=0.4.9,<0.5" accelerate transformers (and hlat-train[hf]), '
    "or run the nox session that installs them: nox -s eval"
)


class UsageError(Exception):
    """A mistake in the command line; exit status 2."""


def log(text: str) -> None:
    print(f"evaluate: {text}", flush=True)


# --- the task ----------------------------------------------------------------------------------


def _hash(*parts: object) -> int:
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:16], 16)


def _stdlib_texts(root: str | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """The standard library's ``.py`` files as ``hlat-train demo`` splits them: ``(path
    relative to the standard library, text)`` of the held-out ones, and the texts of the
    others (its training documents); files that are not UTF-8 are left out."""
    from hlat_train.demo import stdlib_files

    root = root or sysconfig.get_paths()["stdlib"]
    held_out, trained = [], []
    for path in stdlib_files():
        rel = os.path.relpath(path, root)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < HELD_OUT_PERCENT:
            held_out.append((rel, text))
        else:
            trained.append(text)
    return held_out, trained


def _line_start(text: str, at: int) -> int:
    """The start of the first line at or after ``at`` (``at`` itself when none follows)."""
    if at == 0 or text[at - 1] == "\n":
        return at
    newline = text.find("\n", at)
    return at if newline < 0 else newline + 1


def _item(
    rel: str, text: str, lo: int, hi: int, k: int, label: int, trained: str
) -> dict[str, Any] | None:
    """One item from the segment ``text[lo:hi]``: a window starting at a line, whose text
    is nowhere in ``trained``, its true continuation, and a distractor from outside the
    window; None if the segment has none."""
    need = PREFIX_CHARS + CHOICE_CHARS
    span = hi - lo - need
    if span <= 0:
        return None
    for salt in range(8):
        start = _line_start(text, lo + _hash(rel, k, salt, "window") % span)
        if start + need > hi:
            continue
        prefix = text[start : start + PREFIX_CHARS]
        correct = text[start + PREFIX_CHARS : start + need]
        if not prefix.strip() or not correct.strip() or prefix + correct in trained:
            continue
        # the distractor: CHOICE_CHARS from anywhere in the file outside the window
        before = max(0, start - CHOICE_CHARS + 1)  # starts 0 .. start - CHOICE_CHARS
        after = max(0, len(text) - CHOICE_CHARS - (start + need) + 1)
        if before + after == 0:
            return None
        d = _hash(rel, k, salt, "distractor") % (before + after)
        d = d if d < before else start + need + (d - before)
        distractor = text[d : d + CHOICE_CHARS]
        if len(distractor) != CHOICE_CHARS or not distractor.strip() or distractor == correct:
            continue
        choices = [correct, distractor] if label == 0 else [distractor, correct]
        return {
            "prefix": prefix,
            "choices": choices,
            "label": label,
            "source": rel.replace(os.sep, "/"),
            "offset": start,
        }
    return None


def build_items(n: int = DEFAULT_ITEMS) -> list[dict]:
    """``n`` items, the same on every run with the same Python (and the first ``n`` of any
    longer task): the held-out files taken in turn, the k-th item of a file from the k-th
    of ``len(text) // CHARS_PER_ITEM`` equal segments of it, at a hash-chosen line. Windows
    whose text occurs in a training document (the codec tables under ``encodings/`` share
    most of their lines) are not used. ``label``, the index of the true continuation in
    ``choices``, alternates 0, 1, 0, ...

    Each item: ``prefix`` (300 characters), ``choices`` (two of 40), ``label``, ``source``
    (the file, relative to the standard library) and ``offset`` (of the prefix in it).
    """
    files, trained_docs = _stdlib_texts()
    capacity = {rel: len(text) // CHARS_PER_ITEM for rel, text in files}
    if n > sum(capacity.values()):
        raise UsageError(
            f"--items {n}: the held-out standard-library files give at most "
            f"{sum(capacity.values())} items"
        )
    trained = "\0".join(trained_docs)
    items: list[dict] = []
    for k in range(max(capacity.values())):
        for rel, text in files:
            if len(items) == n:
                return items
            if k < capacity[rel]:
                segment = len(text) // capacity[rel]
                lo, hi = k * segment, (k + 1) * segment
                item = _item(rel, text, lo, hi, k, len(items) % 2, trained)
                if item is not None:
                    items.append(item)
    if len(items) < n:
        raise UsageError(
            f"--items {n}: the held-out standard-library files give only {len(items)} items"
        )
    return items


def task_yaml(data_file: str | os.PathLike[str]) -> str:
    """The lm-evaluation-harness task: the JSON-lines file as the test split; the prefix is
    the context, each choice a continuation joined to it without a separator; accuracy."""
    path = json.dumps(os.path.abspath(data_file))  # a JSON string is a YAML scalar
    return f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: prefix
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(items: list[dict], tasks_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``<tasks_dir>/stdlib_completion.jsonl`` and ``.yaml``; returns both paths."""
    folder = Path(tasks_dir)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    config = folder / f"{TASK}.yaml"
    config.write_text(task_yaml(data), encoding="utf-8")
    return data, config


# --- the steps ---------------------------------------------------------------------------------


def train_short_run(out_dir: Path, steps: int) -> str:
    """Train ``tiny-check`` on the standard library into ``out_dir``; the checkpoint root."""
    import torch

    from hlat_train import TrainConfig
    from hlat_train.demo import build_corpus, build_tokenizer, default_cache_dir
    from hlat_train.trainer import Trainer

    start = time.perf_counter()
    version = f"py{sys.version_info[0]}{sys.version_info[1]}"
    folder = Path(default_cache_dir()) / f"eval-stdlib-{version}-{TRAIN_FILES}"
    log(f"building the corpus and a {TRAIN_VOCAB}-piece tokenizer (cached in {folder})")
    train, _ = build_corpus(str(folder), TRAIN_FILES)
    tokenizer = build_tokenizer(train, str(folder), TRAIN_VOCAB)
    config = TrainConfig.preset(
        "tiny-check",
        [
            f"--data.paths={json.dumps([train])}",
            f"--data.tokenizer={json.dumps(tokenizer)}",
            f"--train.out_dir={json.dumps(str(out_dir))}",
            f"--train.steps={steps}",
            f"--checkpoint.every={steps}",
            "--checkpoint.async_save=false",
            f"--model.max_seq_len={TRAIN_SEQ_LEN}",
            f"--data.seq_len={TRAIN_SEQ_LEN}",
            "--data.micro_batch_size=4",
            "--logging.progress=false",
            "--logging.plot=false",
            "--train.sample_prompt=''",
        ],
    )
    log(f"training tiny-check for {steps} steps into {out_dir} (CPU, one thread)")
    # a 64-wide model gains nothing from more threads, and on a busy machine a second
    # thread made the run five times slower (34 s against 6.7 s for 100 steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = Trainer(config)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    if summary.get("resumed_from") == summary["step"]:
        log(f"reused the run's checkpoint at step {summary['step']} ({seconds:.1f} s)")
    else:
        first, last = summary.get("first_loss"), summary.get("last_loss")
        losses = f", loss {first:.2f} -> {last:.2f}" if first is not None and last else ""
        log(f"trained to step {summary['step']} in {seconds:.1f} s{losses}")
    return str(summary["checkpoint_dir"])


def jsonable(value: Any) -> Any:
    """``value`` with what JSON cannot hold left out: dict keys as strings, tuples as lists,
    numpy scalars and arrays as numbers and lists, other objects dropped."""
    if isinstance(value, dict):
        kept = {str(k): jsonable(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not _DROP}
    if isinstance(value, (list, tuple)):
        return [v for v in map(jsonable, value) if v is not _DROP]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy and torch
        try:
            return jsonable(value.tolist())
        except (TypeError, ValueError):
            return _DROP
    return _DROP


_DROP = object()


def result_line(results: dict, task: str, seconds: float, total: float | None = None) -> str:
    """``stdlib_completion: acc 0.625 ± 0.078 (40 items, 19.2 s scoring, 31.0 s in all)``."""
    metrics = results["results"][task]
    acc = metrics["acc,none"]
    stderr = metrics.get("acc_stderr,none")
    spread = f" ± {stderr:.3f}" if isinstance(stderr, float) else ""
    n = results.get("n-samples", {}).get(task, {}).get("effective")
    items = f"{n} items, " if n is not None else ""
    in_all = f", {total:.1f} s in all" if total is not None else ""
    return f"{task}: acc {acc:.3f}{spread} ({items}{seconds:.1f} s scoring{in_all})"


# --- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tools/evaluate.py",
        description=(
            "Export the newest complete checkpoint of an hlat run to Hugging Face and score it "
            "with lm-evaluation-harness, offline on CPU, on a two-way multiple-choice task "
            f"over standard-library code ({TASK}: which of two {CHOICE_CHARS}-character "
            f"continuations follows a {PREFIX_CHARS}-character prefix)."
        ),
    )
    p.add_argument(
        "checkpoint",
        nargs="?",
        help="checkpoint root of a run (e.g. runs/demo/checkpoints) or one step_<N> "
        "directory; default: train a short tiny-check run into OUT/train first",
    )
    p.add_argument("--out", default="runs/eval", help="output directory (default: runs/eval)")
    p.add_argument(
        "--limit", type=int, default=None, help="score only the first N items (default: all)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="lm_eval batch size (default: 8)")
    p.add_argument(
        "--items",
        type=int,
        default=DEFAULT_ITEMS,
        help=f"items in the task (default: {DEFAULT_ITEMS})",
    )
    p.add_argument(
        "--train-steps",
        type=int,
        default=TRAIN_STEPS,
        help=f"steps of the short run made without a checkpoint (default: {TRAIN_STEPS})",
    )
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be wrong before any work: raises :class:`UsageError`."""
    for name in ("limit", "batch_size", "items", "train_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.checkpoint is not None and "://" not in args.checkpoint:
        from hlat_train.export import CONFIG_NAME

        path = Path(args.checkpoint)
        if not path.is_dir():
            raise UsageError(f"checkpoint directory {args.checkpoint} does not exist")
        if not ((path / CONFIG_NAME).exists() or (path.parent / CONFIG_NAME).exists()):
            raise UsageError(
                f"{args.checkpoint} is not a checkpoint directory written by hlat-train "
                f"(no {CONFIG_NAME} in it or its parent); give the run's checkpoint root, "
                "e.g. runs/demo/checkpoints"
            )
    missing = [m for m in ("lm_eval", "transformers", "accelerate") if not _installed(m)]
    if missing:
        raise UsageError(f"{', '.join(missing)} not installed: {INSTALL_HINT}")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    try:
        check_args(args)
        items = build_items(args.items)
    except UsageError as e:
        print(f"tools/evaluate.py: error: {e}", file=sys.stderr)
        return 2
    # before lm_eval, datasets or transformers is imported: they read these once
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    log(f"writing the task ({len(items)} items) into {out / 'tasks'}")
    data, config = write_task(items, out / "tasks")

    checkpoint = args.checkpoint or train_short_run(out / "train", args.train_steps)

    from hlat_train import ConfigError, export_hf

    hf_dir = out / "hf"
    log(f"exporting the newest complete checkpoint of {checkpoint} to {hf_dir} (float32)")
    try:
        export_hf(checkpoint, str(hf_dir), dtype="float32")
    except (ConfigError, FileNotFoundError, ValueError) as e:  # e.g. no complete checkpoint
        print(f"tools/evaluate.py: error: cannot export {checkpoint}: {e}", file=sys.stderr)
        return 1

    log("importing lm_eval")
    import lm_eval
    from lm_eval.tasks import TaskManager

    limit = f", the first {args.limit}" if args.limit else ""
    log(f"scoring {TASK} ({len(items)} items{limit}) with lm_eval {lm_eval.__version__} on CPU")
    eval_start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir.resolve()},dtype=float32",
        tasks=[TASK],
        device="cpu",
        batch_size=args.batch_size,
        limit=args.limit,
        task_manager=TaskManager(include_path=str(config.parent), include_defaults=False),
    )
    seconds = time.perf_counter() - eval_start
    if results is None:  # lm_eval returns None on ranks other than 0
        return 0
    total = time.perf_counter() - start
    record = jsonable(dict(results))
    record["hlat"] = {
        "checkpoint": str(checkpoint),
        "exported": str(hf_dir),
        "task_data": str(data),
        "task_config": str(config),
        "lm_eval_version": lm_eval.__version__,
        "eval_seconds": seconds,
        "total_seconds": total,
    }
    (out / "results.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    log(f"results in {out / 'results.json'}")
    print(result_line(results, TASK, seconds, total), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
