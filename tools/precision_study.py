"""Precision study: the same small Llama, data and seed trained in several precision modes.

Tests HLAT's claim that pure bf16 with stochastic rounding (bf16-sr) tracks mixed precision
(fp32 master weights) while plain bf16 with round-to-nearest falls behind, and whether a
bf16 Kahan compensation (bf16-kahan) is an alternative to stochastic rounding. The corpus is the
Python standard library's own source (present wherever Python is), tokenized with a
SentencePiece BPE model trained on it; every 20th file is held out.

    python tools/precision_study.py                      # full study (~1 hour on 2 CPU cores)
    python tools/precision_study.py --quick --out /tmp/p # a smoke run of a few dozen steps

Writes ``losses.jsonl`` (one record per logged step and mode), ``losses.png`` and
``summary.md`` (final training and held-out losses) into ``--out`` (default docs/precision).
Needs hlat-model, hlat-optim, sentencepiece, numpy; matplotlib for the plot.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch

from hlat_model import Llama, LlamaConfig, cross_entropy_loss
from hlat_optim import AdamW, clip_grad_norm_, cosine_with_warmup

MODES = {
    # name: (parameter dtype, AdamW keyword arguments)
    "fp32": (torch.float32, {}),
    "mixed": (torch.bfloat16, {"master_weights": True}),
    "bf16": (torch.bfloat16, {"stochastic_rounding": False}),
    "bf16-sr": (torch.bfloat16, {"stochastic_rounding": True}),
    # bf16 parameters written back to nearest with a bf16 Kahan compensation; bf16 states
    # with stochastic rounding (10 bytes per parameter)
    "bf16-kahan": (torch.bfloat16, {"kahan_sum": True}),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "precision"
    )
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES)
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=None, help="default: 5%% of --steps")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (HLAT's)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N stdlib files")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="combine the --out folders of earlier runs (e.g. one per mode) into --out",
    )
    p.add_argument(
        "--tokenizer", type=Path, help="SentencePiece model to load, or to write when missing"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 30 steps, small corpus (options given explicitly still apply)",
    )
    if p.parse_known_args(argv)[0].quick:  # the smoke run's defaults, not overrides
        p.set_defaults(steps=30, max_files=150, vocab=2000, seq_len=128, batch=4)
        p.set_defaults(eval_every=10, eval_batches=2, log_every=5)
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    return args


def load_corpus(max_files: int | None) -> tuple[list[str], list[str]]:
    """(training documents, held-out documents): the stdlib's .py files, every 20th held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if max_files:
        files = files[:max_files]
    if not files:
        sys.exit(f"no .py files found under {root}")
    train, held_out = [], []
    for i, path in enumerate(files):
        text = path.read_text(encoding="utf-8", errors="replace")
        (held_out if i % 20 == 19 else train).append(text)
    return train, held_out


def train_tokenizer(docs: list[str], vocab: int, seed: int) -> spm.SentencePieceProcessor:
    lines = [line for doc in docs for line in doc.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)  # sentence sampling: same tokenizer every run
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=vocab,
        model_type="bpe",
        byte_fallback=True,
        hard_vocab_limit=False,
        input_sentence_size=300_000,
        shuffle_input_sentence=True,
        seed_sentencepiece_size=200_000,
        num_threads=2,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def tokenize(sp: spm.SentencePieceProcessor, docs: list[str]) -> np.ndarray:
    ids = sp.encode(docs, num_threads=2)
    eos = sp.eos_id()
    return np.fromiter((t for doc in ids for t in [*doc, eos]), dtype=np.int64)


def batches(tokens: np.ndarray, n: int, batch: int, seq_len: int, seed: int):
    """``n`` batches of random windows, the same for every mode (seeded)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
        rows = torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]))
        yield rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate(model: Llama, eval_set: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    losses = [cross_entropy_loss(model(x), y).item() for x, y in eval_set]
    model.train()
    return sum(losses) / len(losses)


def train_mode(mode, args, config, train_tokens, eval_set, log):
    dtype, opt_kwargs = MODES[mode]
    torch.manual_seed(args.seed)
    model = Llama(config).to(dtype)
    params = list(model.parameters())
    opt = AdamW(
        params,
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        seed=args.seed,
        **opt_kwargs,
    )
    sched = cosine_with_warmup(opt, args.warmup, args.steps, min_lr_ratio=args.min_lr_ratio)
    start, window, skipped = time.perf_counter(), [], 0
    data = batches(train_tokens, args.steps, args.batch, args.seq_len, args.seed + 1)
    for step, (x, y) in enumerate(data, start=1):
        lr = opt.param_groups[0]["lr"]
        loss = cross_entropy_loss(model(x), y)
        loss.backward()
        norm = clip_grad_norm_(params, 1.0)
        if norm.isfinite():
            opt.step()
        else:
            skipped += 1
        opt.zero_grad(set_to_none=True)
        sched.step()
        window.append(loss.item())
        last = step == args.steps
        if step % args.log_every == 0 or last:
            record = {
                "mode": mode,
                "step": step,
                "train_loss": sum(window) / len(window),
                "lr": lr,
                "grad_norm": norm.item(),
                "skipped_steps": skipped,
                "elapsed_s": round(time.perf_counter() - start, 2),
            }
            window = []
            if step % args.eval_every == 0 or last:
                record["eval_loss"] = evaluate(model, eval_set)
            log(record)
    return time.perf_counter() - start


def summarize(records: list[dict], args, tokens_per_step: int) -> str:
    rows = [
        "| mode | final training loss | held-out loss | held-out vs mixed | tokens/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    by_mode = {m: [r for r in records if r["mode"] == m] for m in args.modes}
    final_eval = {m: rs[-1].get("eval_loss", math.nan) for m, rs in by_mode.items() if rs}
    for mode, rs in by_mode.items():
        if not rs:
            continue
        tail = rs[-max(1, len(rs) // 20) :]  # the last 5% of logged steps
        train = sum(r["train_loss"] for r in tail) / len(tail)
        delta = final_eval[mode] - final_eval.get("mixed", math.nan)
        speed = args.steps * tokens_per_step / rs[-1]["elapsed_s"]
        rows.append(
            f"| {mode} | {train:.4f} | {final_eval[mode]:.4f} | {delta:+.4f} | {speed:,.0f} |"
        )
    return "\n".join(rows) + "\n"


def plot(records: list[dict], args, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("matplotlib not installed: no plot written", file=sys.stderr)
        return False
    fig, (ax, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in args.modes:
        rs = [r for r in records if r["mode"] == mode]
        ax.plot([r["step"] for r in rs], [r["train_loss"] for r in rs], label=mode, lw=1)
        ev = [r for r in rs if "eval_loss" in r]
        ax_eval.plot(
            [r["step"] for r in ev], [r["eval_loss"] for r in ev], marker="o", ms=3, label=mode
        )
    ax.set(xlabel="step", ylabel="training loss", title="training loss (mean per log interval)")
    ax_eval.set(xlabel="step", ylabel="held-out loss", title="held-out loss")
    for a in (ax, ax_eval):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def write_results(records: list[dict], args) -> None:
    table = summarize(records, args, args.batch * args.seq_len)
    (args.out / "summary.md").write_text(table)
    plotted = plot(records, args, args.out / "losses.png")
    print(table)
    print(
        f"wrote {args.out / 'losses.jsonl'}, {args.out / 'summary.md'}"
        + (f", {args.out / 'losses.png'}" if plotted else "")
    )


def merge(args) -> None:
    """One losses.jsonl, summary and plot from runs made in separate processes."""
    records: list[dict] = []
    with (args.out / "losses.jsonl").open("w") as out:
        for folder in args.merge:
            for line in (folder / "losses.jsonl").read_text().splitlines():
                record = json.loads(line)
                if "mode" in record:
                    records.append(record)
                    out.write(line + "\n")
    args.modes = list(dict.fromkeys(r["mode"] for r in records))
    args.steps = max(r["step"] for r in records)
    write_results(records, args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        args.out.mkdir(parents=True, exist_ok=True)
        merge(args)
        return
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_docs, held_docs = load_corpus(args.max_files)
    if args.tokenizer and args.tokenizer.exists():
        sp = spm.SentencePieceProcessor(model_file=str(args.tokenizer))
    else:
        # Note: SentencePiece training is not reproducible across processes even with a
        # seed; modes run in separate processes share one model through --tokenizer.
        sp = train_tokenizer(train_docs, args.vocab, args.seed)
        if args.tokenizer:
            args.tokenizer.write_bytes(sp.serialized_model_proto())
    train_tokens, held_tokens = tokenize(sp, train_docs), tokenize(sp, held_docs)
    print(
        f"corpus: {len(train_docs)} training files ({len(train_tokens):,} tokens), "
        f"{len(held_docs)} held out ({len(held_tokens):,} tokens), vocab {sp.get_piece_size()}, "
        f"prepared in {time.perf_counter() - t0:.0f} s"
    )
    config = LlamaConfig.preset("tiny", vocab_size=sp.get_piece_size(), max_seq_len=args.seq_len)
    eval_set = list(batches(held_tokens, args.eval_batches, args.batch, args.seq_len, 12345))

    records: list[dict] = []
    jsonl = args.out / "losses.jsonl"
    with jsonl.open("w") as f:
        f.write(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}}) + "\n")

        def log(record: dict) -> None:
            records.append(record)
            f.write(json.dumps(record) + "\n")
            f.flush()
            extra = f", held-out {record['eval_loss']:.4f}" if "eval_loss" in record else ""
            print(
                f"{record['mode']:>8} step {record['step']:>6}: loss {record['train_loss']:.4f}{extra}"
            )

        for mode in args.modes:
            seconds = train_mode(mode, args, config, train_tokens, eval_set, log)
            print(f"{mode}: {args.steps} steps in {seconds:.0f} s")

    write_results(records, args)


if __name__ == "__main__":
    main()
