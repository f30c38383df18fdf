"""The ZeRO-1 optimizer step against the optimizer it wraps, in one run: what ZeRO-1 adds on
one rank (cutting this rank's slice out of each parameter, and writing the stepped slice
back), on the Llama shapes of hlat-optim's benchmark (13 layers, 49.5M bf16 parameters),
with ``hlat_optim.AdamW`` in bf16-sr.

One process (a gloo group of one, dp 1): each slice is the whole parameter, so the copies
in and out cover every parameter's bytes; at dp ranks each rank copies 1/dp of them in, and
the all-gather writes the whole parameters back as before.

Run: ``nox -s bench -- packages/hlat-parallel/benchmarks -k zero1``
(``HLAT_BENCH_ROUNDS`` sets the rounds, 5 by default).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from hlat_optim import AdamW
from hlat_parallel import init_parallel, zero1_optimizer

ROUNDS = int(os.environ.get("HLAT_BENCH_ROUNDS", "5"))
STEPS = 10  # optimizer steps per round


def llama_shapes(dim=512, ffn=1376, vocab=8192, layers=13) -> list[tuple[int, ...]]:
    """Embedding, lm_head, final norm and per layer fused qkv, o, gate_up, down, two norms."""
    shapes: list[tuple[int, ...]] = [(vocab, dim), (vocab, dim), (dim,)]
    for _ in range(layers):
        shapes += [(3 * dim, dim), (dim, dim), (2 * ffn, dim), (dim, ffn), (dim,), (dim,)]
    return shapes


def make_params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in llama_shapes():
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(torch.bfloat16)
        params.append(p)
    return params


@pytest.fixture(scope="module")
def dims(tmp_path_factory):
    if not dist.is_initialized():
        path = tmp_path_factory.mktemp("pg") / "store"
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield init_parallel(device="cpu")
    dist.destroy_process_group()


def _seconds_per_step(step) -> float:
    step()  # the first step makes the optimizer state
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - start) / STEPS


def test_zero1_step_against_the_wrapped_optimizer(benchmark, dims, cpu):
    bare_params, zero_params = make_params(), make_params()
    bare = AdamW(bare_params, lr=1e-4, weight_decay=0.1)
    zero = zero1_optimizer(AdamW, zero_params, dims, lr=1e-4, weight_decay=0.1)
    times: dict[str, list[float]] = {"AdamW": [], "ZeRO-1": [], "cut": []}
    for _ in range(ROUNDS):  # interleaved, so drift reaches every peer alike
        times["AdamW"].append(_seconds_per_step(bare.step))
        times["ZeRO-1"].append(_seconds_per_step(zero.step))
        times["cut"].append(_seconds_per_step(zero._refresh))
    best = {name: min(values) * 1e3 for name, values in times.items()}
    benchmark.extra_info.update({f"{k}_ms": v for k, v in best.items()})
    benchmark.extra_info["cpu"] = cpu
    benchmark.pedantic(zero.step, rounds=1, iterations=1)
    n = sum(p.numel() for p in zero_params)
    print(
        f"\nhlat-parallel ZeRO-1 step, {n / 1e6:.1f}M bf16 parameters, bf16-sr, dp 1, "
        f"{torch.get_num_threads()} threads; {cpu}; best of {ROUNDS} rounds of "
        f"{STEPS} steps: AdamW {best['AdamW']:.2f} ms, ZeRO-1 {best['ZeRO-1']:.2f} ms "
        f"({best['ZeRO-1'] / best['AdamW']:.3f}x), of which cutting the slices "
        f"{best['cut']:.2f} ms ({best['cut'] / best['ZeRO-1']:.1%} of the ZeRO-1 step)"
    )
    assert all(torch.isfinite(p).all() for p in zero_params)
