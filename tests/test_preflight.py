"""``hlat-train preflight`` and the ``tools/preflight.py`` script that runs it, for real: one
process, two processes under torchrun (gloo), an s3:// checkpoint URL on the loopback S3
server, and the failures it must name."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hlat_train import preflight

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "preflight.py"
FAST = ["--burn-in-mb", "4", "--burn-in-iters", "2", "--io-mb", "1"]
# the two ways to run the checks: the command, and the script kept for launch scripts
ENTRY = {"command": ["-m", "hlat_train", "preflight"], "script": [str(SCRIPT)]}


@pytest.fixture(params=sorted(ENTRY))
def entry(request) -> list[str]:
    """The arguments after ``python`` (or ``torchrun ...``) that start the checks."""
    return ENTRY[request.param]


def _load_module():
    spec = importlib.util.spec_from_file_location("preflight", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(
    args: list[str], entry: list[str] = ENTRY["command"], **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *entry, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(**env),
        cwd=ROOT,
    )


def _results(path: Path) -> dict[tuple[str, int], dict]:
    return {(c["name"], c["rank"]): c for c in json.loads(path.read_text())}


def test_single_process_passes_every_check_and_cleans_up_its_probe_file(tmp_path, entry):
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "preflight.json"
    r = _run(
        ["--checkpoint-url", str(ckpt), "--json", str(out), *FAST],
        entry,
        MASTER_PORT=str(_free_port()),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed on 1 rank" in r.stdout
    results = _results(out)
    for name in ("devices", "free disk", "rendezvous port", "checkpoint write/read"):
        assert results[(name, 0)]["status"] == "PASS", results[(name, 0)]
    burn_in = results[("all-reduce burn-in", 0)]
    assert burn_in["status"] == "PASS"
    assert burn_in["metrics"]["bytes"] == 4 * 2**20
    assert ckpt.is_dir() and list(ckpt.iterdir()) == []  # the probe file is gone


@pytest.mark.slow
def test_two_ranks_under_torchrun_pass_and_report_bus_bandwidth(tmp_path, entry):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun is installed with torch"
    out = tmp_path / "preflight.json"
    r = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            *entry,
            "--checkpoint-url",
            str(tmp_path / "ckpt"),
            "--json",
            str(out),
            *FAST,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed on 2 ranks" in r.stdout
    results = _results(out)
    for rank in (0, 1):
        for name in ("devices", "free disk", "checkpoint write/read", "all-reduce burn-in"):
            assert results[(name, rank)]["status"] == "PASS", results[(name, rank)]
        # torchrun's own store listens on MASTER_PORT: that holder is allowed
        port = results[("rendezvous port", rank)]
        assert port["status"] == "PASS" and "launcher" in port["detail"], port
    busbw = results[("all-reduce burn-in", 0)]["metrics"]["busbw_gbps"]
    assert busbw > 0
    assert "bus bandwidth" in r.stdout


def test_s3_checkpoint_url_is_written_read_and_cleaned(s3_bucket, tmp_path):
    url, options = s3_bucket
    out = tmp_path / "preflight.json"
    r = _run(
        [
            "--checkpoint-url",
            f"{url}/hlat-7b/ckpt",
            "--storage-options",
            json.dumps(options),
            "--json",
            str(out),
            *FAST,
        ],
        MASTER_PORT=str(_free_port()),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    results = _results(out)
    assert results[("checkpoint write/read", 0)]["status"] == "PASS"
    assert results[("free disk", 0)]["status"] == "SKIP"  # an object store has no local disk
    import s3fs

    assert s3fs.S3FileSystem(**options).find(url) == []


def test_a_listening_socket_on_the_rendezvous_port_fails_and_names_its_holder(entry):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = _run(FAST, entry, MASTER_PORT=str(port))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "check(s) FAILED" in r.stderr
    failed = [line for line in r.stderr.splitlines() if line.startswith("  - ")]
    assert len(failed) == 1, r.stderr
    assert failed[0].startswith("  - rendezvous port")
    assert f"port {port} is held by pid {os.getpid()}" in failed[0]


def test_a_checkpoint_path_under_a_file_fails_both_storage_checks(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    r = _run(["--checkpoint-url", str(blocker / "ckpt"), *FAST], MASTER_PORT=str(_free_port()))
    assert r.returncode == 1
    failed = [line for line in r.stderr.splitlines() if line.startswith("  - ")]
    assert [line.split(" (")[0] for line in failed] == [
        "  - free disk",
        "  - checkpoint write/read",
    ], r.stderr
    assert f"{blocker} is not a directory" in failed[0]


def test_too_little_free_disk_fails_with_the_numbers(tmp_path):
    r = _run(
        ["--checkpoint-url", str(tmp_path), "--min-free-gb", "1e9", *FAST],
        MASTER_PORT=str(_free_port()),
    )
    assert r.returncode == 1
    assert "free disk (rank 0" in r.stderr
    assert "below --min-free-gb 1e+09" in r.stderr


def test_bad_arguments_exit_2_before_any_check(entry):
    r = _run(["--storage-options", "{not json"], entry)
    assert r.returncode == 2
    assert "--storage-options is not valid JSON" in r.stderr
    assert "check" not in r.stdout


def test_the_command_is_listed_and_documents_its_options():
    r = subprocess.run(
        [sys.executable, "-m", "hlat_train", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "preflight" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "hlat_train", "preflight", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0
    assert r.stdout.startswith("usage: hlat-train preflight")
    assert "--min-busbw-gbps" in r.stdout and "--expect-neuron-cores" in r.stdout


def test_the_script_runs_the_command_s_checks():
    script = _load_module()
    assert script.main is preflight.main and script.parse_neuron_ls is preflight.parse_neuron_ls


def test_neuron_ls_json_counts_devices_and_cores():
    two_trn1_devices = json.dumps(
        [
            {"neuron_device": 0, "bdf": "10:1c.0", "nc_count": 2, "memory_size": 34359738368},
            {"neuron_device": 1, "bdf": "10:1d.0", "nc_count": 2, "memory_size": 34359738368},
        ]
    )
    assert preflight.parse_neuron_ls(two_trn1_devices) == (2, 4)
    assert preflight.parse_neuron_ls("[]") == (0, 0)
    with pytest.raises(ValueError, match="expected a list"):
        preflight.parse_neuron_ls('"nothing"')
