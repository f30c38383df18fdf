"""Training-step throughput of hlat-model against Hugging Face's LlamaForCausalLM.

Both models have the same shape (8 layers, hidden 512, FFN 1376, vocab 8192, 8 heads) and run
forward + backward on batch 4 x 512 tokens. The peer step runs in the (untimed) setup of every
round, so both see the same machine state; its time is taken by hand. A peer more than
``PEER_ONE_ROUND`` times slower (Hugging Face's bf16 step where the CPU emulates bf16
products: about two minutes on an AVX2-only EPYC) is timed once, after its warm-up. A third
figure is the matrix products alone (the model's own GEMM shapes, forward and backward,
through the same ``Linear`` and through torch's ``nn.Linear``), the ceiling that the rest of
the step (attention, norms, RoPE, loss) eats into.

Run: ``nox -s bench -- packages/hlat-model/benchmarks``. To run what an AVX2-only CPU runs on a
newer one, hold every instruction-set choice to AVX2: ``ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 HLAT_MODEL_CXXFLAGS=-march=x86-64-v3
HLAT_OPTIM_CXXFLAGS=-march=x86-64-v3`` (the core, caches and memory stay the newer CPU's).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from hlat_model import Llama, LlamaConfig, cross_entropy_loss, flops_per_token, linear_cross_entropy
from hlat_model.linear import (
    Linear,
    _Fp32AccumulateLinear,
    cpu_bf16_reason,
    cpu_fp32_onednn_reason,
)
from hlat_model.loss import fuses_head

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 4, 512
CONFIG = dict(vocab_size=8192, dim=512, n_layers=8, n_heads=8, ffn_dim=1376, max_seq_len=SEQ)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ROUNDS = int(os.environ.get("HLAT_BENCH_ROUNDS", "3"))
PEER_ONE_ROUND = 10.0
"""A peer whose step takes this many times ours is timed once, not in every round."""


def _hf_model(dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=CONFIG["vocab_size"],
        hidden_size=CONFIG["dim"],
        intermediate_size=CONFIG["ffn_dim"],
        num_hidden_layers=CONFIG["n_layers"],
        num_attention_heads=CONFIG["n_heads"],
        num_key_value_heads=CONFIG["n_heads"],
        max_position_embeddings=SEQ,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _page_faults(fn) -> int:
    """Minor page faults of one call of ``fn`` (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _shapes(config: LlamaConfig) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of the model."""
    return [
        (config.dim, (config.n_heads + 2 * config.kv_heads) * config.head_dim),
        (config.n_heads * config.head_dim, config.dim),
        (config.dim, 2 * config.ffn_dim),
        (config.ffn_dim, config.dim),
    ] * config.n_layers + [(config.dim, config.vocab_size)]


def _step_flops(config: LlamaConfig) -> tuple[float, float]:
    """FLOPs of one training step of ``BATCH x SEQ`` tokens: the model's (products and
    attention, :func:`flops_per_token`) and its matrix products' alone (what
    :func:`_gemm_step` runs)."""
    tokens = BATCH * SEQ
    return flops_per_token(config, SEQ) * tokens, _gemm_flops(config)


def _gemm_flops(config: LlamaConfig) -> float:
    """FLOPs of :func:`_gemm_step` at ``config``: forward and backward of every linear layer."""
    return 6 * sum(i * o for i, o in _shapes(config)) * BATCH * SEQ


def _gemm_step(config: LlamaConfig, dtype: torch.dtype, path: str = "hlat"):
    """Forward + backward of every linear layer of the model at its real shapes, nothing else,
    through ``path``: hlat-model's ``Linear`` (``"hlat"``), torch's own ``nn.Linear``
    (``"torch"``), or ``Linear``'s fp32-accumulating bf16 path whatever the CPU
    (``"fp32_accumulate"``)."""
    shapes = _shapes(config)
    layers = [
        (torch.nn.Linear(i, o, bias=False) if path == "torch" else Linear(i, o)).to(dtype)
        for i, o in shapes
    ]
    inputs = [torch.randn(BATCH, SEQ, i, dtype=dtype, requires_grad=True) for i, _ in shapes]
    # Note: a dense gradient of each output, as the model's backward gets. The gradient of
    # ``out.sum()`` is one value expanded, which backward's products copy into a contiguous
    # tensor of the transposed layout: the weight gradient's product then reads its first
    # operand untransposed, which ran about twice as fast (bf16, 2-core Xeon with AMX) as
    # the transposed one the model's backward reads; the sum and the copy cost about as
    # much as that saved.
    grads = [torch.randn(BATCH, SEQ, o, dtype=dtype) for _, o in shapes]

    def step() -> None:
        for layer, x, grad in zip(layers, inputs, grads, strict=True):
            if path == "fp32_accumulate":
                _Fp32AccumulateLinear.apply(x, layer.weight).backward(grad)
            else:
                layer(x).backward(grad)
            # Note: gradients set to None, so that every call makes the same products and
            # none adds into the previous call's gradients (a pass over them that the first
            # call does not make, which lowered the ceiling of repeated calls).
            x.grad = layer.weight.grad = None

    return step


def _model_step(model: torch.nn.Module, tokens: torch.Tensor):
    """Forward + backward of ``model`` on ``tokens`` [B, S + 1] (the inputs, and the next
    tokens as labels), its gradients set to None after, so that every call does the same
    work."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        model(inputs, labels=labels).backward()
        model.zero_grad(set_to_none=True)

    return step


@pytest.mark.parametrize("dtype", DTYPES)
def test_train_step_tokens_per_second(benchmark, dtype):
    torch.manual_seed(0)
    torch_dtype = DTYPES[dtype]
    config = LlamaConfig(**CONFIG)
    ours, peer = Llama(config).to(torch_dtype), _hf_model(torch_dtype)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1))
    inputs = tokens[:, :-1]
    ours_step = _model_step(ours, tokens)

    def peer_step() -> None:
        peer(inputs, labels=inputs).loss.backward()  # HF shifts labels itself
        peer.zero_grad(set_to_none=True)

    gemms = _gemm_step(config, torch_dtype)
    peer_times: list[float] = []
    gemm_times: list[float] = []
    ours_step(), peer_step(), gemms()  # warm-up, outside the measurement
    ours_s = _timed(ours_step)
    peer_times.append(_timed(peer_step))
    # emulated bf16 products (AVX2-only CPUs) make the peer's step minutes long: one timing
    # says as much as more would
    peer_every_round = peer_times[0] <= PEER_ONE_ROUND * ours_s

    def setup() -> None:
        if peer_every_round:
            peer_times.append(_timed(peer_step))
        gemm_times.append(_timed(gemms))

    benchmark.pedantic(ours_step, setup=setup, rounds=ROUNDS, iterations=1)
    # torch's own nn.Linear: over one block and the head where its products are emulated too
    native = config if peer_every_round else LlamaConfig(**{**CONFIG, "n_layers": 1})
    native_gemm_time = _timed(_gemm_step(native, torch_dtype, "torch"))

    tokens_per_step = BATCH * SEQ
    ours_tps = tokens_per_step / benchmark.stats.stats.min
    peer_tps = tokens_per_step / min(peer_times)
    model_flops, gemm_flops = _step_flops(config)
    benchmark.extra_info.update(
        tokens_per_s=round(ours_tps),
        hf_tokens_per_s=round(peer_tps),
        speedup_vs_hf=round(ours_tps / peer_tps, 3),
        hf_rounds=len(peer_times),
        model_gflops=round(model_flops / benchmark.stats.stats.min / 1e9, 1),
        matmul_only_gflops=round(gemm_flops / min(gemm_times) / 1e9, 1),
        torch_matmul_gflops=round(_gemm_flops(native) / native_gemm_time / 1e9, 1),
        fraction_of_matmul=round(
            (model_flops / benchmark.stats.stats.min) / (gemm_flops / min(gemm_times)), 3
        ),
        **_paired(benchmark.stats.stats.data, gemm_times, peer_times[1:], model_flops, gemm_flops),
    )
    print(f"\n[{dtype}] {benchmark.extra_info}")


def _paired(
    ours: list[float],
    gemms: list[float],
    peers: list[float],
    model_flops: float,
    gemm_flops: float,
) -> dict[str, float]:
    """The ratios of each round to the products and the peer timed just before it (in its
    setup), their medians: on a machine whose speed moves between rounds (its
    neighbours on a shared host, as on a 2-core Xeon with AMX whose products' rate moved
    widely from one round to the next) the best round of each need not come from the same
    state of the machine, so the ratio of the minima moves with it, while adjacent timings
    share the state."""
    fractions = [(model_flops / t) / (gemm_flops / g) for t, g in zip(ours, gemms, strict=True)]
    paired = {"fraction_of_matmul_paired_median": round(statistics.median(fractions), 3)}
    if len(peers) == len(ours):
        paired["speedup_vs_hf_paired_median"] = round(
            statistics.median(p / t for p, t in zip(peers, ours, strict=True)), 3
        )
    return paired


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_blocks_against_eager(benchmark, dtype):
    """Each block through ``torch.compile`` (``Module.compile``) and the model's
    ``loss_fn`` too (what ``model.compile`` and ``hlat_parallel.compile_blocks`` do) against
    the same model eager, in the same rounds;
    the first compiled step's time (compilation) is reported beside the speed-up, and each
    one's fraction of the matrix products' ceiling (as in the test above, measured in the
    same rounds)."""
    torch.manual_seed(0)
    torch_dtype = DTYPES[dtype]
    config = LlamaConfig(**CONFIG)
    eager = Llama(config).to(torch_dtype)
    compiled = Llama(config).to(torch_dtype)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers:
        block.compile()
    compiled.loss_fn = torch.compile(compiled.loss_fn)
    compiled.loss_fn.hlat_compiled = True  # type: ignore[attr-defined]  # as compile_blocks marks it
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1))
    eager_step, compiled_step = _model_step(eager, tokens), _model_step(compiled, tokens)

    first_s = _timed(compiled_step)
    compiled_step()
    eager_step()
    gemms = _gemm_step(config, torch_dtype)
    gemms()
    eager_times: list[float] = []
    gemm_times: list[float] = []

    def setup() -> None:
        eager_times.append(_timed(eager_step))
        gemm_times.append(_timed(gemms))

    benchmark.pedantic(compiled_step, setup=setup, rounds=ROUNDS, iterations=1)
    tokens_per_step = BATCH * SEQ
    compiled_tps = tokens_per_step / benchmark.stats.stats.min
    eager_tps = tokens_per_step / min(eager_times)
    model_flops, gemm_flops = _step_flops(config)
    ceiling = gemm_flops / min(gemm_times)
    benchmark.extra_info.update(
        compiled_tokens_per_s=round(compiled_tps),
        eager_tokens_per_s=round(eager_tps),
        speedup=round(compiled_tps / eager_tps, 3),
        first_step_s=round(first_s, 1),
        compiled_fraction_of_matmul=round(model_flops / benchmark.stats.stats.min / ceiling, 3),
        eager_fraction_of_matmul=round(model_flops / min(eager_times) / ceiling, 3),
    )
    print(f"\n[{dtype} compiled] {benchmark.extra_info}")


def test_fp32_step_onednn_against_torch_products(benchmark, monkeypatch):
    """The fp32 training step with ``Linear``'s products through oneDNN against the same
    model's with torch's (MKL), alternating in the same rounds, whatever this CPU's rule
    (:func:`cpu_fp32_onednn_reason`, reported) picks: the measurement the rule rests on."""
    import hlat_model.linear as linear_module

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    model = Llama(config)
    train = _model_step(model, torch.randint(0, config.vocab_size, (BATCH, SEQ + 1)))
    rule = cpu_fp32_onednn_reason()

    def step(onednn: bool) -> None:
        monkeypatch.setattr(linear_module, "_CPU_FP32_ONEDNN", "measured" if onednn else None)
        train()

    step(True), step(False)
    torch_times: list[float] = []
    benchmark.pedantic(
        lambda: step(True),
        setup=lambda: torch_times.append(_timed(lambda: step(False))),
        rounds=ROUNDS,
        iterations=1,
    )
    tokens_per_step = BATCH * SEQ
    onednn_tps = tokens_per_step / benchmark.stats.stats.min
    torch_tps = tokens_per_step / min(torch_times)
    benchmark.extra_info.update(
        rule=rule or "torch's products",
        onednn_tokens_per_s=round(onednn_tps),
        torch_tokens_per_s=round(torch_tps),
        onednn_vs_torch=round(onednn_tps / torch_tps, 3),
    )
    print(f"\n[fp32 products] {benchmark.extra_info}")


ATTENTION_SHAPES = {
    "model": (BATCH, CONFIG["n_heads"], SEQ, CONFIG["dim"] // CONFIG["n_heads"]),
    "s1024": (2, 8, 1024, 64),
    "s2048": (1, 8, 2048, 64),
    "s2048-d128": (1, 8, 2048, 128),
}


def _flash_kernel(dtype: str) -> str:
    """Which flash kernel plain causal attention of ``dtype`` runs here, or why none."""
    from hlat_model.attention import (
        amx_attention_reason,
        bf16_flash_attention_reason,
        fp32_flash_attention_reason,
    )

    if dtype == "fp32":
        return fp32_flash_attention_reason() or "on"
    if amx_attention_reason() is None:
        return "on, AMX tiles"
    return bf16_flash_attention_reason() or "on, AVX512-BF16 dot products"


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_kernels(benchmark, dtype, shape, monkeypatch):
    """Causal attention forward + backward: :func:`blocked_causal_attention` (what
    ``attention="auto"`` runs on CPUs: a flash kernel where one runs, bf16 on CPUs with AMX
    tiles or AVX512-BF16, fp32 on CPUs with AVX-512) against the blocked kernel with the
    flash kernels off and torch's ``scaled_dot_product_attention`` (its CPU flash kernel), in
    the same rounds, at the model's shape, at 1,024 and 2,048 tokens, and at 2,048 tokens
    with 7B-sized heads: what ``auto``'s CPU rule
    (:func:`hlat_model.attention.cpu_attention_rule`) is chosen from.
    The benchmark's own figure is the first."""
    import torch.nn.functional as F

    from hlat_model.attention import blocked_causal_attention

    torch.manual_seed(0)
    q, k, v = (
        torch.randn(*ATTENTION_SHAPES[shape], dtype=DTYPES[dtype], requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn_like(q)

    def hlat() -> None:
        blocked_causal_attention(q, k, v).backward(grad)

    def blocked() -> None:
        with monkeypatch.context() as off:  # restores the variable as it was
            off.setenv("HLAT_MODEL_FLASH_ATTENTION", "0")
            blocked_causal_attention(q, k, v).backward(grad)

    def sdpa() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    hlat(), blocked(), sdpa()
    times: dict[str, list[float]] = {"blocked": [], "sdpa": []}

    def setup() -> None:
        times["blocked"].append(_timed(blocked))
        times["sdpa"].append(_timed(sdpa))

    benchmark.pedantic(hlat, setup=setup, rounds=3 * ROUNDS, iterations=1)
    ours = benchmark.stats.stats.min
    benchmark.extra_info.update(
        flash_kernel=_flash_kernel(dtype),
        hlat_ms=round(ours * 1e3, 1),
        blocked_ms=round(min(times["blocked"]) * 1e3, 1),
        sdpa_ms=round(min(times["sdpa"]) * 1e3, 1),
        speedup_vs_blocked=round(min(times["blocked"]) / ours, 2),
        speedup_vs_sdpa=round(min(times["sdpa"]) / ours, 2),
    )
    print(f"\n[{dtype} {shape} attention] {benchmark.extra_info}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_grouped_heads_against_repeated(benchmark, dtype):
    """Causal attention forward + backward of 8 query heads over 2 key and value heads at the
    model's shape: the flash kernel reading the grouped heads as they are (what
    :func:`hlat_model.attention.blocked_causal_attention` gives it) against the same kernel on
    keys and values repeated for each query head, in the same rounds (CPUs where the flash
    kernel of the dtype runs)."""
    from hlat_model.attention import _on_flash_kernel, blocked_causal_attention

    torch.manual_seed(0)
    batch, heads, seq_len, head_dim = ATTENTION_SHAPES["model"]
    kv_heads, torch_dtype = 2, DTYPES[dtype]
    q = torch.randn(batch, heads, seq_len, head_dim, dtype=torch_dtype, requires_grad=True)
    k, v = (
        torch.randn(batch, kv_heads, seq_len, head_dim, dtype=torch_dtype, requires_grad=True)
        for _ in range(2)
    )
    if not _on_flash_kernel(q, k, v):
        pytest.skip(f"no {dtype} flash attention here: {_flash_kernel(dtype)}")
    grad = torch.randn_like(q)

    def grouped() -> None:
        blocked_causal_attention(q, k, v).backward(grad)

    def repeated() -> None:
        group = heads // kv_heads
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        torch.ops.hlat.flash_causal_attention(q, kr, vr)[0].backward(grad)

    peer = _alternating(benchmark, grouped, repeated)
    ours = benchmark.stats.stats.min
    benchmark.extra_info.update(
        grouped_ms=round(ours * 1e3, 2),
        repeated_ms=round(min(peer) * 1e3, 2),
        speedup=round(min(peer) / ours, 3),
    )
    print(f"\n[{dtype} attention, {heads} heads over {kv_heads}] {benchmark.extra_info}")


BLOCK_SIZES = {
    "model": (64, 128, 256),
    "s1024": (128, 256, 512),
    "s2048-d128": (64, 128, 256, 512),
}


@pytest.mark.parametrize(
    "shape, dtype", [(shape, "bf16") for shape in BLOCK_SIZES] + [("model", "fp32")]
)
def test_query_block_sizes(benchmark, shape, dtype, monkeypatch):
    """Blocked attention, forward + backward, with blocks of each size in ``BLOCK_SIZES``
    in the same rounds: what :func:`query_block` is chosen from (the benchmark's own figure
    is the size it picks)."""
    from hlat_model import attention as attention_module

    monkeypatch.setenv("HLAT_MODEL_FLASH_ATTENTION", "0")  # the blocked kernel's own blocks
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(*ATTENTION_SHAPES[shape], dtype=DTYPES[dtype], requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    chosen = attention_module.query_block(q.shape[2], q.dtype)

    def run(block: int) -> None:
        monkeypatch.setattr(attention_module, "query_block", lambda seq_len, dtype=None: block)
        attention_module.blocked_causal_attention(q, k, v).backward(grad)

    times: dict[int, list[float]] = {block: [] for block in BLOCK_SIZES[shape]}
    for block in times:
        run(block)

    def setup() -> None:
        for block in times:
            times[block].append(_timed(lambda block=block: run(block)))

    benchmark.pedantic(lambda: run(chosen), setup=setup, rounds=ROUNDS, iterations=1)
    benchmark.extra_info.update(
        chosen=chosen, **{f"block_{b}_ms": round(min(t) * 1e3, 1) for b, t in times.items()}
    )
    print(f"\n[{shape} {dtype} query blocks] {benchmark.extra_info}")


LOSS_SHAPES = {"model": (BATCH * SEQ, CONFIG["vocab_size"]), "llama2-vocab": (2048, 32000)}


@pytest.mark.parametrize("shape", LOSS_SHAPES)
def test_loss_kernels(benchmark, shape):
    """The loss on bf16 logits, forward + backward, from the LM head's product on: the
    chunked :func:`cross_entropy_loss` against ``F.cross_entropy`` on the fp32 copy of the
    logits (what it replaced), in the same rounds; the LM head's products alone are the
    floor both stand on."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    tokens, vocab = LOSS_SHAPES[shape]
    hidden = torch.randn(tokens, CONFIG["dim"], dtype=torch.bfloat16, requires_grad=True)
    head = Linear(CONFIG["dim"], vocab).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,))

    def chunked() -> None:
        cross_entropy_loss(head(hidden), labels).backward()

    def fp32_copy() -> None:
        F.cross_entropy(head(hidden).float(), labels).backward()

    ones = torch.ones(tokens, vocab, dtype=torch.bfloat16)

    def products() -> None:
        head(hidden).backward(ones)

    chunked(), fp32_copy(), products()
    peers: dict[str, list[float]] = {"fp32_copy": [], "products": []}

    def setup() -> None:
        peers["fp32_copy"].append(_timed(fp32_copy))
        peers["products"].append(_timed(products))

    benchmark.pedantic(chunked, setup=setup, rounds=3 * ROUNDS, iterations=1)
    ours, theirs, floor = benchmark.stats.stats.min, min(peers["fp32_copy"]), min(peers["products"])
    benchmark.extra_info.update(
        chunked_ms=round(ours * 1e3, 1),
        fp32_copy_ms=round(theirs * 1e3, 1),
        products_ms=round(floor * 1e3, 1),
        speedup=round(theirs / ours, 2),
        loss_ms_beside_products=round((ours - floor) * 1e3, 1),
        f_cross_entropy_ms_beside_products=round((theirs - floor) * 1e3, 1),
        # Note: fresh pages cost time (each page fault zeroes 4 KiB): how many each takes
        chunked_page_faults=_page_faults(chunked),
        fp32_copy_page_faults=_page_faults(fp32_copy),
    )
    print(f"\n[{shape} loss] {benchmark.extra_info}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LOSS_SHAPES)
def test_fused_head_against_logits(benchmark, shape, dtype):
    """The LM head and the loss, forward + backward: :func:`linear_cross_entropy` (fused
    where :func:`hlat_model.loss.fuses_head` says so: fp32, and bf16 where the CPU multiplies
    bf16 natively) against the head's product into logits and :func:`cross_entropy_loss` on
    them, in the same rounds."""
    torch.manual_seed(0)
    tokens, vocab = LOSS_SHAPES[shape]
    torch_dtype = DTYPES[dtype]
    hidden = torch.randn(tokens, CONFIG["dim"], dtype=torch_dtype, requires_grad=True)
    head = Linear(CONFIG["dim"], vocab).to(torch_dtype)
    labels = torch.randint(0, vocab, (tokens,))

    def fused() -> None:
        linear_cross_entropy(hidden, head.weight, labels).backward()
        hidden.grad = head.weight.grad = None

    def through_logits() -> None:
        cross_entropy_loss(head(hidden), labels).backward()
        hidden.grad = head.weight.grad = None

    fused(), through_logits()
    peer: list[float] = []
    benchmark.pedantic(
        fused, setup=lambda: peer.append(_timed(through_logits)), rounds=3 * ROUNDS, iterations=1
    )
    ours, theirs = benchmark.stats.stats.median, statistics.median(peer)
    benchmark.extra_info.update(
        fused_path=fuses_head(hidden, head.weight),
        fused_ms=round(ours * 1e3, 1),
        through_logits_ms=round(theirs * 1e3, 1),
        speedup=round(theirs / ours, 2),
        fused_page_faults=_page_faults(fused),
        through_logits_page_faults=_page_faults(through_logits),
    )
    print(f"\n[{shape} {dtype} head + loss] {benchmark.extra_info}")


def _alternating(benchmark, ours, theirs) -> list[float]:
    """``ours`` timed by ``benchmark`` (``3 * ROUNDS`` rounds) and ``theirs`` in each round's
    setup, so the two alternate, after one call of each: the times of ``theirs`` (seconds;
    ours are the benchmark's)."""
    ours(), theirs()
    peer: list[float] = []
    benchmark.pedantic(
        ours, setup=lambda: peer.append(_timed(theirs)), rounds=3 * ROUNDS, iterations=1
    )
    return peer


def _medians(benchmark, peer: list[float]) -> tuple[float, float, str]:
    """The medians of the benchmark's rounds and of ``peer``'s (seconds), and in how many
    rounds the benchmark's was faster."""
    faster = sum(t > o for t, o in zip(peer, benchmark.stats.stats.data, strict=True))
    return benchmark.stats.stats.median, statistics.median(peer), f"{faster} of {len(peer)}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_head_in_the_model_step(benchmark, dtype):
    """The model's training step with its LM head and loss fused (where
    :func:`hlat_model.loss.fuses_head` says so) against the same step through the logits, in
    alternating steps of the same model: a forward hook on the head (one that does nothing)
    sends it through its module and the logits."""
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    model = Llama(config).to(DTYPES[dtype])
    step = _model_step(model, torch.randint(0, config.vocab_size, (BATCH, SEQ + 1)))

    def through_logits() -> None:
        hook = model.lm_head.register_forward_hook(lambda *args: None)
        try:
            step()
        finally:
            hook.remove()

    ours, theirs, faster = _medians(benchmark, _alternating(benchmark, step, through_logits))
    benchmark.extra_info.update(
        fused_path=fuses_head(
            torch.empty(1, config.dim, dtype=DTYPES[dtype]), model.lm_head.weight
        ),
        fused_step_ms=round(ours * 1e3, 1),
        through_logits_step_ms=round(theirs * 1e3, 1),
        speedup=round(theirs / ours, 3),
        fused_faster_in=faster,
    )
    print(f"\n[{dtype} model step, head fused] {benchmark.extra_info}")


def _bf16_flash_or_skip() -> None:
    from hlat_model.attention import bf16_flash_attention_reason

    reason = bf16_flash_attention_reason()
    if reason is not None:
        pytest.skip(f"no bf16 flash attention here: {reason}")


@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_rope_attention_against_heads_and_flash(benchmark, kv_heads):
    """One layer's head split, RoPE and causal attention, forward + backward, at the model's
    shape in bf16 (and with 2 key and value heads for its 8 query heads):
    :func:`hlat_model.attention.rope_flash_attention` (one kernel reading the fused product)
    against the RoPE head split and then the bf16 flash attention, in the same rounds (CPUs
    where the bf16 flash attention runs: AMX or AVX512-BF16). With grouped heads, a third
    form in the same rounds: the two steps with the keys and values repeated for each query
    head (what the flash kernel was given before it read grouped heads)."""
    _bf16_flash_or_skip()
    from hlat_model.attention import blocked_causal_attention, rope_flash_attention
    from hlat_model.model import _HeadsWithRope, rope_cos_sin

    torch.manual_seed(0)
    heads, head_dim = CONFIG["n_heads"], CONFIG["dim"] // CONFIG["n_heads"]
    shape = (BATCH, SEQ, kv_heads, heads // kv_heads + 2, head_dim)
    qkv = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(SEQ)[None], head_dim, 10000.0)
    grad = torch.randn(BATCH, heads, SEQ, head_dim, dtype=torch.bfloat16)

    def fused() -> None:
        rope_flash_attention(qkv, cos, sin).backward(grad)
        qkv.grad = None

    def two_steps() -> None:
        blocked_causal_attention(*_HeadsWithRope.apply(qkv, cos, sin)).backward(grad)
        qkv.grad = None

    def repeated() -> None:
        q, k, v = _HeadsWithRope.apply(qkv, cos, sin)
        group = heads // kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        torch.ops.hlat.flash_causal_attention(q, k, v)[0].backward(grad)
        qkv.grad = None

    peer: list[float] = []
    copies: list[float] = []

    def setup() -> None:
        peer.append(_timed(two_steps))
        if kv_heads < heads:
            copies.append(_timed(repeated))

    fused(), two_steps(), repeated()
    benchmark.pedantic(fused, setup=setup, rounds=3 * ROUNDS, iterations=1)
    ours = benchmark.stats.stats.min
    benchmark.extra_info.update(
        fused_ms=round(ours * 1e3, 2),
        two_steps_ms=round(min(peer) * 1e3, 2),
        speedup=round(min(peer) / ours, 3),
    )
    if copies:
        benchmark.extra_info.update(
            repeated_kv_ms=round(min(copies) * 1e3, 2),
            two_steps_vs_repeated=round(min(copies) / min(peer), 3),
        )
    print(f"\n[bf16 rope + attention, one layer, {kv_heads} kv heads] {benchmark.extra_info}")


def test_rope_attention_prefetch_against_none(benchmark, monkeypatch):
    """One layer's RoPE attention at the model's shape in bf16, forward and backward
    (:func:`hlat_model.attention.rope_flash_attention`, as in the model), with the kernels
    built as shipped against a build without their prefetches of strided rows
    (``HLAT_MODEL_CXXFLAGS=-DHLAT_NO_PREFETCH``), in alternating rounds; forward and
    backward timed apart (CPUs where the bf16 flash attention runs)."""
    _bf16_flash_or_skip()
    from hlat_model import _native
    from hlat_model.attention import rope_flash_attention
    from hlat_model.model import rope_cos_sin

    torch.manual_seed(0)
    heads, head_dim = CONFIG["n_heads"], CONFIG["dim"] // CONFIG["n_heads"]
    qkv = torch.randn(BATCH, SEQ, heads, 3, head_dim, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(SEQ)[None], head_dim, 10000.0)
    grad = torch.randn(BATCH, heads, SEQ, head_dim, dtype=torch.bfloat16)
    shipped = _native.load()
    flags = os.environ.get("HLAT_MODEL_CXXFLAGS", "")
    times: dict[str, list[float]] = {"fwd": [], "bwd": [], "fwd_without": [], "bwd_without": []}

    def layer(lib, suffix: str) -> None:
        _native._state["lib"] = lib  # the kernels the next calls take
        start = time.perf_counter()
        out = rope_flash_attention(qkv, cos, sin)
        middle = time.perf_counter()
        out.backward(grad)
        times["bwd" + suffix].append(time.perf_counter() - middle)
        times["fwd" + suffix].append(middle - start)
        qkv.grad = None

    try:
        monkeypatch.setenv("HLAT_MODEL_CXXFLAGS", f"{flags} -DHLAT_NO_PREFETCH")
        _native.reset()
        without = _native.load()
        assert shipped is not None and without is not None
        assert without._name != shipped._name  # another build, another file
        _alternating(benchmark, lambda: layer(shipped, ""), lambda: layer(without, "_without"))
    finally:
        monkeypatch.setenv("HLAT_MODEL_CXXFLAGS", flags)
        _native.reset()
    median = {name: statistics.median(t[1:]) for name, t in times.items()}  # after a warm-up
    benchmark.extra_info.update(
        fwd_ms=round(median["fwd"] * 1e3, 2),
        fwd_without_prefetch_ms=round(median["fwd_without"] * 1e3, 2),
        bwd_ms=round(median["bwd"] * 1e3, 2),
        bwd_without_prefetch_ms=round(median["bwd_without"] * 1e3, 2),
        fwd_speedup=round(median["fwd_without"] / median["fwd"], 3),
        bwd_speedup=round(median["bwd_without"] / median["bwd"], 3),
    )
    print(f"\n[bf16 rope attention, prefetch] {benchmark.extra_info}")


def test_rope_attention_in_the_model_step(benchmark, monkeypatch):
    """The bf16 model step with the fused RoPE attention against the same step with the head
    split and the attention kernel apart, in alternating steps of the same model (CPUs where
    the bf16 flash attention runs)."""
    _bf16_flash_or_skip()
    import hlat_model.model as model_module

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    model = Llama(config).to(torch.bfloat16)
    step = _model_step(model, torch.randint(0, config.vocab_size, (BATCH, SEQ + 1)))

    def two_steps() -> None:
        with monkeypatch.context() as apart:
            apart.setattr(model_module, "rope_flash_attention_fits", lambda *args: False)
            step()

    ours, theirs, faster = _medians(benchmark, _alternating(benchmark, step, two_steps))
    benchmark.extra_info.update(
        fused_step_ms=round(ours * 1e3, 1),
        two_steps_step_ms=round(theirs * 1e3, 1),
        speedup=round(theirs / ours, 3),
        fused_faster_in=faster,
    )
    print(f"\n[bf16 model step, rope attention] {benchmark.extra_info}")


def test_bf16_flash_attention_in_the_model_step(benchmark, monkeypatch):
    """The bf16 model step with the bf16 flash attention (and its fused RoPE path) against
    the same step with blocked attention (flash kernels off), in alternating steps of the
    same model; on CPUs with AMX, also the flash kernel by AVX512-BF16 dot products (AMX
    tiles off) in the same rounds."""
    _bf16_flash_or_skip()
    from hlat_model.attention import amx_attention_reason

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    model = Llama(config).to(torch.bfloat16)
    step = _model_step(model, torch.randint(0, config.vocab_size, (BATCH, SEQ + 1)))

    def with_env(name: str):
        def run() -> None:
            with monkeypatch.context() as patched:
                patched.setenv(name, "0")
                step()

        return run

    blocked = with_env("HLAT_MODEL_FLASH_ATTENTION")
    ours, theirs, faster = _medians(benchmark, _alternating(benchmark, step, blocked))
    benchmark.extra_info.update(
        flash_kernel=_flash_kernel("bf16"),
        flash_step_ms=round(ours * 1e3, 1),
        blocked_step_ms=round(theirs * 1e3, 1),
        speedup=round(theirs / ours, 3),
        flash_faster_in=faster,
    )
    if amx_attention_reason() is None:
        dots = [_timed(with_env("HLAT_MODEL_AMX_ATTENTION")) for _ in range(5 * ROUNDS)]
        benchmark.extra_info.update(dot_products_step_ms=round(statistics.median(dots) * 1e3, 1))
    print(f"\n[bf16 model step, flash attention] {benchmark.extra_info}")


def _packed_documents(seed: int = 0) -> torch.Tensor:
    """[BATCH, D] lengths of documents packed into rows of ``SEQ`` tokens: lengths drawn
    uniformly from 20 to 400 tokens until the row is full (about 4 documents a row)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(BATCH):
        lens, left = [], SEQ
        while left > 0:
            lens.append(min(left, int(torch.randint(20, 401, (1,), generator=generator))))
            left -= lens[-1]
        rows.append(lens)
    width = max(map(len, rows))
    return torch.tensor([row + [0] * (width - len(row)) for row in rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_document_masking_in_the_model_step(benchmark, dtype, monkeypatch):
    """The model step on packed rows with document masking, its attention on a flash kernel
    with each query's first key (what ``auto`` runs where a flash kernel of the dtype runs),
    against the same step with the flash kernels off (the blocked kernel with the
    block-diagonal mask: what hlat-model 0.23 ran), in alternating steps of the same model;
    and plain causal attention (no documents), timed as many times after them."""
    kernel = _flash_kernel(dtype)
    if not kernel.startswith("on"):
        pytest.skip(f"no {dtype} flash attention here: {kernel}")
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    model = Llama(config).to(DTYPES[dtype])
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1))
    inputs, labels, doc_lens = tokens[:, :-1], tokens[:, 1:], _packed_documents()

    def step() -> None:
        model(inputs, doc_lens=doc_lens, labels=labels).backward()
        model.zero_grad(set_to_none=True)

    def blocked() -> None:
        with monkeypatch.context() as patched:
            patched.setenv("HLAT_MODEL_FLASH_ATTENTION", "0")
            step()

    ours, theirs, faster = _medians(benchmark, _alternating(benchmark, step, blocked))
    causal = [_timed(_model_step(model, tokens)) for _ in range(3 * ROUNDS)]
    benchmark.extra_info.update(
        flash_kernel=kernel,
        documents=int((doc_lens > 0).sum()),
        flash_step_ms=round(ours * 1e3, 1),
        blocked_step_ms=round(theirs * 1e3, 1),
        speedup=round(theirs / ours, 3),
        flash_faster_in=faster,
        causal_step_ms=round(statistics.median(causal) * 1e3, 1),
        documents_vs_causal=round(statistics.median(causal) / ours, 3),
    )
    print(f"\n[{dtype} model step, packed documents] {benchmark.extra_info}")


def _held_at_backward_mib(step, out: Path) -> float:
    """MiB that one call of ``step`` (a forward whose loss it backpropagates inside a
    ``record_function("backward")`` region) has allocated through torch's CPU allocator and
    still holds when that region starts: what the forward keeps for backward, with the loss.
    Profiled once, untimed; measured from the allocator's total before the step's first
    allocation or free (the first memory event's total less its own bytes)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        step()
    prof.export_chrome_trace(str(out))
    events = json.loads(out.read_text())["traceEvents"]
    start = min(e["ts"] for e in events if e.get("name") == "backward")
    memory = sorted(
        (e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"])
        for e in events
        if e.get("name") == "[memory]"
    )
    before = memory[0][1] - memory[0][2]
    return ([total for ts, total, _ in memory if ts <= start][-1] - before) / 2**20


@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_checkpointing_in_the_model_step(benchmark, dtype, tmp_path):
    """The model step with ``checkpointing = "selective"``, whose flash attention kernels are
    not recomputed (``hlat_model.attention.runs_flash_kernel``), against the same model
    recomputing them in backward, with the head split and RoPE apart from the kernel (what
    hlat-model 0.24 ran), in alternating steps; then ``none`` and ``full`` timed as many
    times after them. Each also with the memory its forward holds when backward starts
    (torch's profiler, one untimed step each)."""
    kernel = _flash_kernel(dtype)
    if not kernel.startswith("on"):
        pytest.skip(f"no {dtype} flash attention here: {kernel}")
    torch.manual_seed(0)
    models = {
        mode: Llama(LlamaConfig(**CONFIG, checkpointing=mode)).to(DTYPES[dtype])
        for mode in ("selective", "none", "full")
    }
    for model in models.values():
        model.load_state_dict(models["selective"].state_dict())
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def stepper(model: torch.nn.Module, recompute: bool = False):
        def step() -> None:
            for block in model.layers:
                block.attention.recompute_flash = recompute
            try:
                loss = model(inputs, labels=labels)
                with torch.profiler.record_function("backward"):
                    loss.backward()
            finally:
                for block in model.layers:
                    block.attention.recompute_flash = False
            model.zero_grad(set_to_none=True)

        return step

    ours, recomputing = stepper(models["selective"]), stepper(models["selective"], True)
    ours_s, theirs_s, faster = _medians(benchmark, _alternating(benchmark, ours, recomputing))
    others = {m: [_timed(stepper(models[m])) for _ in range(3 * ROUNDS)] for m in ("none", "full")}
    held = {
        "selective": _held_at_backward_mib(ours, tmp_path / "selective.json"),
        "selective_recomputing": _held_at_backward_mib(recomputing, tmp_path / "recompute.json"),
        **{m: _held_at_backward_mib(stepper(models[m]), tmp_path / f"{m}.json") for m in others},
    }
    benchmark.extra_info.update(
        flash_kernel=kernel,
        selective_step_ms=round(ours_s * 1e3, 1),
        recomputing_step_ms=round(theirs_s * 1e3, 1),
        speedup=round(theirs_s / ours_s, 3),
        selective_faster_in=faster,
        **{f"{m}_step_ms": round(statistics.median(t) * 1e3, 1) for m, t in others.items()},
        **{f"{m}_held_mib": round(mib, 1) for m, mib in held.items()},
    )
    print(f"\n[{dtype} model step, selective checkpointing] {benchmark.extra_info}")


def test_linear_paths_against_the_cpu_rule(benchmark):
    """The two bf16 paths of ``Linear`` (oneDNN's bf16 product, and the fp32-accumulating
    one) and of the attention core (bf16 SDPA, and SDPA on fp32 copies), forward + backward
    at the model's shapes, on this CPU; and which one :func:`cpu_bf16_reason` picks. Run it
    with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` (or ``AVX2``) to see the CPU kinds without bf16
    instructions: oneDNN then uses the kernels it would use there, and the rule (which
    follows that limit) says emulated. Beside them, the fp32 products through
    ``Linear`` (oneDNN's where :func:`cpu_fp32_onednn_reason` says so) and through
    ``nn.Linear`` (torch's, MKL)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    bf16 = torch.bfloat16
    native = _gemm_step(config, bf16, "torch")
    fp32_accumulate = _gemm_step(config, bf16, "fp32_accumulate")
    fp32_hlat = _gemm_step(config, torch.float32, "hlat")
    fp32_torch = _gemm_step(config, torch.float32, "torch")
    q, k, v = (
        torch.randn(BATCH, config.n_heads, SEQ, config.head_dim, dtype=bf16, requires_grad=True)
        for _ in range(3)
    )

    def attention_bf16() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def attention_fp32() -> None:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        out.to(bf16).sum().backward()

    timings: dict[str, float] = {}
    for name, fn in [
        ("attention_bf16", attention_bf16),
        ("attention_fp32", attention_fp32),
        ("linear_fp32_accumulate", fp32_accumulate),
        ("linear_fp32_hlat", fp32_hlat),
        ("linear_fp32_torch", fp32_torch),
    ]:
        fn()
        timings[name] = min(_timed(fn) for _ in range(ROUNDS))
    native()
    benchmark.pedantic(native, rounds=ROUNDS, iterations=1)
    timings["linear_bf16"] = benchmark.stats.stats.min
    rule = cpu_bf16_reason()
    benchmark.extra_info.update(
        onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA", "(all)"),
        rule=rule or "emulated: fp32-accumulating paths",
        **{f"{k}_s": round(v, 4) for k, v in timings.items()},
        linear_bf16_vs_fp32_accumulate=round(
            timings["linear_bf16"] / timings["linear_fp32_accumulate"], 2
        ),
        attention_bf16_vs_fp32=round(timings["attention_bf16"] / timings["attention_fp32"], 2),
        fp32_rule=cpu_fp32_onednn_reason() or "torch's products",
        fp32_torch_vs_hlat=round(timings["linear_fp32_torch"] / timings["linear_fp32_hlat"], 3),
    )
    print(f"\n{benchmark.extra_info}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_cpu_kernels(benchmark, dtype, monkeypatch):
    """RMSNorm and SwiGLU through the fused CPU kernels of ``hlat_model._native`` against
    the same autograd functions on torch's operators (``HLAT_MODEL_NATIVE=0``), in the same
    rounds: one norm ([4, 512, 512]) and one SwiGLU ([4, 512, 2 x 1376]) forward + backward,
    and the whole model step. The benchmark's own figure is the step with the kernels."""
    from hlat_model import _native
    from hlat_model.model import RMSNorm, _SwiGLUFunction

    torch.manual_seed(0)
    torch_dtype = DTYPES[dtype]
    config = LlamaConfig(**CONFIG)
    model = Llama(config).to(torch_dtype)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1))
    norm = RMSNorm(config.dim).to(torch_dtype)
    norm.reset_parameters()
    x = torch.randn(BATCH, SEQ, config.dim, dtype=torch_dtype, requires_grad=True)
    gate_up = torch.randn(BATCH, SEQ, 2 * config.ffn_dim, dtype=torch_dtype, requires_grad=True)
    grad_x, grad_h = torch.randn_like(x), torch.randn(BATCH, SEQ, config.ffn_dim).to(torch_dtype)

    def use(native: bool) -> None:
        _native.reset()
        monkeypatch.setenv("HLAT_MODEL_NATIVE", "1" if native else "0")
        assert (_native.load() is not None) == native, _native.unavailable_reason()

    step = _model_step(model, tokens)

    def norm_pass() -> None:
        norm(x).backward(grad_x)

    def swiglu_pass() -> None:
        _SwiGLUFunction.apply(gate_up, True).backward(grad_h)

    times: dict[str, list[float]] = {}

    def measure(native: bool) -> None:
        use(native)
        for name, fn in (("norm", norm_pass), ("swiglu", swiglu_pass)):
            fn()
            times.setdefault(f"{name}_{native}", []).append(min(_timed(fn) for _ in range(5)))

    def setup() -> None:
        measure(False)
        step()
        times.setdefault("step_False", []).append(_timed(step))
        measure(True)
        step()

    benchmark.pedantic(step, setup=setup, rounds=ROUNDS, iterations=1)
    composed_step = min(times["step_False"])
    benchmark.extra_info.update(
        norm_ms=round(min(times["norm_True"]) * 1e3, 2),
        norm_torch_ops_ms=round(min(times["norm_False"]) * 1e3, 2),
        swiglu_ms=round(min(times["swiglu_True"]) * 1e3, 2),
        swiglu_torch_ops_ms=round(min(times["swiglu_False"]) * 1e3, 2),
        step_ms=round(benchmark.stats.stats.min * 1e3, 1),
        step_torch_ops_ms=round(composed_step * 1e3, 1),
        step_speedup=round(composed_step / benchmark.stats.stats.min, 3),
    )
    _native.reset()
    print(f"\n[{dtype} fused CPU kernels] {benchmark.extra_info}")


FLUSH_BYTES = 256 * 2**20
"""A pass over this much memory before a call evicts its operands from the caches."""


def test_elementwise_kernels_warm_and_flushed(benchmark):
    """The fused kernels between the model's products (SwiGLU and RMSNorm, forward and
    backward, bf16, at the model's shapes) with their operands in the caches (the call
    repeated) and after a pass over :data:`FLUSH_BYTES` (as inside the training step, where
    each activation comes back from memory), beside a copy of SwiGLU's input (11 MiB) into
    an existing tensor on one thread and on all of them: what the passes between the
    products cost at this machine's memory rate. The benchmark's own figure is the warm
    SwiGLU forward; the rest are medians of 20 calls each."""
    from hlat_model import _native

    lib = _native.load()
    if lib is None:
        pytest.skip(f"no fused CPU kernels: {_native.unavailable_reason()}")
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    gate_up = torch.randn(BATCH * SEQ, 2 * CONFIG["ffn_dim"], dtype=bf16)
    grad_h = torch.randn(BATCH * SEQ, CONFIG["ffn_dim"], dtype=bf16)
    x = torch.randn(BATCH * SEQ, CONFIG["dim"], dtype=bf16)
    weight, grad_x = torch.ones(CONFIG["dim"], dtype=bf16), torch.randn_like(x)
    rstd = _native.rms_norm_forward(lib, x, weight, 1e-5)[1]
    copy = torch.empty_like(gate_up)
    flush = torch.zeros(FLUSH_BYTES // 4)
    calls = {
        "swiglu_forward": lambda: _native.swiglu_forward(lib, gate_up, True),
        "swiglu_backward": lambda: _native.swiglu_backward(lib, grad_h, gate_up, True),
        "rms_norm_forward": lambda: _native.rms_norm_forward(lib, x, weight, 1e-5),
        "rms_norm_backward": lambda: _native.rms_norm_backward(lib, grad_x, x, weight, rstd),
        "copy": lambda: copy.copy_(gate_up),
    }

    def median_ms(fn, flushed: bool) -> float:
        times = []
        for _ in range(20):
            if flushed:
                flush.add_(1.0)
            times.append(_timed(fn))
        return round(statistics.median(times) * 1e3, 3)

    threads = torch.get_num_threads()
    figures: dict[str, float] = {}
    for name, fn in calls.items():
        fn()
        figures[f"{name}_warm_ms"] = median_ms(fn, False)
        figures[f"{name}_flushed_ms"] = median_ms(fn, True)
    try:
        torch.set_num_threads(1)
        figures["copy_one_thread_warm_ms"] = median_ms(calls["copy"], False)
        figures["copy_one_thread_flushed_ms"] = median_ms(calls["copy"], True)
    finally:
        torch.set_num_threads(threads)
    moved = 2 * gate_up.numel() * gate_up.element_size()  # read and written
    figures["flushed_copy_gb_per_s_per_thread"] = round(
        moved / figures["copy_one_thread_flushed_ms"] / 1e6, 1
    )
    benchmark.pedantic(calls["swiglu_forward"], rounds=3 * ROUNDS, iterations=1)
    benchmark.extra_info.update(threads=threads, **figures)
    print(f"\n[bf16 kernels, warm and flushed] {benchmark.extra_info}")


def test_residual_add_and_norm(benchmark):
    """A block's residual add and the MLP's norm, forward and backward (the residual
    stream's gradient and the norm's summed), bf16 at the model's shape, each call after a
    pass over :data:`FLUSH_BYTES` (as in the step): :meth:`RMSNorm.add_forward` fused (the
    benchmark's figure) against the add and the module called after it (the composition, the
    fused norm kernel included), alternating in the same rounds."""
    from hlat_model import _native
    from hlat_model.model import RMSNorm

    if _native.load() is None:
        pytest.skip(f"no fused CPU kernels: {_native.unavailable_reason()}")
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    norm = RMSNorm(CONFIG["dim"]).to(bf16)
    norm.reset_parameters()
    x = torch.randn(BATCH, SEQ, CONFIG["dim"], dtype=bf16, requires_grad=True)
    delta = torch.randn_like(x, requires_grad=True)
    grads = [torch.randn_like(x), torch.randn_like(x)]
    flush = torch.zeros(FLUSH_BYTES // 4)

    def fused() -> None:
        torch.autograd.backward(list(norm.add_forward(x, delta)), grads)
        x.grad = delta.grad = norm.weight.grad = None

    def composed() -> None:
        total = x + delta
        torch.autograd.backward([total, norm(total)], grads)
        x.grad = delta.grad = norm.weight.grad = None

    composed_times: list[float] = []

    def setup() -> None:
        flush.add_(1.0)
        composed_times.append(_timed(composed))
        flush.add_(1.0)

    fused(), composed()
    benchmark.pedantic(fused, setup=setup, rounds=10 * ROUNDS, iterations=1)
    fused_median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        fused_median_ms=round(fused_median * 1e3, 3),
        composed_median_ms=round(statistics.median(composed_times) * 1e3, 3),
        speedup=round(statistics.median(composed_times) / fused_median, 3),
    )
    print(f"\n[bf16 residual add and norm] {benchmark.extra_info}")
