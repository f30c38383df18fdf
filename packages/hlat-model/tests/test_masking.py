"""Packed rows: no token sees another document, positions restart per document."""

import pytest
import torch

from hlat_model import Llama, LlamaConfig
from hlat_model.attention import document_ids, document_positions

DOC_LENS = torch.tensor([[20, 30, 14, 0], [64, 0, 0, 0], [5, 5, 5, 49]])


def _model(**overrides):
    return Llama(LlamaConfig.preset("tiny", n_layers=2, **overrides)).eval()


def test_document_positions_restart_at_every_document():
    pos = document_positions(DOC_LENS, 64)
    assert pos[0].tolist() == list(range(20)) + list(range(30)) + list(range(14))
    assert pos[1].tolist() == list(range(64))
    assert pos[2].tolist() == list(range(5)) * 3 + list(range(49))


def test_tokens_after_the_last_document_form_one_trailing_segment():
    lens = torch.tensor([[3, 2]])
    assert document_ids(lens, 8).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert document_positions(lens, 8).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


# Note: ``auto`` on CPUs is the blocked kernel, or a flash kernel where one runs (fp32 on
# AVX-512 or AVX2 CPUs): each query's first key, not a mask
@pytest.mark.parametrize("attention", ["sdpa", "flex", "blocked", "auto"])
def test_changing_one_document_leaves_the_others_bit_identical(attention):
    model = _model(attention=attention)
    tokens = torch.randint(0, 8192, (3, 64))
    changed = tokens.clone()
    changed[0, 20:50] = torch.randint(0, 8192, (30,))  # document 1 of row 0
    with torch.no_grad():
        a, b = model(tokens, doc_lens=DOC_LENS), model(changed, doc_lens=DOC_LENS)
    assert torch.equal(a[0, :20], b[0, :20])
    assert torch.equal(a[0, 50:], b[0, 50:])
    assert torch.equal(a[1:], b[1:])
    assert not torch.allclose(a[0, 20:50], b[0, 20:50])


def test_a_packed_document_gets_the_logits_it_would_get_alone():
    model = _model(attention="sdpa")
    tokens = torch.randint(0, 8192, (1, 64))
    with torch.no_grad():
        packed = model(tokens, doc_lens=torch.tensor([[20, 44]]))
        alone = model(tokens[:, 20:])
    torch.testing.assert_close(packed[:, 20:], alone, rtol=1e-5, atol=1e-5)


def test_flex_and_sdpa_document_masking_agree():
    tokens = torch.randint(0, 8192, (3, 64))
    sdpa = _model(attention="sdpa")
    flex = _model(attention="flex")
    flex.load_state_dict(sdpa.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            flex(tokens, doc_lens=DOC_LENS), sdpa(tokens, doc_lens=DOC_LENS), rtol=1e-5, atol=1e-5
        )


def test_flex_attention_refuses_to_train_on_cpu_before_any_work():
    model = _model(attention="flex").train()
    calls: list[int] = []
    model.embed_tokens.register_forward_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, 8192, (3, 64))
    with pytest.raises(ValueError, match=r"attention='flex' cannot train on CPU.*'blocked'"):
        model(tokens, doc_lens=DOC_LENS, labels=tokens)
    assert calls == []
    with torch.no_grad():  # inference runs
        assert model(tokens, doc_lens=DOC_LENS).isfinite().all()


def test_one_document_per_row_equals_plain_causal_attention():
    model = _model(attention="sdpa")
    tokens = torch.randint(0, 8192, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens, doc_lens=torch.tensor([[64], [64]])), model(tokens), rtol=1e-5, atol=1e-5
        )
