"""The ``hlat-data`` command: ``convert``, ``train-tokenizer`` and ``stats``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from hlat_data.convert import convert_to_arrow, corpus_stats
from hlat_data.errors import DataError
from hlat_data.source import ArrowSource
from hlat_data.tokenizer import Tokenizer, train_tokenizer


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
        help="jsonl, jsonl.gz, parquet, plain text, datasets directories -> one Arrow file",
        formatter_class=fmt,
    )
    convert.add_argument("inputs", nargs="+", help="files, globs or directories")
    convert.add_argument("-o", "--output", required=True, help="the Arrow file to write")
    convert.add_argument("--text-field", default="text", help="field or column with the text")
    convert.add_argument("--batch-rows", type=int, default=8192, help="rows per record batch")
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")

    train = commands.add_parser(
        "train-tokenizer",
        help="SentencePiece BPE with Llama-2 settings from Arrow or text",
        formatter_class=fmt,
    )
    train.add_argument("inputs", nargs="+", help="Arrow/Parquet files, directories, text files")
    train.add_argument("-o", "--output", required=True, help="model path (.model appended)")
    train.add_argument("--vocab-size", type=int, default=32000, help="pieces in the vocabulary")
    train.add_argument("--text-column", default="text", help="column with the text (Arrow input)")
    train.add_argument(
        "--max-chars", type=int, default=200_000_000, help="characters fed to the trainer at most"
    )

    stats = commands.add_parser(
        "stats", help="documents, characters, tokens, length histogram", formatter_class=fmt
    )
    stats.add_argument("inputs", nargs="+", help="anything ArrowSource reads")
    stats.add_argument(
        "--tokenizer", help="a SentencePiece .model or a tokenizer.json, to count tokens"
    )
    stats.add_argument("--text-column", default="text", help="column with the text")
    stats.add_argument("--max-documents", type=int, help="read only the first N documents")
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
        else:
            source = ArrowSource(args.inputs, text_column=args.text_column, nulls="skip")
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
