"""The whole training step of ``hlat-train`` against torchtitan's ``Trainer``, in one run.

Both train the same Llama (vocab 8192, dim 512, 8 layers, 8 heads, FFN 1376, sequence 512,
micro-batch 4, plain causal attention) from the same Arrow corpus and SentencePiece model,
read by hlat-data's ``PackedLoader`` in both, with the same thread count: one process with
every core, or two processes (FSDP2 over gloo) with one thread each. Each setting runs both
trainers as fresh processes, one after the other; a step's time is the wall time between
two consecutive metric records of rank 0, so it holds the whole step: data, forward,
backward, clipping, optimizer, metrics. hlat-train runs with
its defaults (it also logs the parameter norm every step, where torchtitan logs no such
norm; and from 0.18 its CPU runs keep freed host memory mapped, ``train.host_malloc =
"auto"``, where torchtitan's use glibc's defaults).

Precision, per setting:

- ``bf16``: bf16 weights. hlat-train ``optim.precision = "bf16-sr"`` (bf16 weights and
  moments, stochastic rounding); torchtitan ``training.dtype = "bfloat16"`` (the model and
  torch's fused AdamW in bf16, round-to-nearest).
- ``fp32``: fp32 throughout in both (one process, and two: the precision that ``auto`` picks
  on CPUs without native bf16 products).
- ``mixed`` (two processes): fp32 weights, bf16 compute through FSDP2's mixed-precision
  policy, fp32 gradient reduction, in both.

Every setting runs eager but ``compiled`` (one process, bf16), where both compile as their
users would: hlat-train ``model.compile = true`` (each transformer block through
``torch.compile``; its chunked loss stays eager), torchtitan ``compile.enable = true`` (its
default components: each block and the loss). Both compile in their first step, which the
median leaves out.

Every setting runs without activation checkpointing but ``full-ac`` (one process, bf16),
where both recompute each transformer block in backward: hlat-train ``model.checkpointing =
"full"``, torchtitan ``activation_checkpoint`` ``FullAC``. Their selective modes keep
different things (hlat-train's recomputes the attention core, except hlat-model's CPU flash
kernels, and the SwiGLU activation; torchtitan's op-level policy saves chosen operators' outputs and
recomputes every second matrix product), so no setting compares them.

Reported per setting: steady-state tokens/s (median step after ``WARMUP`` steps) of each and
their ratio. Run: ``nox -s bench-torchtitan`` (torchtitan 0.3 and triton in an environment of
their own; see ``torchtitan_worker.py`` for how torchtitan runs on a CPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

sys.path.insert(0, str(Path(__file__).parent))
from trainer_runs import (
    MICRO_BATCH,
    SEQ,
    SHAPE,
    launch,
    make_corpus,
    run_hlat,
    steady_tokens_per_s,
)

STEPS = int(os.environ.get("HLAT_BENCH_STEPS", "14"))
SETTINGS = [  # (processes, precision, compiled, full activation checkpointing)
    (1, "bf16", False, False),
    (1, "fp32", False, False),
    (2, "mixed", False, False),
    (2, "bf16", False, False),
    (2, "fp32", False, False),
    (1, "bf16", True, False),
    (1, "bf16", False, True),
]
HLAT_PRECISION = {"bf16": "bf16-sr", "fp32": "fp32", "mixed": "mixed"}
WORKER = Path(__file__).with_name("torchtitan_worker.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """An Arrow corpus of the standard library's sources and a SentencePiece model of the
    benchmark's vocabulary trained on it (``trainer_runs.make_corpus``)."""
    return make_corpus(tmp_path_factory.mktemp("trainer-bench"))


def run_torchtitan(
    data: Path, out: Path, nproc: int, precision: str, compiled: bool = False, full_ac: bool = False
) -> dict[int, float]:
    """torchtitan's ``Trainer`` (``torchtitan_worker.py``) at the same shape; each step's
    seconds (rank 0; its first step has no predecessor and is not recorded)."""
    shape = json.dumps({**SHAPE, "seq_len": SEQ})
    launch(
        [str(WORKER), str(data), str(out), f"--precision={precision}", f"--steps={STEPS}",
         f"--shape={shape}", f"--micro-batch={MICRO_BATCH}", *(["--compile"] if compiled else []),
         *(["--full-ac"] if full_ac else [])],
        nproc,
        out.with_suffix(".log"),
    )  # fmt: skip
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return {r["step"]: r["step_s"] for r in records}


@pytest.mark.parametrize(
    ("nproc", "precision", "compiled", "full_ac"),
    SETTINGS,
    ids=[
        f"{n}proc-{p}" + ("-compiled" if c else "") + ("-full-ac" if a else "")
        for n, p, c, a in SETTINGS
    ],
)
def test_trainer_against_torchtitan(benchmark, data, tmp_path, nproc, precision, compiled, full_ac):
    peer: list[dict[int, float]] = []
    ours: list[dict[int, float]] = []
    extra = ["--model.compile=true"] if compiled else []
    extra += ["--model.checkpointing=full"] if full_ac else []

    def setup() -> None:
        out = tmp_path / f"torchtitan-{len(peer)}"
        peer.append(run_torchtitan(data, out, nproc, precision, compiled, full_ac))

    def hlat() -> None:
        out = tmp_path / f"hlat-{len(ours)}"
        ours.append(run_hlat(data, out, nproc, HLAT_PRECISION[precision], STEPS, *extra))

    benchmark.pedantic(hlat, setup=setup, rounds=int(os.environ.get("HLAT_BENCH_ROUNDS", "1")))
    hlat_tps = max(steady_tokens_per_s(s, nproc) for s in ours)
    peer_tps = max(steady_tokens_per_s(s, nproc) for s in peer)
    benchmark.extra_info.update(
        processes=nproc,
        precision=precision,
        compiled=compiled,
        full_activation_checkpointing=full_ac,
        hlat_tokens_per_s=round(hlat_tps),
        torchtitan_tokens_per_s=round(peer_tps),
        ratio=round(hlat_tps / peer_tps, 3),
    )
    name = f"{nproc} proc, {precision}" + (", compiled" if compiled else "")
    name += ", full activation checkpointing" if full_ac else ""
    print(f"\n[{name}] {benchmark.extra_info}")
