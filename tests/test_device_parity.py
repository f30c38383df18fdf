"""tools/device_parity.py run for real on CPU: reference and candidate are both 2-process gloo
runs under torchrun, on a corpus and tokenizer the tool builds, so they must agree bit for
bit; a candidate given another learning rate must be caught at the step and the parameter
where the change first shows; rounding-level differences must pass the fp32 tolerances."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "device_parity.py"
STEPS = 4

pytestmark = [pytest.mark.slow, pytest.mark.parity]


def _load_module():
    spec = importlib.util.spec_from_file_location("device_parity", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _tool(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), "--nproc", "2", "--steps", str(STEPS)]
    done = subprocess.run(
        [*cmd, "--cache-dir", str(cache), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    print(done.stdout, done.stderr)  # shown when a test fails
    return done


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _ranks(side: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (side / "ranks").glob("*.json")}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parity-cache")


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory, cache) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("parity") / "cpu-cpu"
    return _tool(cache, "--device", "cpu", "--backend", "gloo", "--out", str(out)), out


def test_cpu_against_cpu_agrees_bit_for_bit(agreeing):
    done, out = agreeing
    assert done.returncode == 0, done.stdout + done.stderr
    for phase in ("reference run: cpu + gloo", "candidate run: cpu + gloo", "compare: agree"):
        assert phase in done.stdout

    report = _report(out)
    assert report["verdict"] == "agree (bit for bit)"
    assert report["tolerance"]["mode"] == "exact"
    result = report["result"]
    assert result["agree"] and result["differences"] == 0
    assert result["steps_compared"] == STEPS
    assert result["loss"] == {"max_abs_diff": 0.0, "max_rel_diff": 0.0}
    per_rank = result["parameters"]["per_rank"]
    assert set(per_rank) == {"0", "1"}
    for counts in per_rank.values():
        assert counts["compared"] == counts["identical"] > 10  # the whole model, not a few
    for side in ("reference", "candidate"):
        assert report[side]["backend_used"] == "gloo"
        assert report[side]["environment"]["device_type"] == "cpu"
        assert report[side]["environment"]["world_size"] == 2

    # the checksums are of each rank's own shard: data parallelism splits every parameter
    ranks = _ranks(out / "reference")
    first = [ranks[r]["parameters"][0] for r in (0, 1)]
    assert first[0]["name"] == first[1]["name"]
    assert first[0]["shape"][0] * 2 == first[0]["global_shape"][0]
    assert first[0]["sha256"] != first[1]["sha256"]
    markdown = (out / "report.md").read_text()
    assert "**Verdict: agree (bit for bit)**" in markdown
    assert f"| steps compared | {STEPS} |" in markdown


def test_another_learning_rate_is_found_where_it_first_shows(agreeing, cache, tmp_path):
    _, reference = agreeing
    out = tmp_path / "lr"
    done = _tool(
        cache,
        "--device",
        "cpu",
        "--out",
        str(out),
        "--reference-from",
        str(reference),
        "--candidate-override",
        "--optim.lr=3.3e-3",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"reused from {reference / 'reference'}" in done.stdout

    report = _report(out)
    assert report["verdict"] == "disagree (bit for bit)"
    # the warmup starts at lr 0: step 1's update is zero on both sides, so the losses of
    # steps 1 and 2 agree, and step 3 is the first to see the step-2 update
    first = report["result"]["first_step_difference"]
    assert (first["what"], first["step"]) == ("loss", 3)
    assert first["reference"] != first["candidate"]
    assert "step 3 loss: reference" in done.stdout
    param = report["result"]["first_parameter_difference"]
    first_name = _ranks(reference / "reference")[0]["parameters"][0]["name"]
    assert (param["rank"], param["parameter"]) == (0, first_name)
    assert f"rank 0 parameter {first_name}" in (out / "report.md").read_text()

    # a 10 % learning-rate change is also far outside the fp32 tolerances
    parity = _load_module()
    runs = [parity.load_run(reference / "reference"), parity.load_run(out / "candidate")]
    assert not parity.compare(*runs, parity.TOLERANCES["fp32"])["agree"]


def test_rounding_differences_pass_the_tolerances_but_not_bit_for_bit(agreeing, cache, tmp_path):
    _, reference = agreeing
    out = tmp_path / "accumulation"
    # two micro-batches of one row instead of one of two: the same rows, the same update,
    # summed in another order, as another device's kernels would
    done = _tool(
        cache,
        "--device",
        "cpu",
        "--out",
        str(out),
        "--reference-from",
        str(reference),
        "--compare",
        "tolerance",
        "--candidate-override",
        "--data.micro_batch_size=1",
        "--train.global_batch_size=4",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = _report(out)
    assert report["verdict"] == "agree (within fp32 tolerances)"
    assert report["tolerance"] | {"source": None} == {
        "mode": "tolerance",
        "precision": "fp32",
        "rtol": 1e-3,
        "atol": 1e-5,
        "source": None,
    }
    assert 0 < report["result"]["loss"]["max_rel_diff"] < 1e-5

    parity = _load_module()
    runs = [parity.load_run(reference / "reference"), parity.load_run(out / "candidate")]
    exact = parity.compare(*runs, None)
    assert not exact["agree"]
    # the first step's loss may still agree (a forward whose kernels do not depend on the
    # batch size); then its gradient norm is the first to differ
    first = exact["first_step_difference"]
    assert first["what"] in ("loss", "grad_norm")
    assert first["step"] <= 2


def _neuron_present() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_present(), reason="acceptance on a CUDA device: needs one")
@pytest.mark.parametrize("precision", ["fp32", "bf16-sr"])
def test_cuda_candidate_agrees_with_cpu_within_the_precision_tolerances(precision, tmp_path, cache):
    """The acceptance run on a GPU: one process on CUDA with NCCL against one on CPU with
    gloo (one GPU is enough; more processes need one GPU each)."""
    out = tmp_path / precision
    done = _tool(
        cache,
        *("--device", "cuda", "--backend", "nccl", "--nproc", "1", "--out", str(out)),
        *("--override", f"--optim.precision={precision}"),
    )
    assert done.returncode == 0
    report = _report(out)
    assert report["verdict"].startswith("agree")
    assert report["tolerance"]["precision"] == ("fp32" if precision == "fp32" else "bf16")
    assert report["candidate"]["precision"] == precision
    assert report["candidate"]["device"] == "cuda"
    assert report["candidate"]["backend_used"] == "nccl"
    assert report["result"]["agree"] and report["result"]["steps_compared"] == STEPS


USAGE_ERRORS = [
    (["--device", "nosuchdevice"], "has no device of that type"),
    (["--device", "cpu:0"], "give the device type only"),
    (["--device", "cpu", "--backend", "nosuch"], "no 'nosuch' process-group backend"),
    (["--device", "cpu", "--override", "--train.device=cuda"], "train.device is set by"),
    (["--device", "cpu", "--candidate-override", "--optim.lrr=1"], "did you mean 'optim.lr'"),
    (["--device", "cpu", "--override", "--nproc", "2"], "needs one or more --section.key=value"),
    (["--device", "cpu", "--config", "missing.toml"], "missing.toml not found"),
    pytest.param(
        ["--device", "neuron"],
        "pip install 'torch-neuronx==",
        marks=pytest.mark.skipif(_neuron_present(), reason="torch-neuronx is installed"),
    ),
    pytest.param(
        ["--device", "cuda", "--backend", "nccl"],
        "install a CUDA build of torch",
        marks=pytest.mark.skipif(_cuda_present(), reason="a CUDA device is present"),
    ),
]


@pytest.mark.parametrize(("args", "message"), USAGE_ERRORS)
def test_usage_errors_exit_2_before_anything_runs(args, message, tmp_path, capsys):
    parity = _load_module()
    out = tmp_path / "out"
    status = parity.main([*args, "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    assert status == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "cache").exists()
