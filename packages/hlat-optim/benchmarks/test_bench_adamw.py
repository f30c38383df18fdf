"""AdamW step throughput on Llama shapes (13 layers: 49.5M parameters), all peers in one run.

Run: ``nox -s bench -- packages/hlat-optim/benchmarks`` or
``python -m pytest packages/hlat-optim/benchmarks --benchmark-only``
(on a shared machine prefix ``OMP_NUM_THREADS=1``: a busy core stalls a 2-thread OpenMP step).
``HLAT_BENCH_DEVICE=cuda`` (or another device type) runs every peer there instead of on the
CPU, with ``layers=`` from ``HLAT_BENCH_LAYERS`` (default 13) and the first step's time
(compilation included) in each row's extra info.

``test_adamw_step_host_time`` times a step of 195 tensors of 64 elements each (the tensor count
of the 32-layer shapes), where the arithmetic is negligible and a step is the host's work:
validating, grouping and issuing the updates.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

from hlat_optim import AdamW, global_norm

DEVICE = torch.device(os.environ.get("HLAT_BENCH_DEVICE", "cpu"))
LAYERS = int(os.environ.get("HLAT_BENCH_LAYERS", "13"))


def llama_shapes(dim=512, ffn=1376, vocab=8192, layers=13):
    """Embedding, lm_head, final norm and per layer fused qkv, o, gate_up, down, two norms."""
    shapes = [(vocab, dim), (vocab, dim), (dim,)]
    for _ in range(layers):
        shapes += [(3 * dim, dim), (dim, dim), (2 * ffn, dim), (dim, ffn), (dim,), (dim,)]
    return shapes


def make_params(dtype):
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in llama_shapes(layers=LAYERS):
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(dtype).to(DEVICE))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(dtype).to(DEVICE)
        params.append(p)
    return params


def bytes_per_param(opt):
    params = [p for group in opt.param_groups for p in group["params"]]
    total = 0
    for p in params:
        tensors = [p, p.grad, *(t for t in opt.state[p].values() if torch.is_tensor(t))]
        total += sum(t.numel() * t.element_size() for t in tensors if t.dim() > 0)
    return total / sum(p.numel() for p in params)


def _torchao_adamw(params):
    optim = pytest.importorskip("torchao.optim", reason="torchao not installed")
    return optim._AdamW(params, lr=1e-3, bf16_stochastic_round=True)


PEERS = {
    "torch fused fp32": (torch.float32, lambda ps: torch.optim.AdamW(ps, fused=True)),
    "torch foreach fp32": (torch.float32, lambda ps: torch.optim.AdamW(ps, foreach=True)),
    "hlat bf16-SR, bf16 states": (torch.bfloat16, lambda ps: AdamW(ps)),
    "hlat bf16-SR, bf16 states, compiled": (
        torch.bfloat16,
        lambda ps: AdamW(ps, impl="compiled"),
    ),
    "hlat bf16-SR, fp32 states": (
        torch.bfloat16,
        lambda ps: AdamW(ps, state_dtype=torch.float32),
    ),
    "hlat bf16 Kahan, bf16 states": (torch.bfloat16, lambda ps: AdamW(ps, kahan_sum=True)),
    "hlat mixed (fp32 master)": (torch.bfloat16, lambda ps: AdamW(ps, master_weights=True)),
    "hlat fp32": (torch.float32, lambda ps: AdamW(ps)),
    "torchao bf16-SR": (torch.bfloat16, _torchao_adamw),
}


def _sync():
    if DEVICE.type != "cpu":
        torch.accelerator.synchronize()


@pytest.mark.parametrize("name", list(PEERS))
def test_adamw_step_throughput(benchmark, optimizer_results, name):
    dtype, build = PEERS[name]
    params = make_params(dtype)
    opt = build(params)
    started = time.perf_counter()
    opt.step()  # compile and allocate state outside the timing
    _sync()
    first_s = time.perf_counter() - started
    opt.step()

    update = opt.step

    def step():
        update()
        _sync()

    benchmark.pedantic(step, rounds=5, iterations=1, warmup_rounds=1)
    n = sum(p.numel() for p in params)
    mparam_s = n / benchmark.stats.stats.min / 1e6
    benchmark.extra_info.update(
        mparam_per_s=round(mparam_s), params=n, tensors=len(params), first_step_s=first_s
    )
    optimizer_results[name] = {
        "mparam_s": mparam_s,
        "bytes_per_param": bytes_per_param(opt),
        "params": n,
        "tensors": len(params),
    }
    del opt, params
    gc.collect()


HOST_PEERS = [
    "torch fused fp32",
    "torch foreach fp32",
    "hlat bf16-SR, bf16 states",
    "hlat bf16-SR, bf16 states, compiled",
]


@pytest.mark.parametrize("name", HOST_PEERS)
def test_adamw_step_host_time(benchmark, host_results, name):
    dtype, build = PEERS[name]
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(195):
        p = torch.nn.Parameter(torch.randn(64, generator=g).to(dtype).to(DEVICE))
        p.grad = (torch.randn(64, generator=g) * 1e-3).to(dtype).to(DEVICE)
        params.append(p)
    opt = build(params)
    for _ in range(3):  # compile and allocate state outside the timing
        opt.step()
    _sync()
    update = opt.step

    def step():
        update()
        _sync()

    benchmark.pedantic(step, rounds=200, iterations=1, warmup_rounds=5)
    host_results[name] = benchmark.stats.stats.median * 1e3


NORM_PEERS = {
    "hlat global_norm": lambda ps: global_norm(ps),
    "three passes (widened copy, squares, sum)": lambda ps: (
        torch.stack([p.detach().float().square().sum() for p in ps]).sum().sqrt()
    ),
    # foreach as torch's clip_grad_norm_ picks it by default: on devices with fused kernels
    "torch get_total_norm": lambda ps: torch.nn.utils.get_total_norm([p.detach() for p in ps]),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_global_norm_against_torch(benchmark, dtype):
    """``global_norm`` of the same Llama's parameters against the three-pass composition it
    replaced and torch's ``get_total_norm`` (what ``clip_grad_norm_`` computes), alternating
    in the same rounds; each one's error against the float64 norm is reported too."""
    params = make_params({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    exact = torch.cat([p.detach().double().flatten() for p in params]).norm().item()
    times: dict[str, list[float]] = {name: [] for name in NORM_PEERS}

    def timed(name: str) -> torch.Tensor:
        started = time.perf_counter()
        norm = NORM_PEERS[name](params)
        _sync()
        times[name].append(time.perf_counter() - started)
        return norm

    def setup() -> None:
        for name in list(NORM_PEERS)[1:]:
            timed(name)

    for name in NORM_PEERS:  # warm-up
        timed(name)
    benchmark.pedantic(lambda: timed("hlat global_norm"), setup=setup, rounds=5, iterations=1)
    ours = min(times["hlat global_norm"])
    for name, fn in NORM_PEERS.items():
        error = abs(fn(params).double().item() - exact) / exact
        benchmark.extra_info[name] = {
            "ms": round(min(times[name]) * 1e3, 2),
            "vs_hlat": round(min(times[name]) / ours, 2),
            "relative_error": f"{error:.1e}",
        }
    print(f"\n[global_norm {dtype}] {benchmark.extra_info}")
