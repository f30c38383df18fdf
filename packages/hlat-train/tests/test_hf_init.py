"""Continued pre-training from a Hugging Face Llama directory (``model.init_from_hf``): the
first logits equal transformers' on the same weights, every layout loads the same weights,
each rank reads only what it holds, and a directory of another shape is refused before any
work. The Hugging Face model is a small random GQA Llama built here (no download)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import tiny_config, write_config

from hlat_model.hf import config_to_hf, state_dict_from_hf
from hlat_train import ConfigError, Trainer
from hlat_train.validation import validate

transformers = pytest.importorskip("transformers")
WORKER = Path(__file__).with_name("hf_init_worker.py")
SHAPE = ("--model.n_heads=4", "--model.n_kv_heads=2")


@pytest.fixture(scope="module")
def hf_dir(corpus, tmp_path_factory) -> Path:
    """A random GQA Llama of the tiny-check shape, saved in 4 KB-bounded safetensors shards."""
    out = tmp_path_factory.mktemp("hf")
    llama = validate(tiny_config(corpus, out / "unused", *SHAPE), 1)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_to_hf(llama)))
    model.save_pretrained(out / "model", safe_serialization=True, max_shard_size="40KB")
    assert (out / "model" / "model.safetensors.index.json").exists()
    return out / "model"


def test_first_logits_equal_transformers_on_the_same_weights(corpus, tmp_path, hf_dir):
    config = tiny_config(corpus, tmp_path / "run", *SHAPE, f'--model.init_from_hf="{hf_dir}"')
    trainer = Trainer(config)
    try:
        trainer._setup()
        hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
        ids = torch.randint(0, trainer.llama_config.vocab_size, (2, 24))
        with torch.no_grad():
            ours = trainer.model(ids)
            theirs = hf(ids).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    finally:
        trainer.close()


def test_tp2_x_fsdp2_ranks_load_the_same_weights_reading_only_their_shards(
    corpus, tmp_path, hf_dir
):
    config = tiny_config(
        corpus, tmp_path / "run", *SHAPE, f'--model.init_from_hf="{hf_dir}"', "--parallel.tp=2"
    )
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
        str(WORKER), write_config(config, tmp_path / "run.toml"), str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    llama = validate(config, 4)
    expected = state_dict_from_hf(hf.state_dict(), llama)
    total = sum(v.numel() for v in expected.values())
    reads = []
    for rank in range(4):
        result = torch.load(out / f"rank{rank}.pt")
        for name, value in expected.items():
            torch.testing.assert_close(result["full"][name], value, rtol=0, atol=0)
        # each rank read exactly what it holds: a quarter of the sharded weights, whole norms
        assert result["read"] == result["local"] < total
        reads.append(result["read"])
    norms = sum(v.numel() for k, v in expected.items() if k.endswith("norm.weight"))
    assert sum(reads) < total + 4 * norms  # nothing but the replicated norms read twice


@pytest.mark.parametrize(
    ("change", "needle"),
    [(("--model.n_layers=3",), "its n_layers is 2, the model's is 3"), ((), "no config.json")],
)
def test_a_directory_of_another_shape_or_no_directory_is_refused(
    corpus, tmp_path, hf_dir, change, needle
):
    where = hf_dir if change else tmp_path / "missing"
    config = tiny_config(
        corpus, tmp_path / "run", *SHAPE, *change, f'--model.init_from_hf="{where}"'
    )
    with pytest.raises(ConfigError, match=needle):
        Trainer(config)
    assert not (tmp_path / "run").exists()


def test_a_directory_without_the_head_of_an_untied_model_is_refused(corpus, tmp_path, hf_dir):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    headless = tmp_path / "headless"
    shutil.copytree(hf_dir, headless)
    index = json.loads((headless / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop("lm_head.weight")
    tensors = load_file(str(headless / shard))
    del tensors["lm_head.weight"]
    save_file(tensors, str(headless / shard))
    (headless / "model.safetensors.index.json").write_text(json.dumps(index))
    config = tiny_config(corpus, tmp_path / "run", *SHAPE, f'--model.init_from_hf="{headless}"')
    with pytest.raises(ConfigError, match=r"holds no lm_head.weight, but the model does not tie"):
        Trainer(config)
    assert not (tmp_path / "run").exists()


def test_a_tied_checkpoint_with_another_norm_eps_trains_once_the_model_section_says_so(
    corpus, tmp_path
):
    """A tied Llama with ``rms_norm_eps`` 1e-6 (transformers' default): each difference is
    refused naming the override that matches it, and with both overrides the first logits
    equal transformers'. Tensor parallelism of a tied model is refused before any work."""
    llama = validate(
        tiny_config(corpus, tmp_path / "unused", *SHAPE, "--model.norm_eps=1e-6",
                    "--model.tie_embeddings=true"),
        1,
    )  # fmt: skip
    assert llama.tie_embeddings and llama.norm_eps == 1e-6
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_to_hf(llama))).eval()
    assert hf.config.tie_word_embeddings and hf.config.rms_norm_eps == 1e-6
    hf.save_pretrained(tmp_path / "tied", safe_serialization=True)
    start = (*SHAPE, f'--model.init_from_hf="{tmp_path / "tied"}"')
    for extra, needle in (
        ((), r"its norm_eps is 1e-06, the model's is 1e-05; set model\.norm_eps = 1e-06"),
        (("--model.norm_eps=1e-6",), r"set model\.tie_embeddings = true"),
    ):
        with pytest.raises(ConfigError, match=needle):
            Trainer(tiny_config(corpus, tmp_path / "run", *start, *extra))
        assert not (tmp_path / "run").exists()
    both = (*start, "--model.norm_eps=1e-6", "--model.tie_embeddings=true")
    with pytest.raises(ConfigError, match=r"tie_embeddings = true with parallel\.tp = 2"):
        validate(tiny_config(corpus, tmp_path / "run", *both, "--parallel.tp=2"), 2)
    trainer = Trainer(tiny_config(corpus, tmp_path / "run", *both))
    try:
        trainer._setup()
        ids = torch.randint(0, llama.vocab_size, (2, 24))
        with torch.no_grad():
            torch.testing.assert_close(trainer.model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
        assert trainer.model.lm_head.weight is trainer.model.embed_tokens.weight
    finally:
        trainer.close()
