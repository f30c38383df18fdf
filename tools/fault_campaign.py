"""Fault campaign: measured goodput of a real `hlat-train train` job under injected faults.

Runs ``torchrun --nproc-per-node 2 --max-restarts N -m hlat_train train`` on a tiny Llama
(fp32, or bf16-sr with ``--precision``; CPU, gloo) and, from a seeded schedule, injects:

- ``kill-rank``: SIGKILL of one worker (a crashed node); torchrun restarts the workers.
- ``kill-during-save``: SIGKILL of one worker while a checkpoint directory is being written
  (``step_<N>.tmp`` exists); torchrun restarts them, the partial checkpoint is ignored.
- ``sigterm``: SIGTERM to the whole job (a preemption, as Slurm or Kubernetes send it); the
  trainer saves and exits 143, and the campaign relaunches torchrun, as a scheduler would.
- ``corrupt-newest``: the job is SIGKILLed, a file of its newest checkpoint is truncated (a
  torn write on shared storage: a DCP shard by default, the manifest with ``--corrupt
  manifest``), and the campaign relaunches torchrun; resume must skip the damaged checkpoint
  and take the one before.
- ``hang-rank``: SIGSTOP of one worker (a wedged node, a hung collective): the other rank
  waits in a collective until its hang watchdog (``train.hang_timeout``, ``--hang-timeout``
  here) prints where it was and exits, and torchrun restarts the workers; the stopped
  process, which cannot act on torchrun's SIGTERM, is then SIGKILLed so it does not linger.
  Its *detection latency* is the time from the SIGSTOP to the watchdog's message.
- ``nan``: a non-finite loss at a step (``spike.inject_nan_at``, a drill key set to the same
  step in both runs, since it is configuration, not a signal): the trainer must drop that
  update (``action: skip``) and go on without a restart; the final state still equals the
  uninterrupted run's, which drops the same update.

``--kinds`` picks the kinds (all by default).

It measures wall time, productive time, effective utilisation, restart latency, lost work
per fault and checkpoint stall per save, checks that the final model and optimizer equal an
uninterrupted run with the same seed bit for bit, and writes ``summary.json``,
``timeline.png``, ``sensitivity.png`` and (``--doc``) ``docs/reliability.md`` with
``docs/reliability/sensitivity.png``.

    python tools/fault_campaign.py --faults 8 --seed 0 --out runs/faults --doc docs/reliability.md
    python tools/fault_campaign.py --quick --faults 2 --out /tmp/faults      # about a minute
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# the campaign's modules live in tools/campaign/, next to this script
sys.path.insert(0, str(Path(__file__).resolve().parent))

from campaign.harness import (
    HANG_TIMEOUT_S,
    KINDS,
    build_corpus,
    plan_nan_steps,
    run_campaign,
    run_reference,
    schedule,
    write_config,
)
from campaign.measure import (
    compare_final,
    measure_save_worker,
    measure_stall,
    measure_startup,
    summarise,
)
from campaign.report import companion_of, plot_sensitivity, plot_timeline, write_doc


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=8, help="faults to inject (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="schedule and training seed")
    parser.add_argument("--out", default="runs/fault-campaign", help="output directory")
    parser.add_argument("--quick", action="store_true", help="smaller model, shorter run")
    parser.add_argument("--steps", type=int, default=0, help="training steps (0: by size)")
    parser.add_argument(
        "--corrupt",
        choices=("manifest", "shard"),
        default="shard",
        help="which file of the newest checkpoint corrupt-newest truncates",
    )
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"comma-separated fault kinds to draw from (default: all, {','.join(KINDS)})",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=HANG_TIMEOUT_S,
        help=f"train.hang_timeout of both runs, seconds (default {HANG_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16-sr"),
        default="fp32",
        help="optim.precision of both runs (bf16-sr: bf16 weights and moments, stochastic "
        "rounding, as hlat-7b trains; default fp32)",
    )
    parser.add_argument("--doc", default="", help="also write this Markdown report")
    parser.add_argument(
        "--companion",
        default="",
        help="summary.json of the same campaign in another precision: --doc reports its "
        "outcome beside this one's",
    )
    parser.add_argument(
        "--from-summary", default="", help="only rewrite --doc from this summary.json"
    )
    parser.add_argument(
        "--before",
        default="",
        help="summary.json of an earlier run: --doc gets a before/after table of the terms",
    )
    parser.add_argument("--_measure-save", dest="measure_save", help=argparse.SUPPRESS)
    parser.add_argument("--_sizes", dest="sizes", default="", help=argparse.SUPPRESS)
    parser.add_argument("--_repeats", dest="repeats", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_save:
        measure_save_worker(args.measure_save, args.sizes.split(","), args.repeats)
        return 0
    before = json.loads(Path(args.before).read_text()) if args.before else None
    companion = json.loads(Path(args.companion).read_text()) if args.companion else None
    if args.from_summary:
        if not args.doc:
            parser.error("--from-summary needs --doc")
        summary = json.loads(Path(args.from_summary).read_text())
        if companion is not None:
            summary["companion"] = companion_of(companion)
        write_doc(summary, Path(args.doc), summary["command"], before)
        plot_sensitivity(summary, Path(args.doc).with_suffix("") / "sensitivity.png")
        return 0
    if args.faults < 1:
        parser.error(f"--faults must be at least 1, got {args.faults}")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        parser.error(f"--kinds: unknown {unknown or 'none given'}; choose from {', '.join(KINDS)}")
    if not args.hang_timeout >= 1:
        parser.error(f"--hang-timeout must be at least 1 s, got {args.hang_timeout}")

    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out} is not empty; choose a new directory (runs are not resumed)")
    out.mkdir(parents=True, exist_ok=True)
    every = 4 if args.quick else 5
    steps = args.steps or (150 if args.quick else 100 * args.faults + 200)
    print(f"fault campaign: {args.faults} faults, seed {args.seed}, {steps} steps -> {out}")

    corpus = build_corpus(out / "corpus")
    span = int(0.7 * (steps - every - 1))
    faults = schedule(args.faults, args.seed, span, min_gap=every + 1, kinds=kinds)
    nan_steps = plan_nan_steps(faults, every, steps)
    ref_dir, run_dir = out / "reference", out / "campaign"
    configs = [
        write_config(
            corpus,
            d,
            steps,
            every,
            args.quick,
            True,
            args.hang_timeout,
            nan_steps=nan_steps,
            precision=args.precision,
        )
        for d in (ref_dir, run_dir)
    ]

    ref = run_reference(configs[0], ref_dir)
    print(f"uninterrupted run: {ref['wall_s']:.1f} s")
    wall, records, attempts = run_campaign(
        configs[1], run_dir, faults, steps, every, args.corrupt, args.hang_timeout
    )
    injected = [f for f in faults if not math.isnan(f.at)]
    print(f"campaign: {wall:.1f} s, {len(injected)} faults, {len(attempts)} launches")
    final = compare_final(run_dir, ref_dir)
    stall = measure_stall(out, args.quick)
    startup = measure_startup(1 if args.quick else 3)
    summary = summarise(
        steps=steps,
        seed=args.seed,
        every=every,
        span=span,
        quick=args.quick,
        corrupt=args.corrupt,
        kinds=kinds,
        hang_timeout=args.hang_timeout,
        nan_steps=nan_steps,
        faults=faults,
        ref=ref,
        wall=wall,
        records=records,
        attempts=attempts,
        run_dir=run_dir,
        final=final,
        stall=stall,
        startup=startup,
    )
    summary["setup"]["precision"] = args.precision
    if companion is not None:
        summary["companion"] = companion_of(companion)
    restart_median = summary["campaign"]["restart_latency_median_s"]
    projection = summary["projection_hlat_7b"]
    hangs = [f for f in injected if f.kind == "hang-rank"]
    summary["command"] = "python tools/fault_campaign.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_timeline(records, faults, ref, out / "timeline.png")
    plot_sensitivity(summary, out / "sensitivity.png")
    if args.doc:
        write_doc(summary, Path(args.doc), summary["command"], before)
        plot_sensitivity(summary, Path(args.doc).with_suffix("") / "sensitivity.png")
    c = summary["campaign"]
    print(
        f"effective utilisation {c['utilisation']:.1%} (uninterrupted "
        f"{summary['reference']['utilisation']:.1%}); restart latency median "
        f"{restart_median:.2f} s; lost work per fault {c['lost_work_mean_s']:.2f} s; "
        f"async stall / sync {max(stall['async_over_sync']):.1%}; projected hlat-7b "
        f"{projection['utilisation']:.2%}"
    )
    if hangs:
        print(
            f"hang-rank: detection latency (SIGSTOP -> watchdog message) median "
            f"{c['hang_detection_latency_median_s']:.2f} s, max "
            f"{c['hang_detection_latency_max_s']:.2f} s at train.hang_timeout "
            f"{args.hang_timeout:g} s"
        )
    for f in injected:
        print(f"  {f.kind}: {f.detail}")
    print(f"final state bit-identical: {'yes' if final['bit_identical'] else 'NO'}")
    return 0 if final["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
