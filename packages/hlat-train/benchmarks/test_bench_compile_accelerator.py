"""``model.compile`` on an accelerator: the figures behind ``model.compile = "auto"`` on GPUs
(``hlat_train.compiling``).

``hlat-train train`` of a 1.0B Llama (TinyLlama-1.1B's shape: width 2048, 22 layers, 32 heads,
4 key/value heads, FFN 5632; a vocabulary of 8192 pieces trained on standard-library text),
4 x 2048 tokens per step, ``optim.precision = "auto"``, one process, logged every 5 steps:
eager and then with compiled blocks, in the same sitting. Reported: each run's median
tokens/s over the windows logged after step 20, their ratio, the first window's seconds per
step (compilation included; the eager run compiles hlat-optim's update there, which the
compiled run then finds in inductor's cache), and the peak memory.

Skipped where torch sees no accelerator; the 1.0B model needs about 22 GiB of device memory.
``HLAT_BENCH_STEPS`` (default 60) sets the run length, ``HLAT_BENCH_DEVICE`` another device
(``cpu`` for a dry run), and ``HLAT_BENCH_OVERRIDES`` more ``hlat-train`` overrides (a smaller
shape for that dry run).

Run: ``nox -s bench -- packages/hlat-train/benchmarks/test_bench_compile_accelerator.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainer_runs import make_corpus, run_hlat

STEPS = int(os.environ.get("HLAT_BENCH_STEPS", "60"))
STEADY_AFTER = 20  # windows logged after this step make the median
EVERY = 5
SHAPE_1B = [
    "--model.dim=2048", "--model.n_layers=22", "--model.n_heads=32", "--model.n_kv_heads=4",
    "--model.ffn_dim=5632", "--model.max_seq_len=2048", "--data.seq_len=2048",
    "--data.micro_batch_size=4",
]  # fmt: skip


def _device() -> str | None:
    asked = os.environ.get("HLAT_BENCH_DEVICE")
    if asked:
        return asked
    found = torch.accelerator.current_accelerator()
    return found.type if found is not None else None


DEVICE = _device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason="torch sees no accelerator")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _run(corpus: Path, out: Path, compiled: bool) -> dict[str, float]:
    run_hlat(
        corpus, out, 1, "auto", STEPS, *SHAPE_1B, f"--train.device={DEVICE}",
        f"--logging.every={EVERY}", "--optim.warmup_steps=10", "--checkpoint.keep_last=1",
        *shlex.split(os.environ.get("HLAT_BENCH_OVERRIDES", "")),
        f"--model.compile={str(compiled).lower()}",
    )  # fmt: skip
    lines = (out / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r.get("kind") == "train"]
    steady = [r["tokens_per_s"] for r in train if r["step"] > STEADY_AFTER]
    if not steady:
        raise RuntimeError(f"no window logged after step {STEADY_AFTER} in {out}")
    return {
        "tokens_per_s": statistics.median(steady),
        "mfu": statistics.median(r["mfu"] for r in train if r["step"] > STEADY_AFTER),
        "first_window_step_s": train[0]["step_s"],
        "memory_gib": max(r["memory_gib"] for r in train),
    }


def test_compiled_blocks_against_eager_in_whole_runs(benchmark, corpus, tmp_path):
    runs: dict[str, dict[str, float]] = {}

    def setup() -> None:
        runs["eager"] = _run(corpus, tmp_path / "eager", compiled=False)

    def compiled() -> None:
        runs["compiled"] = _run(corpus, tmp_path / "compiled", compiled=True)

    benchmark.pedantic(compiled, setup=setup, rounds=1)
    eager, comp = runs["eager"], runs["compiled"]
    benchmark.extra_info.update(
        device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        torch=torch.__version__,
        eager={k: round(v, 3) for k, v in eager.items()},
        compiled={k: round(v, 3) for k, v in comp.items()},
        compiled_vs_eager=round(comp["tokens_per_s"] / eager["tokens_per_s"], 3),
    )
    print(f"\n[model.compile, whole runs] {benchmark.extra_info}")
