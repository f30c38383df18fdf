"""``Trainer.generate``: greedy or sampled with temperature and top-k, reproducible by seed,
ending at the first blank line of the continuation."""

from __future__ import annotations

import pytest
import torch
from train_helpers import tiny_config

from hlat_train import ConfigError, Trainer
from hlat_train.validation import validate


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    config = tiny_config(corpus, tmp_path_factory.mktemp("gen"), "--optim.lr=3e-2", steps=8)
    trainer = Trainer(config)
    trainer.fit()
    yield trainer
    trainer.close()


def test_greedy_is_deterministic_and_top_1_sampling_is_greedy(trained):
    greedy = trained.generate("def ", 24, stop_at_blank_line=False)
    assert greedy.startswith("def ") and len(greedy) > len("def ")
    assert trained.generate("def ", 24, stop_at_blank_line=False) == greedy
    top1 = trained.generate("def ", 24, temperature=0.7, top_k=1, seed=5, stop_at_blank_line=False)
    assert top1 == greedy


def test_a_seed_gives_the_same_sample_and_seeds_differ(trained):
    samples = [
        trained.generate("def ", 24, temperature=1.0, seed=s, stop_at_blank_line=False)
        for s in range(4)
    ]
    again = trained.generate("def ", 24, temperature=1.0, seed=0, stop_at_blank_line=False)
    assert again == samples[0]
    assert len(set(samples)) > 1  # a barely trained model spreads its probability


def test_the_sample_ends_at_its_first_blank_line(trained):
    long = [
        trained.generate("def ", 48, temperature=1.5, seed=s, stop_at_blank_line=False)[4:]
        for s in range(6)
    ]
    cut = [trained.generate("def ", 48, temperature=1.5, seed=s)[4:] for s in range(6)]
    for full, short in zip(long, cut, strict=True):
        assert full.startswith(short)
        body = short.lstrip("\n")
        assert "\n\n" not in body
        if "\n\n" in full.lstrip("\n"):
            assert len(short) < len(full)


def test_bad_sampling_settings_are_refused(trained, corpus, tmp_path):
    with pytest.raises(ValueError, match="temperature and top_k"):
        trained.generate("def ", 4, temperature=-1.0)
    for key, value in (("sample_temperature", "-0.5"), ("sample_top_k", "-1")):
        config = tiny_config(corpus, tmp_path, f"--train.{key}={value}")
        with pytest.raises(ConfigError, match=f"train.{key} must be at least 0"):
            validate(config)


class ForcedContinuation(torch.nn.Module):
    """A model whose greedy continuation of a ``prompt_len``-token prompt is ``wanted``,
    then the end-of-sequence token."""

    def __init__(self, prompt_len: int, wanted: list[int], eos_id: int, vocab: int):
        super().__init__()
        self.prompt_len, self.wanted, self.eos_id, self.vocab = prompt_len, wanted, eos_id, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1] - self.prompt_len
        logits = torch.zeros(1, x.shape[1], self.vocab)
        logits[0, -1, self.wanted[n] if n < len(self.wanted) else self.eos_id] = 1.0
        return logits


@pytest.mark.parametrize(
    ("prompt", "continuation"),
    [("import", " os"), ("x =", " 1"), ("if x:\n", "    return 1"), ("def f():\n", "    pass")],
)
def test_the_first_new_word_keeps_its_leading_space(trained, monkeypatch, prompt, continuation):
    tokenizer = trained.tokenizer
    ids, prompt_ids = tokenizer.encode(prompt + continuation), tokenizer.encode(prompt)
    assert ids[: len(prompt_ids)] == prompt_ids
    new = ids[len(prompt_ids) :]
    assert tokenizer.decode(new) == continuation[1:]  # decoded alone, one space is lost
    forced = ForcedContinuation(len(prompt_ids), new, tokenizer.eos_id, tokenizer.vocab_size)
    monkeypatch.setattr(trained, "model", forced)
    assert trained.generate(prompt, 20) == prompt + continuation
