"""The whole training step of ``hlat-train`` against torchtitan's ``Trainer``, in one run.

Both train the same Llama (vocab 8192, dim 512, 8 layers, 8 heads, FFN 1376, sequence 512,
micro-batch 4, no compile, no activation checkpointing, plain causal attention) from the same
Arrow corpus and SentencePiece model, read by hlat-data's ``PackedLoader`` in both, with the
same thread count: one process with every core, or two processes (FSDP2 over gloo) with one
thread each. Each setting runs both trainers as fresh processes, one after the other; a
step's time is the wall time between two consecutive metric records of rank 0, so it holds
the whole step: data, forward, backward, clipping, optimizer, metrics. hlat-train runs with
its defaults (it also logs the parameter norm every step; torchtitan logs no such norm).

Precision, per setting:

- ``bf16``: bf16 weights. hlat-train ``optim.precision = "bf16-sr"`` (bf16 weights and
  moments, stochastic rounding); torchtitan ``training.dtype = "bfloat16"`` (the model and
  torch's fused AdamW in bf16, round-to-nearest).
- ``fp32``: fp32 throughout in both.
- ``mixed`` (two processes): fp32 weights, bf16 compute through FSDP2's mixed-precision
  policy, fp32 gradient reduction, in both.

Reported per setting: steady-state tokens/s (median step after ``WARMUP`` steps) of each and
their ratio. Run: ``nox -s bench-torchtitan`` (torchtitan 0.3 and triton in an environment of
their own; see ``torchtitan_worker.py`` for how torchtitan runs on a CPU).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

SHAPE = {"vocab_size": 8192, "dim": 512, "n_layers": 8, "n_heads": 8, "ffn_dim": 1376}
SEQ, MICRO_BATCH = 512, 4
STEPS = int(os.environ.get("HLAT_BENCH_STEPS", "14"))
WARMUP = 4  # steps left out of the median (the first compiles hlat-optim's update)
SETTINGS = [(1, "bf16"), (1, "fp32"), (2, "mixed"), (2, "bf16")]
HLAT_PRECISION = {"bf16": "bf16-sr", "fp32": "fp32", "mixed": "mixed"}
WORKER = Path(__file__).with_name("torchtitan_worker.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """An Arrow corpus of the standard library's sources and a SentencePiece model of the
    benchmark's vocabulary trained on it."""
    import pyarrow as pa

    from hlat_data import train_tokenizer

    root = tmp_path_factory.mktemp("trainer-bench")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:1500]
    table = pa.table({"text": [f.read_text(errors="replace") for f in files]})
    with pa.ipc.new_file(str(root / "corpus.arrow"), table.schema) as writer:
        writer.write_table(table, max_chunksize=64)
    train_tokenizer(str(root / "corpus.arrow"), str(root / "tokenizer"), SHAPE["vocab_size"])
    return root


def _launch(args: list[str], nproc: int, log: Path) -> None:
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


def run_hlat(data: Path, out: Path, nproc: int, precision: str) -> dict[int, float]:
    """``hlat-train train`` at the benchmark's shape; each step's seconds (rank 0)."""
    model = [f"--model.{k}={v}" for k, v in SHAPE.items()]
    _launch(
        ["-m", "hlat_train", "train", "--config", "tiny-demo", *model,
         f"--model.max_seq_len={SEQ}", f"--data.seq_len={SEQ}",
         f"--data.micro_batch_size={MICRO_BATCH}", f'--data.paths=["{data / "corpus.arrow"}"]',
         f"--data.tokenizer={data / 'tokenizer.model'}", "--data.block_size=64",
         f"--train.steps={STEPS}", "--optim.warmup_steps=2", "--optim.lr=1e-3",
         f"--optim.precision={HLAT_PRECISION[precision]}", "--train.eval_every=0",
         "--train.time_limit=0", '--train.sample_prompt=""', f"--train.out_dir={out}",
         f"--checkpoint.every={10 * STEPS}", "--logging.plot=false",
         "--logging.progress=false", "--model.compile=false"],
        nproc,
        out.with_suffix(".log"),
    )  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["step_s"] for r in records if r.get("kind") == "train"}


def run_torchtitan(data: Path, out: Path, nproc: int, precision: str) -> dict[int, float]:
    """torchtitan's ``Trainer`` (``torchtitan_worker.py``) at the same shape; each step's
    seconds (rank 0; its first step has no predecessor and is not recorded)."""
    shape = json.dumps({**SHAPE, "seq_len": SEQ})
    _launch(
        [str(WORKER), str(data), str(out), f"--precision={precision}", f"--steps={STEPS}",
         f"--shape={shape}", f"--micro-batch={MICRO_BATCH}"],
        nproc,
        out.with_suffix(".log"),
    )  # fmt: skip
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return {r["step"]: r["step_s"] for r in records}


def steady_tokens_per_s(step_s: dict[int, float], nproc: int) -> float:
    """Tokens/s of the median step after ``WARMUP``."""
    steady = [seconds for step, seconds in step_s.items() if step > WARMUP]
    return SEQ * MICRO_BATCH * nproc / statistics.median(steady)


@pytest.mark.parametrize(
    ("nproc", "precision"), SETTINGS, ids=[f"{n}proc-{p}" for n, p in SETTINGS]
)
def test_trainer_against_torchtitan(benchmark, data, tmp_path, nproc, precision):
    peer: list[dict[int, float]] = []
    ours: list[dict[int, float]] = []

    def setup() -> None:
        peer.append(run_torchtitan(data, tmp_path / f"torchtitan-{len(peer)}", nproc, precision))

    def hlat() -> None:
        ours.append(run_hlat(data, tmp_path / f"hlat-{len(ours)}", nproc, precision))

    benchmark.pedantic(hlat, setup=setup, rounds=int(os.environ.get("HLAT_BENCH_ROUNDS", "1")))
    hlat_tps = max(steady_tokens_per_s(s, nproc) for s in ours)
    peer_tps = max(steady_tokens_per_s(s, nproc) for s in peer)
    benchmark.extra_info.update(
        processes=nproc,
        precision=precision,
        hlat_tokens_per_s=round(hlat_tps),
        torchtitan_tokens_per_s=round(peer_tps),
        ratio=round(hlat_tps / peer_tps, 3),
    )
    print(f"\n[{nproc} proc, {precision}] {benchmark.extra_info}")
