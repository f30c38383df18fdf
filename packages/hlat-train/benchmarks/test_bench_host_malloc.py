"""``train.host_malloc``: the model's training step with glibc's malloc defaults against
``retain`` (``hlat_train.host_memory``), on a CPU.

Each round runs two fresh processes, one after the other (the policy is process-wide and
cannot be undone), with the C library's defaults and with ``retain``:

- ``test_model_step...``: the bf16 forward + backward of the benchmarks' Llama (vocab 8192,
  width 512, 8 layers, 8 heads, FFN 1376, 4 x 512 tokens), 8 steps; reported: each policy's
  fastest step over all rounds, their ratio, how many rounds ``retain`` won, and the minor
  page faults per step;
- ``test_whole_trainer_step...``: ``hlat-train train`` on that Llama (``bf16-sr``, one
  process, standard-library text), 14 steps; reported: each run's median tokens/s after 4
  steps, and the ratio of each pair.

Run: ``nox -s bench -- packages/hlat-train/benchmarks/test_bench_host_malloc.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hlat_train.host_memory import glibc_available

sys.path.insert(0, str(Path(__file__).parent))
from trainer_runs import make_corpus, run_hlat, steady_tokens_per_s

pytestmark = pytest.mark.skipif(not glibc_available(), reason="glibc's malloc only")

ROUNDS = int(os.environ.get("HLAT_BENCH_ROUNDS", "5"))

STEP = textwrap.dedent(
    """
    import json, resource, sys, time, torch
    from hlat_train.host_memory import resolve_host_malloc
    from hlat_model import Llama, LlamaConfig, cross_entropy_loss

    resolve_host_malloc(sys.argv[1])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, ffn_dim=1376,
                         max_seq_len=512)
    model = Llama(config).to(torch.bfloat16)
    tokens = torch.randint(0, config.vocab_size, (4, 513))

    def step():
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)

    step(), step()  # warm-up
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds = []
    for _ in range(6):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / len(seconds)
    print(json.dumps({"step_s": min(seconds), "faults": faults}))
    """
)


def _run(policy: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", STEP, policy], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_model_step_with_and_without_retained_memory(benchmark):
    system: list[dict[str, float]] = []
    retain: list[dict[str, float]] = []

    def setup() -> None:
        system.append(_run("system"))

    benchmark.pedantic(lambda: retain.append(_run("retain")), setup=setup, rounds=ROUNDS)
    wins = sum(r["step_s"] < s["step_s"] for s, r in zip(system, retain, strict=True))
    fastest = {
        "system": min(r["step_s"] for r in system),
        "retain": min(r["step_s"] for r in retain),
    }
    benchmark.extra_info.update(
        system_step_s=round(fastest["system"], 3),
        retain_step_s=round(fastest["retain"], 3),
        speedup=round(fastest["system"] / fastest["retain"], 3),
        retain_faster_in_rounds=f"{wins}/{len(system)}",
        system_faults_per_step=[round(r["faults"]) for r in system],
        retain_faults_per_step=[round(r["faults"]) for r in retain],
    )
    print(f"\n[host malloc] {benchmark.extra_info}")


TRAINER_STEPS = 14


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The whole-trainer benchmarks' corpus and tokenizer (``trainer_runs.make_corpus``)."""
    return make_corpus(tmp_path_factory.mktemp("host-malloc"))


def _train(corpus: Path, out: Path, policy: str) -> float:
    """Median tokens/s of a one-process ``bf16-sr`` run of ``hlat-train train`` after
    ``trainer_runs.WARMUP`` steps."""
    steps = run_hlat(corpus, out, 1, "bf16-sr", TRAINER_STEPS, f"--train.host_malloc={policy}")
    return steady_tokens_per_s(steps, 1)


def test_whole_trainer_step_with_and_without_retained_memory(benchmark, corpus, tmp_path):
    system: list[float] = []
    retain: list[float] = []

    def setup() -> None:
        system.append(_train(corpus, tmp_path / f"system-{len(system)}", "system"))

    def run() -> None:
        retain.append(_train(corpus, tmp_path / f"retain-{len(retain)}", "retain"))

    benchmark.pedantic(run, setup=setup, rounds=int(os.environ.get("HLAT_BENCH_ROUNDS", "4")))
    benchmark.extra_info.update(
        system_tokens_per_s=[round(t) for t in system],
        retain_tokens_per_s=[round(t) for t in retain],
        retain_vs_system=[round(r / s, 3) for s, r in zip(system, retain, strict=True)],
    )
    print(f"\n[host malloc, hlat-train] {benchmark.extra_info}")
