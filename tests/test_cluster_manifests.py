"""The cluster recipes in docs/cluster parse, carry the fields a cluster needs, and agree with
the hlat-train TOML preset they name (nodes, NeuronCores, TP, DP, global batch, environment)."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "docs" / "cluster"
PRESETS = ROOT / "packages" / "hlat-train" / "src" / "hlat_train" / "presets"
CORES_PER_NODE = 32  # trn1.32xlarge: 16 Trainium devices x 2 NeuronCores
DEVICES_PER_NODE = 16
EFA_PER_NODE = 8
TORCHRUN_SHUTDOWN_S = 30  # torchrun's wait for its workers after passing them a SIGTERM
SBATCH = sorted((CLUSTER / "slurm").glob("*.sbatch"))
MANIFESTS = sorted((CLUSTER / "eks").glob("*.yaml"))


def _preset(name: str) -> dict:
    path = PRESETS / f"{name}.toml"
    assert path.exists(), f"the recipe names preset {name!r}, which hlat-train does not ship"
    with open(path, "rb") as f:
        return tomllib.load(f)


def _after(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag value`` or ``--flag=value``)."""
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _check_training_command(args: list[str], nodes: int, file: Path) -> dict:
    """Checks a ``torchrun ... -m hlat_train train --config P ...`` command against preset P
    on ``nodes`` trn1.32xlarge nodes; returns the preset."""
    assert "torchrun" in Path(args[0]).name, args
    m = args.index("-m")
    launcher, program = args[:m], args[m + 1 :]
    assert program[:2] == ["hlat_train", "train"], program
    preset_name = _after(program, "--config")
    assert preset_name and file.name.startswith(preset_name), (file.name, preset_name)
    preset = _preset(preset_name)
    overrides = dict(a[2:].split("=", 1) for a in program[2:] if a.startswith("--") and "=" in a)

    def value(key: str, default: object) -> str:
        section, field = key.split(".")
        return overrides.get(key, str(preset.get(section, {}).get(field, default)))

    assert int(_after(launcher, "--nproc-per-node") or 0) == CORES_PER_NODE
    assert int(_after(launcher, "--max-restarts") or 0) >= 1, "faults need torchrun restarts"
    assert _after(launcher, "--rdzv-backend") == "c10d"
    tp = int(value("parallel.tp", 1))
    assert tp == preset["parallel"]["tp"], "the recipe must not change the preset's TP"
    assert CORES_PER_NODE % tp == 0
    dp = nodes * CORES_PER_NODE // tp
    assert int(value("parallel.nodes", 0)) in (0, nodes)
    assert int(value("parallel.dp", 0)) in (0, dp)
    for key, expected in (("parallel.nodes", nodes), ("parallel.dp", dp)):
        preset_value = preset["parallel"].get(key.split(".")[1], 0)
        assert preset_value in (0, expected), f"{key}: preset {preset_value}, recipe {expected}"
    assert value("parallel.backend", "auto") == "neuron"
    global_batch = int(value("train.global_batch_size", 0))
    assert global_batch == preset["train"]["global_batch_size"]
    micro = int(value("data.micro_batch_size", 1))
    assert global_batch % (micro * dp) == 0, f"{global_batch} not a multiple of {micro} x {dp}"
    return preset


def _neuron_env(cache_dir: str, preset: dict) -> dict[str, str]:
    neuron = pytest.importorskip("hlat_train.neuron")
    from hlat_train.config import NeuronConfig

    precision = preset["optim"]["precision"]
    return neuron.neuron_env(NeuronConfig(cache_dir=cache_dir), precision, multi_node=True)


# --- Slurm --------------------------------------------------------------------------------


def _shell_commands(text: str) -> list[list[str]]:
    """Each command of a simple shell script, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    commands = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            commands.append(shlex.split(line, comments=True))
    return commands


def test_there_is_an_sbatch_recipe_for_hlat_7b():
    assert [p.name for p in SBATCH] == ["hlat-7b.sbatch"]


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_trains_the_preset_it_names_on_its_nodes(path):
    text = path.read_text()
    assert text.startswith("#!/bin/bash\n")
    directives = dict(
        re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?", line).groups()  # type: ignore[union-attr]
        for line in text.splitlines()
        if line.startswith("#SBATCH ")
    )
    nodes = int(directives["nodes"])
    assert directives["ntasks-per-node"] == "1", "one torchrun per node"
    assert "exclusive" in directives
    trainings = [
        c[c.index("torchrun") :]
        for c in _shell_commands(text)
        if "hlat_train" in c and c[0] == "srun"
    ]
    assert len(trainings) == 1
    args = trainings[0]
    assert _after(args, "--nnodes") in ("$SLURM_JOB_NUM_NODES", str(nodes))
    _check_training_command(args, nodes, path)


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_sets_the_recipe_neuron_environment(path):
    commands = _shell_commands(path.read_text())
    variables = {}
    for c in commands:
        words = c[1:] if c[0] == "export" else c
        if len(words) == 1 and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            name, value = words[0].split("=", 1)
            variables[name] = value
    training = next(c for c in commands if "hlat_train" in c)
    preset = _preset(_after(training, "--config") or "")
    cache = variables["LOCAL_CACHE"]
    assert _after(training, "--neuron.cache_dir") == "$LOCAL_CACHE"
    for name, expected in _neuron_env(cache, preset).items():
        assert variables.get(name) == expected, name


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_runs_preflight_on_every_node_before_training(path):
    commands = _shell_commands(path.read_text())
    order = [i for i, c in enumerate(commands) if any("preflight.py" in w for w in c)]
    training = next(i for i, c in enumerate(commands) if "hlat_train" in c)
    assert order and order[0] < training
    preflight = commands[order[0]]
    assert _after(preflight, "--expect-neuron-cores") == str(CORES_PER_NODE)
    # the burn-in must not rendezvous on the port the training job is about to use
    assert _after(preflight, "--rdzv-endpoint") != _after(commands[training], "--rdzv-endpoint")


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_the_documented_submission_creates_the_log_directory_first(path):
    # Slurm does not create the directory of --output; a job without it fails with no log
    output = next(
        line.split("=", 1)[1]
        for line in path.read_text().splitlines()
        if line.startswith("#SBATCH --output=")
    )
    doc = (CLUSTER / "slurm.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", doc, flags=re.S)
    commands = [c for b in blocks for c in _shell_commands(b)]
    submit = next(
        i for i, c in enumerate(commands) if c[:2] == ["sbatch", f"docs/cluster/slurm/{path.name}"]
    )
    created = [c[2:] for c in commands[:submit] if c[:2] == ["mkdir", "-p"]]
    assert any(str(Path(output).parent) in dirs for dirs in created), commands[: submit + 1]


def test_the_precompile_command_runs_the_training_jobs_nodes_and_layout():
    # neuron_parallel_compile caches the graphs of the command it runs; the DP degree changes
    # them (gradient all-reduce groups, ZeRO-1 shards), so one node's graphs miss at 64 nodes
    doc = (CLUSTER / "compile-cache.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", doc, flags=re.S)
    compiles = [c for b in blocks for c in _shell_commands(b) if "neuron_parallel_compile" in c]
    assert len(compiles) == 1
    compile_args = compiles[0]
    assert compile_args[0] == "srun" and _after(compile_args, "--ntasks-per-node") == "1"
    torchrun = compile_args[compile_args.index("neuron_parallel_compile") + 1 :]
    (sbatch,) = SBATCH
    training = next(c for c in _shell_commands(sbatch.read_text()) if "hlat_train" in c)
    training = training[training.index("torchrun") :]
    for flag in ("--nnodes", "--nproc-per-node", "--config", "--parallel.backend",
                 "--parallel.nodes", "--parallel.dp", "--data.tokenizer"):  # fmt: skip
        assert _after(torchrun, flag) == _after(training, flag), flag
    assert int(_after(torchrun, "--train.steps") or 0) > 0, "a few steps, not the whole run"


# --- EKS ----------------------------------------------------------------------------------


def test_there_is_a_pytorchjob_for_each_trn1_preset():
    assert [p.name for p in MANIFESTS] == [
        "hlat-7b-pytorchjob.yaml",
        "llama2-7b-trn1-128-pytorchjob.yaml",
    ]


def _load(path: Path) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_pytorchjob_requests_whole_trn1_nodes_with_efa(path):
    job = _load(path)
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert job["kind"] == "PyTorchJob"
    assert job["metadata"]["name"]
    spec = job["spec"]
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}, "elastic jobs have workers only"
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "OnFailure"
    pod = worker["template"]["spec"]
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == "trn1.32xlarge"
    (container,) = pod["containers"]
    for kind in ("requests", "limits"):
        resources = container["resources"][kind]
        assert resources["aws.amazon.com/neuron"] == DEVICES_PER_NODE
        assert resources["vpc.amazonaws.com/efa"] == EFA_PER_NODE
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["fsx"]["persistentVolumeClaim"]["claimName"]
    assert mounts["fsx"] == "/fsx"
    for arg in container["command"]:
        for prefix in ("--data.paths=", "--checkpoint.dir=", "--data.tokenizer="):
            if arg.startswith(prefix):
                assert arg[len(prefix) :].startswith("/fsx/"), arg


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_pytorchjob_trains_the_preset_it_names_on_its_replicas(path):
    job = _load(path)
    spec = job["spec"]
    nodes = spec["pytorchReplicaSpecs"]["Worker"]["replicas"]
    elastic = spec["elasticPolicy"]
    assert elastic["minReplicas"] == elastic["maxReplicas"] == nodes
    assert elastic["maxRestarts"] >= 1
    assert int(spec["nprocPerNode"]) == CORES_PER_NODE
    (container,) = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    args = [str(a) for a in container["command"]]
    assert int(_after(args, "--nnodes") or 0) == nodes
    assert _after(args, "--rdzv-endpoint") == f"{job['metadata']['name']}-worker-0:29500"
    assert int(_after(args, "--max-restarts") or 0) == elastic["maxRestarts"]
    preset = _check_training_command(args, nodes, path)
    env = {e["name"]: str(e["value"]) for e in container["env"]}
    cache = _after(args, "--neuron.cache_dir") or ""
    assert cache
    for name, expected in _neuron_env(cache, preset).items():
        assert env.get(name) == expected, name
    # in a container, the Neuron collectives bootstrap on the pod's interface (NxD's scripts)
    assert env.get("CCOM_SOCKET_IFNAME") == "eth0"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_pytorchjob_gives_a_preempted_pod_time_to_save_and_exit(path):
    # SIGKILL follows SIGTERM after terminationGracePeriodSeconds (30 s when unset); torchrun,
    # the container's main process, passes the SIGTERM on and waits 30 s for its workers,
    # whose save must fit checkpoint.preempt_budget (docs/cluster/preemption.md)
    config = pytest.importorskip("hlat_train.config")
    pod = _load(path)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    args = [str(a) for a in container["command"]]
    assert Path(args[0]).name == "torchrun"
    preset = _preset(_after(args, "--config") or "")
    budget = float(
        _after(args, "--checkpoint.preempt_budget")
        or preset.get("checkpoint", {}).get("preempt_budget")
        or config.CheckpointConfig().preempt_budget
    )
    assert 0 < budget < TORCHRUN_SHUTDOWN_S < pod.get("terminationGracePeriodSeconds", 30)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_pytorchjob_copies_the_compile_cache_to_local_disk_first(path):
    pod = _load(path)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (init,) = pod["initContainers"]
    script = " ".join(init["command"])
    (container,) = pod["containers"]
    cache = _after([str(a) for a in container["command"]], "--neuron.cache_dir") or ""
    assert "/fsx/" in script and cache in script
    local = {m["mountPath"] for m in init["volumeMounts"]}
    assert cache in local
    volumes = {v["name"]: v for v in pod["volumes"]}
    local_volume = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == cache)
    assert "persistentVolumeClaim" not in volumes[local_volume], "the cache must be node-local"


def test_docs_link_every_recipe_file():
    text = "\n".join(p.read_text() for p in CLUSTER.glob("*.md"))
    for path in (*SBATCH, *MANIFESTS):
        assert str(path.relative_to(CLUSTER)) in text, path
    for page in ("slurm.md", "eks.md", "compile-cache.md", "storage.md", "cost.md"):
        assert (CLUSTER / page).exists(), page
        assert page in (CLUSTER / "README.md").read_text()
