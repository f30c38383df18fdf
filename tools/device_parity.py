"""Device parity: one distributed training job run on a reference device and on a candidate
device, compared step by step and rank by rank.

This is the method AWS uses to accept its TorchNeuron backend (Trainium as the ``neuron``
torch device): run the same distributed job on CPU with gloo, then on the device, and
compare. Here the job is ``hlat_train.Trainer(config).fit()`` under ``torchrun``: the same
config, seed, parallel layout and data on both sides; only ``train.device`` and the
process-group backend (``parallel.dist_backend``) differ. Each rank writes checksums of its
local parameter shards after the last step; rank 0's ``metrics.jsonl`` holds every step's
loss and gradient norm.

    python tools/device_parity.py --device cuda --backend nccl --nproc 2 --steps 8 --out runs/parity
    python tools/device_parity.py --device neuron --nproc 2 --steps 8 --out runs/parity  # trn2
    python tools/device_parity.py --device cpu --backend gloo --nproc 2 --steps 4 --out /tmp/p

Same device type and backend on both sides: the results must be equal bit for bit. Different
ones: every loss, gradient norm and parameter-shard sum and norm must agree within relative
tolerances chosen by the training precision (``--rtol``/``--atol`` replace them).

Without data in the config (``--config tiny``, the default, has none), the tool makes a corpus
from this Python's standard library and trains a small SentencePiece BPE on it, cached under
``--cache-dir`` as ``hlat-train demo`` does.

Writes ``report.md`` and ``report.json`` into ``--out``, next to ``reference/`` and
``candidate/`` (config, torchrun log, metrics, per-rank checksums).

Exit status: 0 the runs agree; 1 they disagree, or the candidate run failed; 2 usage error
(found before anything runs); 3 the reference run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
AGREE, DISAGREE, USAGE, REFERENCE_FAILED = 0, 1, 2, 3
MARKER = ".device-parity"  # a side folder the tool made, and may delete to run again

# The tiny-check preset (a 2-layer, 64-wide Llama whose step takes milliseconds on a CPU)
# with the reference AdamW: plain eager tensor code, the same on every device, so a difference
# comes from the device and its collectives, not from an optimizer kernel chosen per device.
TINY_OVERRIDES = [
    "--data.valid_paths=[]",
    "--train.eval_every=0",
    "--optim.impl=reference",
]
TINY_CORPUS_FILES = 150  # standard-library modules: about 4 MB of text
TINY_VOCAB = 512

# Set on both sides before the user's overrides, which may change them.
DEFAULT_SETTINGS = [
    # DTensor/FSDP2 on both sides: the same parallel code runs on the reference and the device
    "--parallel.backend=torch",
    # every rank builds the whole model on the host from train.seed: both sides start equal
    "--train.init=full",
    "--checkpoint.async_save=false",
    "--checkpoint.keep_last=1",
    "--logging.progress=false",
    "--logging.plot=false",
    "--logging.tensorboard=false",
]

# Keys the tool sets itself on each side; an override of one would undo the comparison.
OWNED_KEYS = {
    "train.device": "--device / --reference-device",
    "parallel.dist_backend": "--backend / --reference-backend",
    "train.steps": "--steps",
    "train.out_dir": "--out",
    "train.time_limit": "nothing: a time limit would end the two runs at different steps",
    "checkpoint.dir": "--out",
    "checkpoint.resume": "nothing: each run starts from step 0",
    "logging.every": "nothing: every step is logged and compared",
    "logging.jsonl": "nothing: the losses are read from metrics.jsonl",
}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


# Allowed |candidate - reference| <= atol + rtol * |reference| for losses and gradient norms,
# and for each parameter shard's sum (scaled by its sum of absolute values) and L2 norm.
# fp32: another summation order changes a result by ~1e-7 relative (measured: 8e-8 on the
# loss when gradient accumulation splits the same batch), and a few AdamW steps amplify it;
# a 10 % learning-rate change on the tiny config exceeds 1e-3 at the first step after a
# changed update. bf16: one rounding step is 2^-8 ~ 4e-3, and stochastic rounding draws
# other bits on another device; the same learning-rate change stays inside 3e-2 for 8 steps
# (only parameter shards show it), so bf16 candidates need longer runs.
TOLERANCES = {
    "fp32": Tolerance(rtol=1e-3, atol=1e-5),
    "bf16": Tolerance(rtol=3e-2, atol=1e-3),
}


class UsageError(Exception):
    """A mistake in the command line or the config; exit status 2."""


def log(text: str) -> None:
    print(f"device_parity: {text}", flush=True)


# --- command line ----------------------------------------------------------------------------

_OVERRIDE_ITEM = re.compile(r"^(--)?[A-Za-z_]\w*\.[A-Za-z_]\w*=")
_OVERRIDE_FLAGS = ("--override", "--candidate-override")


def split_overrides(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Take ``--override --a.b=1 --c.d=2`` (and ``--candidate-override ...``) out of ``argv``:
    argparse would read each ``--a.b=1`` as an option of its own."""
    rest: list[str] = []
    found: dict[str, list[str]] = {flag: [] for flag in _OVERRIDE_FLAGS}
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, eq, value = token.partition("=")
        if flag in found and eq:
            found[flag].append(value)
            i += 1
            continue
        if token in found:
            i += 1
            start = i
            while i < len(argv) and _OVERRIDE_ITEM.match(argv[i]):
                found[token].append(argv[i])
                i += 1
            if i == start:
                after = f", not {argv[i]!r}" if i < len(argv) else ""
                raise UsageError(f"{token} needs one or more --section.key=value after it{after}")
            continue
        rest.append(token)
        i += 1
    return rest, found


def parse_args(argv: list[str]) -> argparse.Namespace:
    rest, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(
        prog="device_parity.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", required=True, help="candidate torch device type: cuda, neuron, ...")
    p.add_argument(
        "--backend",
        default="auto",
        help="candidate process-group backend (nccl, neuron, gloo, ...); auto: torch's default "
        "for the device",
    )
    p.add_argument("--reference-device", default="cpu")
    p.add_argument("--reference-backend", default="gloo")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (torchrun)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    p.add_argument(
        "--config",
        default="tiny",
        help="tiny (a 2-layer, 64-wide Llama), an hlat-train preset name or a TOML file",
    )
    p.add_argument("--out", type=Path, default=Path("runs/device-parity"))
    p.add_argument(
        "--compare",
        choices=("auto", "exact", "tolerance"),
        default="auto",
        help="auto: bit for bit when both sides have the same device type and backend, "
        "else within tolerances",
    )
    p.add_argument("--rtol", type=float, help="relative tolerance (default: by precision)")
    p.add_argument("--atol", type=float, help="absolute tolerance (default: by precision)")
    p.add_argument(
        "--reference-from",
        type=Path,
        help="the --out folder of an earlier run whose reference run had the same config: "
        "reuse it instead of running the reference again",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        help="where the generated corpus and tokenizer are kept (default: $HLAT_CACHE or "
        "~/.cache/hlat, shared with `hlat-train demo`)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per run")
    p.epilog = (
        "overrides (after the options above):\n"
        "  --override --section.key=value ...            both runs\n"
        "  --candidate-override --section.key=value ...  the candidate run only"
    )
    args = p.parse_args(rest)
    args.override = overrides["--override"]
    args.candidate_override = overrides["--candidate-override"]
    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    for name in ("rtol", "atol", "timeout"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            raise UsageError(f"--{name} must be a number >= 0, got {value}")
    for item in args.override + args.candidate_override:
        key = (item[2:] if item.startswith("--") else item).split("=", 1)[0].strip()
        if key in OWNED_KEYS:
            raise UsageError(
                f"override {item!r}: {key} is set by device_parity itself (use {OWNED_KEYS[key]})"
            )
    return args


# --- devices and backends --------------------------------------------------------------------


def check_device(device: str, nproc: int, option: str) -> None:
    """Raise :class:`UsageError` unless torch can run ``nproc`` processes on ``device``
    (hlat-parallel's own check, which names what to install, plus one device per process)."""
    import torch

    from hlat_parallel import DeviceError
    from hlat_parallel import check_device as check

    if ":" in device:
        raise UsageError(
            f"{option} {device!r}: give the device type only (e.g. {device.split(':')[0]!r}); "
            "each process takes the device of its LOCAL_RANK"
        )
    try:
        check(device)
    except DeviceError as e:
        raise UsageError(f"{option}: {e}") from None
    if device != "cpu" and torch.accelerator.device_count() < nproc:
        raise UsageError(
            f"--nproc {nproc} needs {nproc} {device} devices (one per process); "
            f"this machine has {torch.accelerator.device_count()}"
        )


def resolve_backend(device: str, backend: str, option: str) -> str:
    """The process-group backend name ``backend`` stands for on ``device``; checks torch has it."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise UsageError("this torch was built without torch.distributed")
    if backend == "auto":
        from hlat_parallel import DeviceError, dist_backend_for

        try:
            backend = dist_backend_for(torch.device(device))
        except DeviceError as e:
            raise UsageError(f"{e}; give {option}") from None
    if not dist.is_backend_available(backend):
        raise UsageError(
            f"{option} {backend!r}: this torch has no {backend!r} process-group backend "
            f"(available: {', '.join(b for b in dist.Backend.backend_list if b != 'undefined')})"
        )
    carries = dist.Backend.backend_capability.get(backend)
    if carries is not None and device not in carries:
        raise UsageError(
            f"{option} {backend!r}: this process-group backend carries tensors of "
            f"{', '.join(carries)} only, not of {device!r}"
        )
    return backend


# --- configs ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Side:
    """One of the two runs."""

    name: str  # "reference" or "candidate"
    device: str
    backend: str
    dir: Path
    config: Any = None  # hlat_train.TrainConfig
    reused: bool = False
    seconds: float = math.nan
    exit_code: int | None = None

    @property
    def label(self) -> str:
        return f"{self.device} + {self.backend}"


def base_config(args: argparse.Namespace, overrides: list[str]) -> Any:
    from hlat_train import ConfigError, TrainConfig

    try:
        if args.config == "tiny":
            config = TrainConfig.preset("tiny-check", TINY_OVERRIDES)
        else:
            config = TrainConfig.from_toml(args.config)
        for item in [*DEFAULT_SETTINGS, f"--checkpoint.every={args.steps}", *overrides]:
            config.set_override(item)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return config


def provide_data(configs: list[Any], cache_dir: Path | None) -> None:
    """Point configs without data at a standard-library corpus and a tokenizer trained on it,
    made (once, then reused) by ``hlat-train demo``'s own builders."""
    from hlat_train.demo import build_corpus, build_tokenizer, default_cache_dir

    for config in configs:
        if config.data.paths and not config.data.tokenizer:
            raise UsageError(
                "the config names data.paths but no data.tokenizer; name the SentencePiece "
                "model trained for that data, or leave data.paths empty to use a generated corpus"
            )
    needy = [c for c in configs if not c.data.paths]
    if not needy:
        return
    start = time.perf_counter()
    # the standard library differs between Python versions: one corpus per version
    version = f"py{sys.version_info[0]}{sys.version_info[1]}"
    folder = Path(cache_dir or default_cache_dir()) / f"parity-stdlib-{version}-{TINY_CORPUS_FILES}"
    train, _ = build_corpus(str(folder), TINY_CORPUS_FILES)
    tokenizer = build_tokenizer(train, str(folder), TINY_VOCAB)
    for config in needy:
        config.data.paths = [train]
        config.data.tokenizer = config.data.tokenizer or tokenizer
    log(
        f"data: standard-library corpus and {TINY_VOCAB}-piece tokenizer in {folder} "
        f"({time.perf_counter() - start:.1f} s)"
    )


def apply_side_settings(side: Side, args: argparse.Namespace) -> None:
    from hlat_train.validation import ConfigError, validate

    config = side.config
    config.train.device = side.device
    config.train.steps = args.steps
    config.train.time_limit = 0.0
    config.train.out_dir = str(side.dir / "run")
    config.checkpoint.dir = str(side.dir / "run" / "checkpoints")
    config.checkpoint.resume = False
    config.logging.every = 1
    config.logging.jsonl = True
    config.set("parallel.dist_backend", side.backend)
    try:
        validate(config, args.nproc, local_world_size=args.nproc)
    except ConfigError as e:
        raise UsageError(f"the {side.name} config: {e}") from None


def precision_class(config: Any) -> str:
    return "fp32" if config.optim.precision == "fp32" else "bf16"


def _config_view(config: Any) -> dict[str, Any]:
    """The config as data, without the paths that name where a run wrote its output."""
    data = config.to_dict()
    data["train"].pop("out_dir", None)
    data["checkpoint"].pop("dir", None)
    return data


def check_reusable(side: Side, source: Path, args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` unless ``source/reference`` ran ``side``'s job to the end."""
    from hlat_train import TrainConfig

    folder = source / "reference"
    settings_path = folder / "settings.json"
    if not settings_path.exists():
        raise UsageError(f"--reference-from {source}: no reference run there ({settings_path})")
    settings = json.loads(settings_path.read_text())
    wanted = {"device": side.device, "backend": side.backend, "nproc": args.nproc}
    for key, value in wanted.items():
        if settings.get(key) != value:
            raise UsageError(
                f"--reference-from {source}: its reference ran with {key} "
                f"{settings.get(key)!r}, this one needs {value!r}"
            )
    if settings.get("exit_code") != 0 or len(rank_files(folder)) != args.nproc:
        raise UsageError(f"--reference-from {source}: its reference run did not complete")
    old = _config_view(TrainConfig.from_toml(folder / "config.toml"))
    new = _config_view(side.config)
    for section, values in new.items():
        for key, value in values.items():
            if old.get(section, {}).get(key) != value:
                raise UsageError(
                    f"--reference-from {source}: its reference ran with {section}.{key} = "
                    f"{old.get(section, {}).get(key)!r}, this one needs {value!r}"
                )
    side.dir = folder
    side.config = TrainConfig.from_toml(folder / "config.toml")
    side.reused = True
    side.exit_code = 0
    side.seconds = float(settings.get("seconds", math.nan))


# --- running ---------------------------------------------------------------------------------


def prepare_dir(folder: Path) -> None:
    if folder.exists():
        if not (folder / MARKER).exists():
            raise UsageError(
                f"{folder} exists and was not made by device_parity; choose another --out"
            )
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("made by tools/device_parity.py; deleted on the next run\n")


def run_side(side: Side, args: argparse.Namespace) -> None:
    """``torchrun --standalone --nproc-per-node N`` of this file's worker, output to a log."""
    side.dir.mkdir(parents=True, exist_ok=True)
    (side.dir / "config.toml").write_text(side.config.to_toml())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    # cuBLAS repeats its results only with a fixed workspace (torch's deterministic mode)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if side.device == "cpu":
        # a CPU run leaves the GPUs alone (no CUDA context, no memory taken on them)
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        str(SCRIPT),
        "--worker",
        str(side.dir),
    ]
    log_path = side.dir / "torchrun.log"
    start = time.perf_counter()
    with log_path.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            side.exit_code = proc.wait(timeout=args.timeout or None)
        except subprocess.TimeoutExpired:
            _stop(proc)
            out.write(f"\ndevice_parity: stopped after --timeout {args.timeout:g} s\n")
            side.exit_code = None
    side.seconds = time.perf_counter() - start
    settings = {
        "device": side.device,
        "backend": side.backend,
        "nproc": args.nproc,
        "steps": args.steps,
        "exit_code": side.exit_code,
        "seconds": side.seconds,
        "command": cmd,
    }
    (side.dir / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End torchrun and its workers (their own process group, started for them)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(side: Side, lines: int = 25) -> str:
    path = side.dir / "torchrun.log"
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:])


# --- the worker: one rank of one run ---------------------------------------------------------


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="device_parity.py --worker")
    p.add_argument("side_dir", type=Path)
    side_dir = p.parse_args(argv).side_dir

    import torch

    from hlat_train import TrainConfig
    from hlat_train.trainer import Trainer

    # the same run twice on one device must give the same bits, also on accelerators whose
    # default kernels accumulate with atomics (warn, not fail, where torch has no such kernel)
    torch.use_deterministic_algorithms(True, warn_only=True)
    trainer = Trainer(TrainConfig.from_toml(side_dir / "config.toml"))
    try:
        trainer.fit()
        record = {
            "rank": trainer.dims.rank,
            "environment": environment(trainer),
            "parameters": [checksum(n, p) for n, p in trainer.model.named_parameters()],
        }
        ranks = side_dir / "ranks"
        ranks.mkdir(exist_ok=True)
        target = ranks / f"rank{trainer.dims.rank}.json"
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, target)
    finally:
        trainer.close()
    return 0


def checksum(name: str, param: Any) -> dict[str, Any]:
    """Checksums of this rank's local shard of ``param``: float64 sums and a digest of its bytes."""
    import torch
    from torch.distributed.tensor import DTensor

    tensor = param.detach()
    global_shape = list(tensor.shape)
    placements = None
    if isinstance(tensor, DTensor):
        placements = [str(p) for p in tensor.placements]
        tensor = tensor.to_local()
    host = tensor.to("cpu").contiguous()
    wide = host.double()
    return {
        "name": name,
        "shape": list(host.shape),
        "global_shape": global_shape,
        "placements": placements,
        "dtype": str(host.dtype).removeprefix("torch."),
        "device": tensor.device.type,
        "sum": float(wide.sum()),
        "abs_sum": float(wide.abs().sum()),
        "sum_sq": float(wide.square().sum()),
        "sha256": hashlib.sha256(host.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest(),
    }


def environment(trainer: Any) -> dict[str, Any]:
    """What this rank ran on, as it was, for the report and to check the request was met."""
    import importlib.metadata

    import torch
    import torch.distributed as dist

    import hlat_train

    device = trainer.device
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "hlat_train": hlat_train.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device_type": device.type,
        "device_name": device_name(device),
        "process_group_backend": str(dist.get_backend()) if dist.is_initialized() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": trainer.dims.tp,
        "dp": trainer.dims.dp,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for package in ("torch-neuronx", "neuronx-cc"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env[package] = importlib.metadata.version(package)
    return env


def device_name(device: Any) -> str:
    if device.type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine()
    from hlat_train.metrics import device_name as accelerator_name

    return accelerator_name(device)


# --- comparing -------------------------------------------------------------------------------


def rank_files(folder: Path) -> list[Path]:
    return sorted((folder / "ranks").glob("rank*.json"), key=lambda p: int(p.stem[4:]))


def load_run(folder: Path) -> dict[str, Any]:
    """``{"steps": {step: record}, "ranks": {rank: record}}`` of one finished run."""
    metrics = folder / "run" / "metrics.jsonl"
    steps: dict[int, dict[str, Any]] = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                if record.get("kind") == "train":
                    steps[int(record["step"])] = record
    ranks = {}
    for path in rank_files(folder):
        record = json.loads(path.read_text())
        ranks[int(record["rank"])] = record
    return {"steps": steps, "ranks": ranks}


def _diff(ref: float, cand: float) -> tuple[float, float]:
    """(absolute, relative) difference; equal non-finite values differ by 0."""
    if ref == cand or (math.isnan(ref) and math.isnan(cand)):
        return 0.0, 0.0
    delta = abs(cand - ref)
    if math.isnan(delta):
        return math.inf, math.inf
    return delta, (delta / abs(ref) if ref else math.inf)


def _allowed(tol: Tolerance | None, scale: float) -> float:
    return 0.0 if tol is None else tol.atol + tol.rtol * abs(scale)


def check_environment(side: Side, run: dict[str, Any]) -> str | None:
    """Why ``side`` did not run as requested (on another device or backend), or None."""
    for rank, record in sorted(run["ranks"].items()):
        env = record["environment"]
        used = set(re.split(r"[,:]", env.get("process_group_backend") or ""))
        devices = {p["device"] for p in record["parameters"]}
        if env["device_type"] != side.device or devices - {side.device}:
            return (
                f"rank {rank} of the {side.name} run computed on "
                f"{', '.join(sorted(devices | {env['device_type']}))}, not on the requested "
                f"{side.device}"
            )
        if side.backend not in used:
            return (
                f"rank {rank} of the {side.name} run used the process-group backend "
                f"{env.get('process_group_backend')!r}, not the requested {side.backend!r}"
            )
    return None


def compare(
    reference: dict[str, Any], candidate: dict[str, Any], tol: Tolerance | None
) -> dict[str, Any]:
    """Step metrics and parameter checksums of two runs; ``tol`` None means bit for bit."""
    problems: list[dict[str, Any]] = []
    ref_steps, cand_steps = reference["steps"], candidate["steps"]
    if sorted(ref_steps) != sorted(cand_steps):
        problems.append(
            {
                "what": "steps",
                "message": f"the reference logged steps {_span(ref_steps)}, "
                f"the candidate {_span(cand_steps)}",
            }
        )
    common = sorted(set(ref_steps) & set(cand_steps))
    metrics: dict[str, dict[str, Any]] = {}
    for metric in ("loss", "grad_norm"):
        worst_abs = worst_rel = 0.0
        for step in common:
            ref, cand = float(ref_steps[step][metric]), float(cand_steps[step][metric])
            delta, rel = _diff(ref, cand)
            worst_abs, worst_rel = max(worst_abs, delta), max(worst_rel, rel)
            allowed = _allowed(tol, ref)
            if delta > allowed or (tol is None and delta != 0):
                problems.append(
                    {
                        "what": metric,
                        "step": step,
                        "reference": ref,
                        "candidate": cand,
                        "abs_diff": delta,
                        "rel_diff": rel,
                        "allowed": None if tol is None else allowed,
                    }
                )
        metrics[metric] = {"max_abs_diff": worst_abs, "max_rel_diff": worst_rel}

    ref_ranks, cand_ranks = reference["ranks"], candidate["ranks"]
    if sorted(ref_ranks) != sorted(cand_ranks):
        problems.append(
            {
                "what": "ranks",
                "message": f"checksums from ranks {sorted(ref_ranks)} of the reference and "
                f"{sorted(cand_ranks)} of the candidate",
            }
        )
    per_rank: dict[str, dict[str, int]] = {}
    worst_param = {"sum_rel": 0.0, "norm_rel": 0.0}
    for rank in sorted(set(ref_ranks) & set(cand_ranks)):
        ref_params = {p["name"]: p for p in ref_ranks[rank]["parameters"]}
        cand_params = {p["name"]: p for p in cand_ranks[rank]["parameters"]}
        counts = {"compared": 0, "identical": 0, "within_tolerance": 0}
        for name in [*ref_params, *(n for n in cand_params if n not in ref_params)]:
            ref_p, cand_p = ref_params.get(name), cand_params.get(name)
            if ref_p is None or cand_p is None:
                side = "candidate" if ref_p is None else "reference"
                problems.append(
                    {
                        "what": "parameter",
                        "rank": rank,
                        "parameter": name,
                        "message": f"only the {side} has it",
                    }
                )
                continue
            counts["compared"] += 1
            layout = ("shape", "dtype", "placements")
            if any(ref_p[k] != cand_p[k] for k in layout):
                problems.append(
                    {
                        "what": "parameter",
                        "rank": rank,
                        "parameter": name,
                        "message": "layout differs: "
                        + ", ".join(
                            f"{k} {ref_p[k]} vs {cand_p[k]}"
                            for k in layout
                            if ref_p[k] != cand_p[k]
                        ),
                    }
                )
                continue
            identical = ref_p["sha256"] == cand_p["sha256"]
            counts["identical"] += identical
            sum_abs, sum_rel = _diff(ref_p["sum"], cand_p["sum"])
            ref_norm, cand_norm = math.sqrt(ref_p["sum_sq"]), math.sqrt(cand_p["sum_sq"])
            norm_abs, norm_rel = _diff(ref_norm, cand_norm)
            # a shard's sum can cancel to ~0: measure its change against the sum of magnitudes
            sum_scaled = sum_abs / ref_p["abs_sum"] if ref_p["abs_sum"] else sum_rel
            worst_param["sum_rel"] = max(worst_param["sum_rel"], sum_scaled)
            worst_param["norm_rel"] = max(worst_param["norm_rel"], norm_rel)
            if tol is None:
                ok = identical
            else:
                ok = sum_abs <= _allowed(tol, ref_p["abs_sum"]) and norm_abs <= _allowed(
                    tol, ref_norm
                )
                counts["within_tolerance"] += ok
            if not ok:
                problems.append(
                    {
                        "what": "parameter",
                        "rank": rank,
                        "parameter": name,
                        "shape": ref_p["shape"],
                        "identical_bytes": identical,
                        "sum": [ref_p["sum"], cand_p["sum"]],
                        "sum_abs_diff": sum_abs,
                        "sum_diff_over_abs_sum": sum_scaled,
                        "norm": [ref_norm, cand_norm],
                        "norm_abs_diff": norm_abs,
                        "norm_rel_diff": norm_rel,
                    }
                )
        per_rank[str(rank)] = counts

    step_problems = [p for p in problems if p["what"] in ("steps", "loss", "grad_norm")]
    step_problems.sort(key=lambda p: (p.get("step", 0), p["what"] != "loss"))
    param_problems = [p for p in problems if p["what"] in ("ranks", "parameter")]
    return {
        "agree": not problems,
        "steps_compared": len(common),
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "parameters": {"per_rank": per_rank, "max_rel_diff": worst_param},
        "first_step_difference": step_problems[0] if step_problems else None,
        "first_parameter_difference": param_problems[0] if param_problems else None,
        "differences": len(problems),
    }


def _span(steps: dict[int, Any]) -> str:
    return f"{min(steps)}-{max(steps)}" if steps else "none"


def describe(problem: dict[str, Any]) -> str:
    """One sentence for a difference found by :func:`compare`."""
    if "message" in problem:
        where = (
            f"rank {problem['rank']} parameter {problem['parameter']}: "
            if "parameter" in problem
            else ""
        )
        return where + problem["message"]
    if problem["what"] == "parameter":
        return (
            f"rank {problem['rank']} parameter {problem['parameter']} "
            f"(local shard {problem['shape']}): bytes differ; "
            f"sum {problem['sum'][0]:.9g} vs {problem['sum'][1]:.9g} "
            f"(diff {problem['sum_abs_diff']:.3g}, {problem['sum_diff_over_abs_sum']:.3g} of "
            f"the sum of magnitudes), L2 norm {problem['norm'][0]:.9g} vs "
            f"{problem['norm'][1]:.9g} (rel {problem['norm_rel_diff']:.3g})"
        )
    allowed = (
        "bit for bit required"
        if problem["allowed"] is None
        else f"allowed {problem['allowed']:.3g}"
    )
    return (
        f"step {problem['step']} {problem['what']}: reference {problem['reference']!r}, "
        f"candidate {problem['candidate']!r} (abs diff {problem['abs_diff']:.3g}, "
        f"rel {problem['rel_diff']:.3g}; {allowed})"
    )


# --- the report ------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """``value`` with non-finite floats as strings: standard JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "report.json").write_text(json.dumps(_plain(report), indent=1) + "\n")
    ref, cand = report["reference"], report["candidate"]
    result = report.get("result") or {}
    lines = [
        f"# Device parity: {cand['device']} + {cand['backend']} against "
        f"{ref['device']} + {ref['backend']}",
        "",
        f"**Verdict: {report['verdict']}**",
        "",
    ]
    for key in ("failure", "first_step_difference", "first_parameter_difference"):
        if report.get(key):
            lines.append(f"- {report[key]}")
    if lines[-1] != "":
        lines.append("")
    lines += [
        "| | reference | candidate |",
        "| --- | --- | --- |",
        f"| device | {ref['device']} ({ref.get('device_name', '?')}) | "
        f"{cand['device']} ({cand.get('device_name', '?')}) |",
        f"| process-group backend | {ref.get('backend_used', ref['backend'])} | "
        f"{cand.get('backend_used', cand['backend'])} |",
        f"| torch | {ref.get('torch', '?')} | {cand.get('torch', '?')} |",
        f"| processes x steps | {report['nproc']} x {report['steps']} | "
        f"{report['nproc']} x {report['steps']} |",
        f"| precision | {ref['precision']} | {cand['precision']} |",
        f"| run time | {_seconds(ref)} | {_seconds(cand)} |",
        "",
    ]
    if result:
        tol = report["tolerance"]
        rule = (
            "bit for bit"
            if tol["mode"] == "exact"
            else f"{tol['precision']}: rtol {tol['rtol']:g}, atol {tol['atol']:g} ({tol['source']})"
        )
        per_rank = result["parameters"]["per_rank"]
        matched = "identical" if tol["mode"] == "exact" else "within_tolerance"
        lines += [
            "| check | result |",
            "| --- | --- |",
            f"| comparison | {rule} |",
            f"| steps compared | {result['steps_compared']} |",
            f"| loss: max abs / rel difference | {result['loss']['max_abs_diff']:.3g} / "
            f"{result['loss']['max_rel_diff']:.3g} |",
            f"| grad norm: max abs / rel difference | {result['grad_norm']['max_abs_diff']:.3g} / "
            f"{result['grad_norm']['max_rel_diff']:.3g} |",
            "| parameters compared per rank | "
            + ", ".join(f"rank {r}: {c['compared']}" for r, c in per_rank.items())
            + " |",
            f"| parameters {matched.replace('_', ' ')} | "
            + ", ".join(f"rank {r}: {c[matched]}" for r, c in per_rank.items())
            + " |",
            f"| parameter shards: max rel difference of sum / L2 norm | "
            f"{result['parameters']['max_rel_diff']['sum_rel']:.3g} / "
            f"{result['parameters']['max_rel_diff']['norm_rel']:.3g} |",
            f"| differences found | {result['differences']} |",
            "",
        ]
    lines.append(f"Command: `{report['command']}`")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _seconds(side: dict[str, Any]) -> str:
    text = "?" if math.isnan(side["seconds"]) else f"{side['seconds']:.1f} s"
    return text + (" (reused)" if side.get("reused") else "")


def side_summary(side: Side, run: dict[str, Any] | None) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "device": side.device,
        "backend": side.backend,
        "dir": str(side.dir),
        "reused": side.reused,
        "exit_code": side.exit_code,
        "seconds": side.seconds,
        "precision": side.config.optim.precision,
    }
    if run and run["ranks"]:
        env = run["ranks"][min(run["ranks"])]["environment"]
        summary["device_name"] = env["device_name"]
        summary["backend_used"] = env["process_group_backend"]
        summary["torch"] = env["torch"]
        summary["environment"] = env
    return summary


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    try:
        args = parse_args(argv)
        return run(args, argv)
    except UsageError as e:
        print(f"device_parity: error: {e}", file=sys.stderr)
        return USAGE
    except ModuleNotFoundError as e:
        if not (e.name or "").split(".")[0].startswith(("hlat_", "torch")):
            raise
        print(
            f"device_parity: error: {e.name} is not installed in {sys.executable}; install "
            "torch and the hlat packages (pip install -e packages/hlat-train and its siblings)",
            file=sys.stderr,
        )
        return USAGE


def run(args: argparse.Namespace, argv: list[str]) -> int:
    out: Path = args.out
    check_device(args.reference_device, args.nproc, "--reference-device")
    check_device(args.device, args.nproc, "--device")
    reference = Side(
        "reference",
        args.reference_device,
        resolve_backend(args.reference_device, args.reference_backend, "--reference-backend"),
        out / "reference",
    )
    candidate = Side(
        "candidate",
        args.device,
        resolve_backend(args.device, args.backend, "--backend"),
        out / "candidate",
    )
    reference.config = base_config(args, args.override)
    candidate.config = base_config(args, [*args.override, *args.candidate_override])
    provide_data([reference.config, candidate.config], args.cache_dir)
    for side in (reference, candidate):
        apply_side_settings(side, args)
    if args.reference_from:
        check_reusable(reference, args.reference_from, args)

    same_setup = (reference.device, reference.backend) == (candidate.device, candidate.backend)
    exact = args.compare == "exact" or (args.compare == "auto" and same_setup)
    classes = {precision_class(reference.config), precision_class(candidate.config)}
    precision = "bf16" if "bf16" in classes else "fp32"  # the looser one when they differ
    default_tol = TOLERANCES[precision]
    tol = Tolerance(
        rtol=default_tol.rtol if args.rtol is None else args.rtol,
        atol=default_tol.atol if args.atol is None else args.atol,
    )
    given = [f"--{n}" for n in ("rtol", "atol") if getattr(args, n) is not None]
    tolerance = {
        "mode": "exact" if exact else "tolerance",
        "precision": precision,
        "rtol": tol.rtol,
        "atol": tol.atol,
        "source": " and ".join(given) + " given" if given else f"default for {precision}",
    }

    out.mkdir(parents=True, exist_ok=True)
    for side in (reference, candidate):
        if not side.reused:
            prepare_dir(side.dir)
    report: dict[str, Any] = {
        "command": " ".join(["python", "tools/device_parity.py", *argv]),
        "nproc": args.nproc,
        "steps": args.steps,
        "tolerance": tolerance,
    }

    runs: dict[str, dict[str, Any] | None] = {"reference": None, "candidate": None}
    status = AGREE
    failure = None
    for side in (reference, candidate):
        what = f"{side.label}, {args.nproc} processes x {args.steps} steps"
        if side.reused:
            log(f"{side.name} run: {what}, reused from {side.dir}")
        else:
            log(f"{side.name} run: {what} (log: {side.dir / 'torchrun.log'})")
            run_side(side, args)
        runs[side.name] = run = load_run(side.dir)
        ended = "timed out" if side.exit_code is None else f"exited with status {side.exit_code}"
        if side.exit_code != 0 or len(run["ranks"]) != args.nproc:
            failure = f"the {side.name} run ({side.label}) {ended}; see {side.dir / 'torchrun.log'}"
            print(f"device_parity: {failure}; its last lines:\n{log_tail(side)}", file=sys.stderr)
        else:
            failure = check_environment(side, run)
        if failure:
            status = REFERENCE_FAILED if side is reference else DISAGREE
            break

    report["reference"] = side_summary(reference, runs["reference"])
    report["candidate"] = side_summary(candidate, runs["candidate"])
    if failure:
        report["verdict"] = f"{'reference' if status == REFERENCE_FAILED else 'candidate'} failed"
        report["failure"] = failure
        write_report(out, report)
        log(f"compare: not done: {failure}")
        log(f"report: {out / 'report.md'}")
        return status

    assert runs["reference"] is not None and runs["candidate"] is not None
    result = compare(runs["reference"], runs["candidate"], None if exact else tol)
    report["result"] = result
    rule = "bit for bit" if exact else f"within {precision} tolerances"
    ranks = result["parameters"]["per_rank"]
    params = ", ".join(f"{c['compared']}" for c in ranks.values())
    if result["agree"]:
        report["verdict"] = f"agree ({rule})"
    else:
        report["verdict"] = f"disagree ({rule})"
        for key in ("first_step_difference", "first_parameter_difference"):
            if result[key]:
                report[key] = describe(result[key])
    write_report(out, report)
    log(
        f"compare: {report['verdict']}: {result['steps_compared']} steps, "
        f"{len(ranks)} ranks ({params} parameters)"
    )
    for key in ("first_step_difference", "first_parameter_difference"):
        if report.get(key):
            log(f"  {key.replace('_', ' ')}: {report[key]}")
    log(f"report: {out / 'report.md'}")
    return AGREE if result["agree"] else DISAGREE


if __name__ == "__main__":
    sys.exit(main())
