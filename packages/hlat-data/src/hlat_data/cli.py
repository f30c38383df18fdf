"""The ``hlat-data`` command: ``convert``, ``train-tokenizer`` and ``stats``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from hlat_data.convert import convert_to_arrow, corpus_stats
from hlat_data.errors import DataError
from hlat_data.jsonl import open_source
from hlat_data.mixture import mixture_stats, read_mixture
from hlat_data.tokenizer import Tokenizer, train_tokenizer


def _count(value: str) -> int:
    """An argument that is an integer of 0 or more."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {number}")
    return number


def _positive(value: str) -> int:
    """An argument that is an integer of 1 or more."""
    number = _count(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hlat-data`` (help in plain text, defaults shown)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="hlat-data",
        description="Prepare pre-training text: convert it to Arrow, train a SentencePiece "
        "tokenizer, count documents and tokens.",
        formatter_class=fmt,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    convert = commands.add_parser(
        "convert",
        help="JSON lines (plain, .gz, .zst), parquet, plain text, datasets directories -> "
        "one Arrow file",
        formatter_class=fmt,
    )
    convert.add_argument("inputs", nargs="+", help="files, globs or directories")
    convert.add_argument("-o", "--output", required=True, help="the Arrow file to write")
    convert.add_argument("--text-field", default="text", help="field or column with the text")
    convert.add_argument("--batch-rows", type=_positive, default=8192, help="rows per record batch")
    convert.add_argument(
        "--nulls",
        choices=("error", "skip"),
        default="error",
        help="a null text (JSON null, Arrow or Parquet null): stop with its file and line or "
        "row (error), or leave it out and count it in nulls_skipped (skip)",
    )
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")

    train = commands.add_parser(
        "train-tokenizer",
        help="SentencePiece BPE with Llama-2 settings from Arrow, JSON lines or text",
        formatter_class=fmt,
    )
    train.add_argument(
        "inputs",
        nargs="+",
        help="Arrow/Parquet files, directories, JSON lines (.jsonl, .ndjson, .json, optionally "
        ".gz or .zst), UTF-8 text files",
    )
    train.add_argument("-o", "--output", required=True, help="model path (.model appended)")
    train.add_argument("--vocab-size", type=int, default=32000, help="pieces in the vocabulary")
    train.add_argument(
        "--text-column",
        "--text-field",
        default="text",
        help="column or field with the text (Arrow, Parquet, JSON lines)",
    )
    train.add_argument(
        "--max-chars", type=int, default=200_000_000, help="characters fed to the trainer at most"
    )

    stats = commands.add_parser(
        "stats", help="documents, characters, tokens, length histogram", formatter_class=fmt
    )
    stats.add_argument(
        "inputs",
        nargs="*",
        help="Arrow/Parquet files and directories, or JSON lines (.jsonl, .ndjson, .json, "
        "optionally .gz or .zst); not both",
    )
    stats.add_argument(
        "--tokenizer", help="a SentencePiece .model or a tokenizer.json, to count tokens"
    )
    stats.add_argument(
        "--text-column", "--text-field", default="text", help="column or field with the text"
    )
    stats.add_argument(
        "--on-bad-record",
        choices=("error", "skip"),
        default="skip",
        help="a null text or a bad JSON line: stop with its file and line (error), or count "
        "it as an empty document (skip)",
    )
    stats.add_argument("--max-documents", type=_count, help="read only the first N documents")
    stats.add_argument(
        "--mixture",
        help="a TOML file of [[sources]] tables (or an hlat-train config with "
        "[[data.sources]]): each source's documents, tokens and weight share instead of "
        "inputs (needs --tokenizer; with --max-documents, tokens are estimated from that many "
        "documents per source)",
    )
    stats.add_argument(
        "--planned-tokens",
        type=_count,
        help="with --mixture: the run's training tokens, to show what each source gives and "
        "in how many epochs, after its caps",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hlat-data``; returns the exit status (2 with a one-line message on bad input)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "convert":
            result = convert_to_arrow(
                args.inputs,
                args.output,
                text_field=args.text_field,
                batch_rows=args.batch_rows,
                progress=not args.no_progress,
                nulls=args.nulls,
            )
            print(json.dumps({"output": args.output, **result}))
        elif args.command == "train-tokenizer":
            path = train_tokenizer(
                args.inputs,
                args.output,
                args.vocab_size,
                text_column=args.text_column,
                max_chars=args.max_chars,
            )
            tokenizer = Tokenizer.from_file(path)
            print(json.dumps({"model": path, "vocab_size": tokenizer.vocab_size}))
        elif args.mixture:
            if args.inputs or not args.tokenizer:
                raise DataError("--mixture takes no inputs and needs --tokenizer")
            sources = read_mixture(args.mixture, args.text_column, on_bad_record=args.on_bad_record)
            result = mixture_stats(
                sources,
                Tokenizer.from_file(args.tokenizer),
                max_documents=args.max_documents,
                planned_tokens=args.planned_tokens,
            )
            print(json.dumps(result, indent=2))
        else:
            if not args.inputs:
                raise DataError("stats needs inputs (or --mixture)")
            if args.planned_tokens is not None:
                raise DataError("--planned-tokens goes with --mixture")
            source = open_source(args.inputs, args.text_column, on_bad_record=args.on_bad_record)
            counter = Tokenizer.from_file(args.tokenizer) if args.tokenizer else None
            print(
                json.dumps(
                    corpus_stats(source, counter, max_documents=args.max_documents), indent=2
                )
            )
    except DataError as e:
        print(f"hlat-data {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
