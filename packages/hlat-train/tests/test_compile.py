"""``model.compile``: each transformer block through torch.compile, with the same losses as
eager within float rounding, composed with activation checkpointing, document masking,
TP/SP and FSDP2, and with resume."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from train_helpers import tiny_config, torchrun, write_config

from hlat_train import ConfigError, Trainer, read_metrics
from hlat_train.validation import validate

pytestmark = pytest.mark.slow

HORIZON = "--optim.decay_steps=6"
SETTINGS = ("--model.checkpointing=selective", "--data.document_mask=true", HORIZON)


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(str(out / "metrics.jsonl")) if r["kind"] == "train"]


def _fit(config) -> Trainer:
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


@pytest.fixture(scope="module")
def eager(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("eager")
    _fit(tiny_config(corpus, out, *SETTINGS, steps=6))
    return _losses(out)


def test_compiled_blocks_train_like_eager_and_resume(corpus, tmp_path, eager):
    out = tmp_path / "compiled"
    trainer = _fit(tiny_config(corpus, out, *SETTINGS, "--model.compile=true", steps=4))
    compiled = [m for m in trainer.model.modules() if getattr(m, "_compiled_call_impl", None)]
    assert len(compiled) == 2  # the tiny-check model's two blocks
    assert {n.split(".")[0] for n, _ in trainer.model.named_parameters()} == {
        "embed_tokens", "layers", "norm", "lm_head"
    }  # fmt: skip
    _fit(tiny_config(corpus, out, *SETTINGS, "--model.compile=true", steps=6))  # resumes at 4
    assert _losses(out) == pytest.approx(eager, rel=1e-5)


def _torchrun(config, path) -> list[float]:
    proc = torchrun(
        2, write_config(config, path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    return _losses(Path(config.train.out_dir))


def test_compiled_blocks_under_fsdp_match_eager_fsdp(corpus, tmp_path):
    runs = {}
    for name, extra in (("eager", ()), ("compiled", ("--model.compile=true",))):
        config = tiny_config(corpus, tmp_path / name, *SETTINGS, *extra, steps=6)
        runs[name] = _torchrun(config, tmp_path / f"{name}.toml")  # DP2: FSDP2 over 2 ranks
    assert len(runs["compiled"]) == 6
    assert runs["compiled"] == pytest.approx(runs["eager"], rel=1e-5)


@pytest.mark.parametrize("layout", ["--parallel.tp=2", "--parallel.pp=2", "--parallel.cp=2"])
def test_compile_with_model_parallelism_is_refused_before_any_work(corpus, tmp_path, layout):
    config = tiny_config(corpus, tmp_path, "--model.compile=true", layout)
    with pytest.raises(ConfigError, match=r"model\.compile = true with parallel\.tp"):
        validate(config, world_size=4)


def test_compile_on_the_trn1_backend_is_refused_before_any_work(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path, "--model.compile=true", "--parallel.backend=neuron")
    with pytest.raises(ConfigError, match=r"model\.compile = true on parallel\.backend = 'neuron'"):
        validate(config)
