"""``model.compile``: each transformer block through torch.compile, with the same losses as
eager within float rounding, composed with activation checkpointing, document masking,
TP/SP and FSDP2, and with resume."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from train_helpers import tiny_config, torchrun, write_config

from hlat_train import ConfigError, Trainer, read_metrics
from hlat_train.validation import compiled_tp_checkpoints_fail, validate

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


@pytest.mark.compile
def test_compiled_blocks_train_like_eager_and_resume(corpus, tmp_path, eager):
    out = tmp_path / "compiled"
    trainer = _fit(tiny_config(corpus, out, *SETTINGS, "--model.compile=true", steps=4))
    compiled = [m for m in trainer.model.modules() if getattr(m, "_compiled_call_impl", None)]
    assert len(compiled) == 2  # the tiny-check model's two blocks
    assert trainer.model.loss_fn.hlat_compiled  # and its loss (fp32: the fused head runs)
    assert {n.split(".")[0] for n, _ in trainer.model.named_parameters()} == {
        "embed_tokens", "layers", "norm", "lm_head"
    }  # fmt: skip
    trainer = _fit(tiny_config(corpus, out, *SETTINGS, "--model.compile=true", steps=6))
    assert _losses(out) == pytest.approx(eager, rel=1e-5)  # it resumed at 4
    # sampling runs the compiled blocks eager: every new length would be another graph
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    text = trainer.generate("def ", 6, stop_at_blank_line=False)
    assert text.startswith("def ") and len(text) > len("def ")
    assert counters["stats"]["unique_graphs"] == graphs > 0


def _torchrun(config, path, nproc: int = 2) -> list[float]:
    proc = torchrun(
        nproc,
        write_config(config, path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    return _losses(Path(config.train.out_dir))


TP_SP = ("--parallel.tp=2", "--parallel.sp=true")


# name: (settings, ranks); every layout keeps two data-parallel ranks, so all read the same data.
# Compiled blocks under FSDP2 alone are the dp2 part of the four-rank layout.
LAYOUTS = {
    "tp2-sp-x-dp2-fsdp2": (TP_SP, 4),
    # the blocked kernel, which selective checkpointing recomputes (a flash kernel, auto's
    # choice on CPUs that have one, it does not)
    "tp2-sp-x-dp2-fsdp2-blocked": ((*TP_SP, "--model.attention=blocked"), 4),
}
if not compiled_tp_checkpoints_fail():  # this torch compiles it with SDPA too
    LAYOUTS["tp2-sp-x-dp2-fsdp2-sdpa"] = ((*TP_SP, "--model.attention=sdpa"), 4)


@pytest.fixture(scope="module")
def eager_dp2(corpus, tmp_path_factory):
    """The losses of eager FSDP2 over two ranks with an attention kernel, run once per kernel:
    the reference of every compiled layout below."""
    runs: dict[str, list[float]] = {}

    def losses(attention: str) -> list[float]:
        if attention not in runs:
            out = tmp_path_factory.mktemp(f"eager-dp2-{attention}")
            config = tiny_config(
                corpus, out / "run", *SETTINGS, f"--model.attention={attention}", steps=6
            )
            runs[attention] = _torchrun(config, out / "run.toml")
        return runs[attention]

    return losses


@pytest.mark.compile
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_compiled_blocks_under_parallelism_match_eager(corpus, tmp_path, eager_dp2, layout):
    """Four ranks: TP2 with sequence parallelism (the embedding's output reduced
    asynchronously into the first compiled block) times FSDP2 over DP2; selective
    checkpointing and document masking, ``auto``'s attention (a flash kernel on CPUs that
    have one, else the blocked kernel), the blocked kernel in the checkpointed region of
    each compiled block, or SDPA there where this torch compiles it under TP. The compiled
    run's losses are those of eager FSDP2 over two ranks within 1e-4 relative, as for eager
    TP against one process (``test_distributed.py``): tensor parallelism reassociates the
    sums."""
    settings, nproc = layout
    compiled = _torchrun(
        tiny_config(
            corpus, tmp_path / "run", *SETTINGS, *settings, "--model.compile=true", steps=6
        ),
        tmp_path / "run.toml",
        nproc,
    )
    named = [s.split("=", 1)[1] for s in settings if s.startswith("--model.attention=")]
    attention = named[0] if named else "auto"
    assert len(compiled) == 6
    assert compiled == pytest.approx(eager_dp2(attention), rel=1e-4)


@pytest.mark.parametrize("layout", ["--parallel.pp=2", "--parallel.cp=2"])
def test_compile_with_pipeline_or_context_parallelism_is_refused_before_any_work(
    corpus, tmp_path, layout
):
    config = tiny_config(corpus, tmp_path, "--model.compile=true", layout)
    with pytest.raises(ConfigError, match=r"model\.compile = true with parallel\.pp"):
        validate(config, world_size=4)


def test_compile_with_tp_and_selective_checkpointing_is_refused_where_torch_fails_it(
    corpus, tmp_path
):
    """SDPA in a checkpointed region of a compiled TP block fails on torch 2.13; the blocked
    kernel (``auto`` on CPUs without a flash kernel, or named) compiles (the test above runs
    it)."""
    sdpa = tiny_config(
        corpus, tmp_path, "--model.compile=true", *SETTINGS, *TP_SP, "--model.attention=sdpa"
    )
    if compiled_tp_checkpoints_fail():
        with pytest.raises(ConfigError, match=r"model\.checkpointing = 'selective' on torch"):
            validate(sdpa, world_size=2)
    else:
        validate(sdpa, world_size=2)
    for kernel in ("auto", "blocked"):
        validate(
            tiny_config(
                corpus,
                tmp_path,
                "--model.compile=true",
                *SETTINGS,
                *TP_SP,
                f"--model.attention={kernel}",
                "--train.device=cpu",
            ),
            world_size=2,
        )
    for mode in ("full", "none"):  # the SDPA layout compiles with these
        validate(
            tiny_config(
                corpus,
                tmp_path,
                "--model.compile=true",
                *TP_SP,
                f"--model.checkpointing={mode}",
                "--model.attention=sdpa",
            ),
            world_size=2,
        )


def test_compile_on_the_trn1_backend_is_refused_before_any_work(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path, "--model.compile=true", "--parallel.backend=neuron")
    with pytest.raises(ConfigError, match=r"model\.compile = true on parallel\.backend = 'neuron'"):
        validate(config)
