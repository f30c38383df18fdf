"""What the whole-trainer benchmarks share: the Llama shape, the corpus, and ``hlat-train
train`` runs (alone or under torchrun) with their per-step times."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

SHAPE = {"vocab_size": 8192, "dim": 512, "n_layers": 8, "n_heads": 8, "ffn_dim": 1376}
SEQ, MICRO_BATCH = 512, 4
WARMUP = 4  # steps left out of the median (the first compiles hlat-optim's update)


def make_corpus(root: Path) -> Path:
    """An Arrow corpus of the standard library's sources and a SentencePiece model of the
    benchmark's vocabulary trained on it, in ``root``."""
    import pyarrow as pa

    from hlat_data import train_tokenizer

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:1500]
    table = pa.table({"text": [f.read_text(errors="replace") for f in files]})
    with pa.ipc.new_file(str(root / "corpus.arrow"), table.schema) as writer:
        writer.write_table(table, max_chunksize=64)
    train_tokenizer(str(root / "corpus.arrow"), str(root / "tokenizer"), SHAPE["vocab_size"])
    return root


def launch(args: list[str], nproc: int, log: Path) -> None:
    """``args`` (a module or a script with its arguments) alone, or under torchrun."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = str(max((os.cpu_count() or 1) // nproc, 1))
    cmd = [sys.executable, *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *args]  # fmt: skip
    with log.open("w") as out:
        done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}); its log: {log}")


def run_hlat(
    data: Path, out: Path, nproc: int, precision: str, steps: int, *extra: str
) -> dict[int, float]:
    """``hlat-train train`` at the benchmarks' shape for ``steps`` steps with
    ``optim.precision = precision`` (``extra``: more overrides); each step's seconds
    (rank 0)."""
    model = [f"--model.{k}={v}" for k, v in SHAPE.items()]
    launch(
        ["-m", "hlat_train", "train", "--config", "tiny-demo", *model,
         f"--model.max_seq_len={SEQ}", f"--data.seq_len={SEQ}",
         f"--data.micro_batch_size={MICRO_BATCH}", f'--data.paths=["{data / "corpus.arrow"}"]',
         f"--data.tokenizer={data / 'tokenizer.model'}", "--data.block_size=64",
         f"--train.steps={steps}", "--optim.warmup_steps=2", "--optim.lr=1e-3",
         f"--optim.precision={precision}", "--train.eval_every=0",
         "--train.time_limit=0", '--train.sample_prompt=""', f"--train.out_dir={out}",
         f"--checkpoint.every={10 * steps}", "--logging.plot=false",
         "--logging.progress=false", "--model.compile=false", *extra],
        nproc,
        out.with_suffix(".log"),
    )  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["step_s"] for r in records if r.get("kind") == "train"}


def steady_tokens_per_s(step_s: dict[int, float], nproc: int) -> float:
    """Tokens/s of the median step after ``WARMUP``."""
    steady = [seconds for step, seconds in step_s.items() if step > WARMUP]
    return SEQ * MICRO_BATCH * nproc / statistics.median(steady)
