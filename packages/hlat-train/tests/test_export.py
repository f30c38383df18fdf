"""`hlat-train export-hf`: a Hugging Face Llama directory from checkpoints of any layout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import tiny_config

from hlat_ckpt import consolidate
from hlat_model import Llama
from hlat_train import ConfigError, Trainer, export_hf

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("export-run")
    config = tiny_config(corpus, out, steps=4)
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return config, out / "checkpoints"


def test_exported_model_loads_in_transformers_with_the_same_logits(trained, tmp_path):
    config, checkpoints = trained
    out = export_hf(str(checkpoints), str(tmp_path / "hf"), dtype="float32")
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    llama = Llama(config.llama_config(384))
    llama.load_state_dict(consolidate(str(checkpoints))["model"])
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, llama(ids), rtol=1e-4, atol=1e-4)


def test_exported_tokenizer_matches_sentencepiece_and_the_model_generates(
    corpus, trained, tmp_path
):
    from hlat_data import Tokenizer

    _, checkpoints = trained
    out = export_hf(str(checkpoints), str(tmp_path / "hf"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    reference = Tokenizer.from_file(corpus["tokenizer"])
    # text that starts with whitespace too: SentencePiece adds its dummy prefix to every text
    texts = ["def main(argv):\n    return 0\n", "  two", "    indented = 1\n", " ", "\tx", ""]
    for text in [*texts, "\n\nx  =  2 ", "é ü 漢字 🙂"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == reference.decode(ids) == text
    assert tokenizer("def", add_special_tokens=True)["input_ids"] == reference.encode("def")
    assert tokenizer.eos_token_id == reference.eos_id
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    prompt = tokenizer("def ", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(generated[0]), str)


def test_a_tp2_checkpoint_exports_like_the_single_process_one(corpus, tmp_path, trained):
    """A checkpoint written at tp=2 by torchrun exports to the same tensors as tp=1."""
    from safetensors.torch import load_file
    from train_helpers import torchrun, write_config

    _, single = trained
    config = tiny_config(corpus, tmp_path / "tp2", "--parallel.tp=2", steps=4)
    proc = torchrun(2, write_config(config, tmp_path / "tp2.toml"), stdout=subprocess.DEVNULL)
    assert proc.wait(timeout=300) == 0
    a = load_file(
        export_hf(str(tmp_path / "tp2" / "checkpoints"), str(tmp_path / "a"), dtype="float32")
        + "/model.safetensors"
    )
    b = load_file(
        export_hf(str(single), str(tmp_path / "b"), dtype="float32") + "/model.safetensors"
    )
    assert set(a) == set(b)
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-5)


def test_each_checkpoint_exports_as_the_model_it_was_trained_as(corpus, tmp_path):
    """A 4-head run saves steps 2 and 4; a new 8-head run in the same directory
    (``checkpoint.resume = false``) saves step 3. Step 4 exports with 4 heads, the root (its
    newest checkpoint, step 3) with 8."""

    def train(*extra: str, steps: int) -> None:
        trainer = Trainer(tiny_config(corpus, tmp_path, *extra, steps=steps))
        try:
            trainer.fit()
        finally:
            trainer.close()

    train(steps=4)
    train("--model.n_heads=8", "--checkpoint.resume=false", "--checkpoint.every=3", steps=3)
    checkpoints = tmp_path / "checkpoints"
    ids = torch.randint(0, 384, (1, 40), generator=torch.Generator().manual_seed(0))
    for source, heads in ((checkpoints / "step_0000000004", 4), (checkpoints, 8)):
        out = export_hf(str(source), str(tmp_path / f"hf-{heads}"), dtype="float32")
        hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
        assert hf.config.num_attention_heads == heads
        llama = Llama(tiny_config(corpus, tmp_path, f"--model.n_heads={heads}").llama_config(384))
        llama.load_state_dict(consolidate(str(source))["model"])
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, llama(ids), rtol=1e-4, atol=1e-4)
    # a checkpoint without its own config (hlat-train before 0.24) takes the root's
    (checkpoints / "step_0000000004" / "hlat-train-config.toml").unlink()
    out = export_hf(str(checkpoints / "step_0000000004"), str(tmp_path / "hf-root"))
    assert transformers.AutoConfig.from_pretrained(out).num_attention_heads == 8


def test_export_of_a_directory_without_a_run_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"hlat-train-config\.toml"):
        export_hf(str(tmp_path), str(tmp_path / "out"))


def test_an_export_to_a_file_or_a_url_is_refused_before_any_work(trained, tmp_path):
    _, checkpoints = trained
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ConfigError, match=r"taken exists and is not a directory"):
        export_hf(str(checkpoints), str(tmp_path / "taken"))
    with pytest.raises(ConfigError, match=r"s3://bucket/hf: the export is written to a local"):
        export_hf(str(checkpoints), "s3://bucket/hf")
    assert (tmp_path / "taken").read_text() == "a file"


def test_export_hf_command_writes_the_directory(trained, tmp_path):
    _, checkpoints = trained
    result = subprocess.run(
        [sys.executable, "-m", "hlat_train", "export-hf", str(checkpoints), str(tmp_path / "cli")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    names = {p.name for p in (tmp_path / "cli").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.model", "tokenizer_config.json"} <= names


def test_a_run_on_a_tokenizer_json_exports_a_fast_tokenizer_that_encodes_the_same(corpus, tmp_path):
    """A Hugging Face byte-level BPE (``tokenizer.json``): the run keeps a copy, and the
    export ships it as a ``PreTrainedTokenizerFast`` with the run's BOS and EOS."""
    import pyarrow as pa
    import tokenizers

    from hlat_data import Tokenizer

    with pa.memory_map(corpus["train"]) as source:
        texts = pa.ipc.open_file(source).read_all().column("text").to_pylist()
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    path = tmp_path / "tokenizer.json"
    bpe.save(str(path))
    config = tiny_config(corpus, tmp_path / "run", f'--data.tokenizer="{path}"', steps=2)
    trainer_ = Trainer(config)
    try:
        trainer_.fit()
    finally:
        trainer_.close()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "tokenizer.json").read_bytes() == path.read_bytes()
    out = export_hf(str(checkpoints), str(tmp_path / "hf"), dtype="float32")
    fast = transformers.AutoTokenizer.from_pretrained(out)
    reference = Tokenizer.from_file(str(path))
    assert isinstance(fast, transformers.PreTrainedTokenizerFast)
    text = "def naïve(x):\n    return x  # ✓ 🙂\n"
    assert fast(text, add_special_tokens=False)["input_ids"] == reference.encode(text)
    assert (fast.bos_token_id, fast.eos_token_id) == (reference.bos_id, reference.eos_id) == (0, 1)
    model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert model.config.eos_token_id == 1 and model.config.vocab_size == 448  # 400 -> x64
    llama = Llama(config.llama_config(reference.vocab_size))
    llama.load_state_dict(consolidate(str(checkpoints))["model"])
    ids = torch.tensor([reference.encode(text)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, llama(ids), rtol=1e-4, atol=1e-4)


def test_a_root_shared_by_runs_of_two_tokenizers_exports_each_checkpoint_with_its_own(
    corpus, tmp_path
):
    """A run on a 384-piece SentencePiece model saves steps 2 and 4; a new run in the same
    directory (``checkpoint.resume = false``) on a 448-piece one saves step 3 and overwrites
    the root's copy of the tokenizer. Each checkpoint exports with the tokenizer it was
    trained with (its own copy) and loads in transformers."""
    from hlat_data import train_tokenizer

    other = train_tokenizer(corpus["train"], str(tmp_path / "other.model"), vocab_size=448)
    for extra, steps in (
        ((), 4),
        ((f'--data.tokenizer="{other}"', "--checkpoint.resume=false", "--checkpoint.every=3"), 3),
    ):
        trainer = Trainer(
            tiny_config(corpus, tmp_path, "--model.vocab_size=0", *extra, steps=steps)
        )
        try:
            trainer.fit()
        finally:
            trainer.close()
    checkpoints = tmp_path / "checkpoints"
    for source, tokenizer, vocab in (
        (checkpoints / "step_0000000004", corpus["tokenizer"], 384),
        (checkpoints, other, 448),
    ):
        out = export_hf(str(source), str(tmp_path / f"hf-{vocab}"), dtype="float32")
        shipped = (tmp_path / f"hf-{vocab}" / "tokenizer.model").read_bytes()
        assert shipped == Path(tokenizer).read_bytes()
        hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
        assert hf.config.vocab_size == hf.model.embed_tokens.weight.shape[0] == vocab


def test_export_refuses_a_tokenizer_of_another_vocabulary_before_writing(corpus, trained, tmp_path):
    from hlat_data import train_tokenizer

    _, checkpoints = trained
    other = train_tokenizer(corpus["train"], str(tmp_path / "other.model"), vocab_size=448)
    with pytest.raises(ConfigError, match=r"its embedding has 384 rows.*448 pieces"):
        export_hf(str(checkpoints), str(tmp_path / "hf"), tokenizer=other)
    assert not (tmp_path / "hf").exists()


def test_a_tied_run_exports_a_tied_model_with_the_same_logits(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path, "--model.tie_embeddings=true", steps=2)
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.close()
    checkpoints = tmp_path / "checkpoints"
    out = export_hf(str(checkpoints), str(tmp_path / "hf"), dtype="float32")
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings
    llama = Llama(config.llama_config(384))
    llama.load_state_dict(consolidate(str(checkpoints))["model"])
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, llama(ids), rtol=1e-4, atol=1e-4)
