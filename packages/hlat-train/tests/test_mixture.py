"""A weighted mixture in the trainer: shares and epochs per source in the metrics, a
validation loss per source, exact resume, and a changed mixture refused unless asked for."""

from __future__ import annotations

import pytest
from train_helpers import fit, tiny_config

from hlat_data import DataError
from hlat_train import ConfigError, TrainConfig, read_metrics
from hlat_train.validation import validate


def _sources(corpus, code_weight=3, extra=""):
    return (
        "--data.sources=["
        f'{{name = "code", paths = ["{corpus["train"]}"], weight = {code_weight}, '
        f'valid_paths = ["{corpus["valid"]}"]}}, '
        f'{{name = "small", paths = ["{corpus["valid"]}"], weight = 1{extra}}}]'
    )


def _mixture(corpus, out, sources: str, *extra, steps: int):
    """The tiny config over the mixture ``sources`` (a ``--data.sources`` override)."""
    return tiny_config(
        corpus,
        out,
        "--data.paths=[]",
        "--data.valid_paths=[]",
        "--data.block_size=4",
        sources,
        *extra,
        steps=steps,
    )


def _config(corpus, out, *extra, steps=6, code_weight=3):
    return _mixture(corpus, out, _sources(corpus, code_weight), *extra, steps=steps)


def test_a_mixture_logs_its_shares_validates_per_source_and_resumes_exactly(corpus, tmp_path):
    horizon = "--optim.decay_steps=8"
    fit(_config(corpus, tmp_path / "full", horizon, steps=8))
    records = read_metrics(str(tmp_path / "full" / "metrics.jsonl"))
    train = [r for r in records if r["kind"] == "train"]
    # 8 steps x 2 rows: the code source's share of the rows is 3/4 at every step
    assert train[-1]["data/code/share"] == pytest.approx(0.75)
    assert train[-1]["data/small/share"] == pytest.approx(0.25)
    assert train[-1]["data/small/epoch"] == 0 == train[-1]["data/code/epoch"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert {r.get("source") for r in valid} == {"code"}
    assert [r["step"] for r in valid] == [2, 4, 6, 8]

    fit(_config(corpus, tmp_path / "split", horizon, steps=4))
    summary = fit(_config(corpus, tmp_path / "split", horizon, steps=8))
    assert summary["resumed_from"] == 4
    split = [
        r for r in read_metrics(str(tmp_path / "split" / "metrics.jsonl")) if r["kind"] == "train"
    ]
    assert [r["loss"] for r in split if r["step"] > 4] == pytest.approx(
        [r["loss"] for r in train if r["step"] > 4], rel=1e-5
    )


def test_resuming_under_another_mixture_needs_mixture_change_continue(corpus, tmp_path):
    fit(_config(corpus, tmp_path, steps=2))
    with pytest.raises(DataError, match=r"'code' weight: state has 3.0.*mixture_change"):
        fit(_config(corpus, tmp_path, steps=4, code_weight=1))
    summary = fit(
        _config(corpus, tmp_path, "--data.mixture_change=continue", steps=4, code_weight=1)
    )
    assert summary["resumed_from"] == 2 and summary["step"] == 4


def test_mixture_specs_are_checked_and_round_trip_through_toml(corpus, tmp_path):
    config = _config(corpus, tmp_path)
    again = TrainConfig.from_dict(__import__("tomllib").loads(config.to_toml()))
    assert again.data.sources == config.data.sources
    assert [s.weight for s in again.data.sources] == [3.0, 1.0]
    both = _config(corpus, tmp_path, f'--data.paths=["{corpus["train"]}"]')
    with pytest.raises(ConfigError, match=r"data.paths and data.sources are both set"):
        validate(both)
    with pytest.raises(ConfigError, match=r"unknown key .wieght.*did you mean .weight."):
        _config(corpus, tmp_path, _sources(corpus).replace("weight = 1", "wieght = 1"))
    with pytest.raises(ConfigError, match=r"data.sources\[1\] \(small\): weight must be > 0"):
        validate(_config(corpus, tmp_path, _sources(corpus).replace("weight = 1", "weight = 0")))
    with pytest.raises(ConfigError, match="used twice"):
        validate(_config(corpus, tmp_path, _sources(corpus).replace('"small"', '"code"')))
    with pytest.raises(ConfigError, match="mixture_change must be"):
        validate(_config(corpus, tmp_path, "--data.mixture_change=maybe"))


def _capped(corpus, cap: str) -> str:
    return (
        "--data.sources=["
        f'{{name = "a", paths = ["{corpus["valid"]}"], weight = 1, {cap}}}, '
        f'{{name = "b", paths = ["{corpus["valid"]}"], weight = 1, {cap}}}]'
    )


def _runs_out(corpus, out, *extra):
    settings = ("--checkpoint.every=1000", "--optim.decay_steps=10", *extra)
    return _mixture(corpus, out, _capped(corpus, "epochs = 1"), *settings, steps=5000)


def _saved_steps(out) -> list[int]:
    from hlat_ckpt import Checkpointer

    return [c.step for c in Checkpointer(str(out / "checkpoints"), async_save=False).list()]


def test_a_mixture_that_runs_out_saves_its_last_step_and_ends(corpus, tmp_path, capfd):
    # logged every 1,000 steps: the steps since the last log are read and logged at the end
    summary = fit(_runs_out(corpus, tmp_path, "--logging.every=1000"))
    train = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if r["kind"] == "train"]
    last = summary["step"]
    assert summary["out_of_data"] is True and [r["step"] for r in train] == [last]
    assert 10 < last < 5000
    assert train[-1]["data/a/epoch"] == 0  # the first and only pass of each source
    assert _saved_steps(tmp_path) == [last]  # the steps since the last save are kept
    assert f"the training data ran out after step {last} of train.steps 5000" in (
        capfd.readouterr().err
    )
    # a spike among those steps is rolled back before the end, as at the last step
    spiked = _runs_out(
        corpus,
        tmp_path / "spiked",
        "--logging.every=1000",
        "--checkpoint.every=5",
        "--spike.policy=rollback",
        f"--spike.inject_at=[{last - 1}]",
    )
    again = fit(spiked)
    logged = capfd.readouterr().err
    assert f"loss spike at step {last - 1}: rolled back to step" in logged
    assert again["out_of_data"] is True and _saved_steps(tmp_path / "spiked")[-1] == again["step"]


@pytest.mark.slow
def test_data_parallel_ranks_that_run_out_at_different_steps_end_together(corpus, tmp_path):
    import subprocess

    from train_helpers import torchrun, write_config

    # 8 documents in 2 blocks of 4: each rank reads one block, of its own length
    path = write_config(_runs_out(corpus, tmp_path / "run"), tmp_path / "run.toml")
    proc = torchrun(2, path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    train = [
        r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"
    ]
    assert "the training data ran out after step" in output
    assert _saved_steps(tmp_path / "run") == [train[-1]["step"]]


def test_a_mixture_whose_token_caps_cannot_fill_the_run_is_refused_before_it_starts(
    corpus, tmp_path
):
    # 2 sources of 640 tokens at most: 10 rows of 64 tokens a source, 10 steps of 2 rows
    fits = _mixture(corpus, tmp_path, _capped(corpus, "max_tokens = 640"), steps=10)
    validate(fits, world_size=1)
    fits.train.steps = 11
    with pytest.raises(
        ConfigError, match=r"mixture holds at most 1280 tokens .* train.steps 11 need 1408"
    ):
        validate(fits, world_size=1)
