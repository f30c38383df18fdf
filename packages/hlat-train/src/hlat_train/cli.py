"""The ``hlat-train`` command.

::

    hlat-train demo                                   # the tiny Llama on the stdlib, CPU
    hlat-train print-config --config hlat-7b --optim.lr=2e-4
    hlat-train train --config run.toml --train.steps=100 --optim.warmup_steps=10
    torchrun --nproc-per-node 8 -m hlat_train train --config hlat-7b --data.paths=...
    hlat-train export-hf runs/hlat/checkpoints hf-out
    hlat-train preflight --checkpoint-url /fsx/ckpt   # health checks (also under torchrun)
    hlat-train plan --config llama2-7b-trn1-128       # memory, traffic, fit: a dry run

Only what a command needs is imported: ``presets`` and ``--help`` start without torch
(``print-config`` validates the model's shape with hlat-model, which imports it), and
``train`` imports the trainer once the config is read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from hlat_train.config import ConfigError, TrainConfig, preset_names

EXIT_CONFIG = 2
EXIT_PREEMPTED = 143  # 128 + SIGTERM, what a scheduler expects from a terminated job


def _overrides(extra: list[str]) -> list[str]:
    """``--section.key=value``, ``--section.key value``, and for boolean keys a bare
    ``--section.key`` (true) or ``--no-section.key`` (false), as ``section.key=value``."""
    from hlat_train.confighelp import bool_keys

    booleans = bool_keys(TrainConfig)
    out: list[str] = []
    i = 0
    while i < len(extra):
        item = extra[i]
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            raise ConfigError(
                f"unexpected argument {item!r}; overrides look like --section.key=value "
                "(hlat-train train --help lists the keys)"
            )
        if "=" not in item:
            key = item[2:]
            has_value = i + 1 < len(extra) and not extra[i + 1].startswith("--")
            if key.startswith("no-") and key[3:] in booleans:
                item = f"--{key[3:]}=false"
            elif has_value:
                item = f"{item}={extra[i + 1]}"
                i += 1
            elif key in booleans:
                item = f"{item}=true"
            else:
                raise ConfigError(
                    f"override {item} has no value; only boolean keys may stand alone "
                    "(hlat-train train --help lists every key with its type)"
                )
        out.append(item)
        i += 1
    return out


def _load(args: argparse.Namespace, extra: list[str]) -> TrainConfig:
    return TrainConfig.from_toml(args.config, _overrides(extra))


def _parser(keys: bool = False) -> argparse.ArgumentParser:
    """The command line; ``keys``: list every config key in the help of the commands that
    take overrides (built only for ``--help``: it reads the config's source)."""
    parser = argparse.ArgumentParser(
        prog="hlat-train",
        description="Pre-train Llama-family models the HLAT way. Any --section.key=value "
        "after the command overrides the config.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    config_help = f"a TOML file or a preset ({', '.join(preset_names())})"
    epilog = None
    if keys:
        from hlat_train.confighelp import keys_help

        epilog = keys_help(TrainConfig)
    with_keys: dict[str, Any] = {
        "epilog": epilog,
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }

    train = sub.add_parser("train", help="train (under torchrun for many processes)", **with_keys)
    train.add_argument("--config", required=True, help=config_help)

    show = sub.add_parser(
        "print-config", help="print the merged config as TOML and validate it", **with_keys
    )
    show.add_argument("--config", required=True, help=config_help)
    show.add_argument(
        "--no-check-files", action="store_true", help="do not check data and tokenizer paths"
    )

    sub.add_parser("presets", help="list the shipped presets")

    plan = sub.add_parser(
        "plan",
        help="dry run of the layout at full size: memory, communication and checkpoint "
        "bytes per rank, and whether it fits the device (exit 1 when it does not)",
        **with_keys,
    )
    plan.add_argument("--config", required=True, help=config_help)
    plan.add_argument("--nodes", type=int, default=None, help="nodes (default: the config's)")
    plan.add_argument(
        "--procs-per-node",
        type=int,
        default=None,
        help="processes per node (default: the device's)",
    )
    where = plan.add_mutually_exclusive_group()
    where.add_argument(
        "--device",
        default=None,
        help="trn1, trn2, h100, h200 or a100 (default trn1 for parallel.backend auto or "
        "neuron, unless --device-memory-gib is given)",
    )
    where.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help="memory per process, GiB: a custom device (needs --procs-per-node), planned on "
        "the torch backend unless parallel.backend is neuron",
    )

    demo = sub.add_parser("demo", help="train the tiny-demo Llama on the Python standard library")
    demo.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    demo.add_argument("--cache-dir", default=None, help="corpus/tokenizer cache (~/.cache/hlat)")
    demo.add_argument("--max-files", type=int, default=None, help="use only the first N files")
    demo.add_argument("--vocab-size", type=int, default=4096, help="tokenizer pieces (4096)")

    export = sub.add_parser("export-hf", help="a Hugging Face Llama directory from a checkpoint")
    export.add_argument("checkpoint", help="checkpoint root or step_<N> directory (or URL)")
    export.add_argument("out", help="output directory")
    export.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    export.add_argument("--tokenizer", default=None, help="SentencePiece .model to ship")

    # Parsed by hlat_train.preflight itself (its own options and --help); listed for --help.
    sub.add_parser(
        "preflight",
        add_help=False,
        help="health checks before a job: devices, disk, port, all-reduce burn-in, "
        "checkpoint storage (run under torchrun for every rank; see preflight --help)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hlat-train`` and ``python -m hlat_train``."""
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["preflight"]:
        from hlat_train.preflight import main as preflight

        return preflight(words[1:])
    args, extra = _parser(keys="-h" in words or "--help" in words).parse_known_args(words)
    try:
        if args.command == "presets":
            print("\n".join(preset_names()))
            return 0
        if args.command == "print-config":
            from hlat_train.validation import validate

            config = _load(args, extra)
            print(config.to_toml())
            validate(config, check_files=not args.no_check_files)
            return 0
        if args.command == "plan":
            return _plan(args, extra)
        if args.command == "export-hf":
            if extra:
                raise ConfigError(f"export-hf takes no overrides, got {' '.join(extra)}")
            from hlat_train.export import export_hf

            out = export_hf(args.checkpoint, args.out, dtype=args.dtype, tokenizer=args.tokenizer)
            print(f"hlat-train: wrote {out}")
            return 0
        if args.command == "demo":
            from hlat_train.demo import default_cache_dir, run_demo

            summary = run_demo(
                args.cache_dir or default_cache_dir(),
                args.out,
                _overrides(extra),
                max_files=args.max_files,
                vocab_size=args.vocab_size,
            )
            _report(summary)
            return EXIT_PREEMPTED if summary["preempted"] else 0
        # train
        from hlat_train.trainer import Trainer

        trainer = Trainer(_load(args, extra))
        try:
            summary = trainer.fit()
        finally:
            trainer.close()
            global _ENDED_PROCESS_GROUP
            _ENDED_PROCESS_GROUP = True
        if trainer.dims.rank == 0:
            _report(summary)
        return EXIT_PREEMPTED if summary["preempted"] else 0
    except ConfigError as e:
        print(f"hlat-train: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as e:
        from hlat_data import DataError

        if not isinstance(e, DataError):
            raise
        print(f"hlat-train: data error: {e}", file=sys.stderr)
        return EXIT_CONFIG


EXIT_DOES_NOT_FIT = 1

_ENDED_PROCESS_GROUP = False


def run() -> None:
    """The ``hlat-train`` command and ``python -m hlat_train``: :func:`main`, then exit.

    Note: after a training run (its checkpoints written and waited for, its metrics closed,
    its process group destroyed) the process ends with ``os._exit`` once stdout, stderr and
    logging are flushed, skipping the interpreter's finalization. There, torch's C++
    threads of the destroyed process groups can still be running down and touch Python
    objects of a finalizing interpreter, which aborts the process ("terminate called without
    an active exception", SIGABRT) after a finished run, so that torchrun reports a failed
    worker: seen now and then in multi-process runs on torch 2.9 and 2.13 (CPU, gloo). A
    run that fails raises as usual.
    """
    code = main()
    if _ENDED_PROCESS_GROUP:
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def _plan(args: argparse.Namespace, extra: list[str]) -> int:
    from hlat_train.plan import failure_text, make_plan, print_progress, resolve_layout

    config = _load(args, extra)
    options = {
        "device": args.device,
        "nodes": args.nodes,
        "procs_per_node": args.procs_per_node,
        "device_memory_gib": args.device_memory_gib,
    }
    resolve_layout(config, **options)  # bad options fail here, before any import of torch
    plan = make_plan(config, args.config, progress=print_progress, **options)
    print(plan.render())
    if plan.fits:
        return 0
    print(f"hlat-train plan: {failure_text(plan)}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def _report(summary: dict) -> None:
    if not math.isnan(summary.get("first_loss", math.nan)):
        print(
            f"hlat-train: steps to {summary['step']}: loss {summary['first_loss']:.3f} -> "
            f"{summary['last_loss']:.3f}"
        )
    else:
        print(f"hlat-train: nothing to train: already at step {summary['step']}")
    if summary.get("out_of_time"):
        print("hlat-train: stopped at train.time_limit; run the same command again to continue")
    if summary.get("out_of_data"):
        print("hlat-train: stopped where the training data ran out (see the log above)")
    if "sample" in summary:
        print("hlat-train: sample:\n" + summary["sample"])
    print(json.dumps({k: v for k, v in summary.items() if k != "sample"}))
