import pytest
import torch

from hlat_model import Llama, LlamaConfig, cross_entropy_loss
from hlat_model.attention import attention, fp32_flash_attention_reason


def _grads(mode: str, dtype: torch.dtype, attention_backend: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    config = LlamaConfig.preset("tiny", n_layers=2, checkpointing=mode, attention=attention_backend)
    model = Llama(config).to(dtype)
    tokens = torch.randint(0, 8192, (2, 65), generator=torch.Generator().manual_seed(1))
    doc_lens = torch.tensor([[30, 34], [64, 0]])
    loss = cross_entropy_loss(model(tokens[:, :-1], doc_lens=doc_lens), tokens[:, 1:])
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


# auto: flash kernels where they run (not recomputed by selective); blocked: the blocked
# kernel with the documents' mask (recomputed)
@pytest.mark.parametrize("attention_backend", ["auto", "blocked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_modes_give_the_gradients_of_no_checkpointing(mode, dtype, attention_backend):
    expected = _grads("none", dtype, attention_backend)
    got = _grads(mode, dtype, attention_backend)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def _kernel_calls(
    mode: str, attention_backend: str, documents: bool, **config: object
) -> dict[str, int]:
    """How often a 2-layer fp32 model's forward and backward call each attention operator."""
    torch.manual_seed(0)
    model = Llama(
        LlamaConfig.preset(
            "tiny", n_layers=2, checkpointing=mode, attention=attention_backend, **config
        )
    )
    tokens = torch.randint(0, 8192, (2, 65), generator=torch.Generator().manual_seed(1))
    doc_lens = torch.tensor([[30, 34], [64, 0]]) if documents else None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = model(tokens[:, :-1], doc_lens=doc_lens)
        cross_entropy_loss(logits, tokens[:, 1:]).backward()
    names = ("hlat::flash_causal_attention", "hlat::blocked_causal_attention")
    return {e.key: e.count for e in prof.key_averages() if e.key in names}


FLASH_CASES = {  # (attention, packed documents, config)
    "auto-causal": ("auto", False, {}),
    "auto-documents": ("auto", True, {}),
    "blocked-causal": ("blocked", False, {}),  # plain causal goes to the flash kernel
    "grouped-heads": ("auto", True, {"n_kv_heads": 2}),
}


@pytest.mark.parametrize(("backend", "documents", "config"), FLASH_CASES.values(), ids=FLASH_CASES)
def test_selective_does_not_recompute_a_flash_kernel(backend, documents, config):
    if (reason := fp32_flash_attention_reason()) is not None:
        pytest.skip(reason)
    once, twice = {"hlat::flash_causal_attention": 2}, {"hlat::flash_causal_attention": 4}
    assert _kernel_calls("none", backend, documents, **config) == once  # once per layer
    assert _kernel_calls("selective", backend, documents, **config) == once
    assert _kernel_calls("full", backend, documents, **config) == twice
    # sequence-first output is copied for the output projection: recomputing frees it
    assert _kernel_calls("selective", backend, documents, sequence_first=True, **config) == twice


def test_selective_recomputes_the_blocked_kernel():
    blocked = "hlat::blocked_causal_attention"
    assert _kernel_calls("none", "blocked", documents=True) == {blocked: 2}
    assert _kernel_calls("selective", "blocked", documents=True) == {blocked: 4}


def test_checkpointing_mode_does_not_change_parameter_names():
    names = {
        m: list(Llama(LlamaConfig.preset("tiny", checkpointing=m)).state_dict())
        for m in ("none", "selective", "full")
    }
    assert names["none"] == names["selective"] == names["full"]


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_sequence_first_blocks_give_the_same_logits_and_gradients(kv_heads):
    results = []
    for sequence_first in (False, True):
        torch.manual_seed(0)
        config = LlamaConfig.preset(
            "tiny", n_layers=2, n_kv_heads=kv_heads, sequence_first=sequence_first
        )
        model = Llama(config)
        tokens = torch.randint(0, 8192, (3, 33), generator=torch.Generator().manual_seed(1))
        logits = model(tokens[:, :-1], doc_lens=torch.tensor([[10, 22], [32, 0], [1, 31]]))
        cross_entropy_loss(logits, tokens[:, 1:]).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (logits_a, grads_a), (logits_b, grads_b) = results
    assert logits_b.shape == logits_a.shape == (3, 32, 8192)
    torch.testing.assert_close(logits_b, logits_a, rtol=1e-5, atol=1e-6)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(("mode", "calls_per_layer"), [("none", 1), ("selective", 2)])
def test_the_swappable_attend_function_computes_attention_in_every_mode(mode, calls_per_layer):
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", n_layers=2, checkpointing=mode))
    tokens = torch.randint(0, 8192, (2, 17), generator=torch.Generator().manual_seed(1))
    expected = model(tokens[:, :-1])
    calls = []

    def doubled(q, k, v, mask):  # a replacement whose effect shows in the logits
        calls.append(q.shape)
        return 2 * attention(q, k, v, mask)

    for block in model.layers:
        block.attention.attend = doubled
    logits = model(tokens[:, :-1])
    cross_entropy_loss(logits, tokens[:, 1:]).backward()  # selective recomputes in backward
    assert len(calls) == 2 * calls_per_layer
    assert not torch.allclose(logits, expected, atol=1e-3)
