"""Developer sessions for the hlat monorepo.

``nox -s tests`` installs every package (editable) into one environment and runs all tests
but two groups, each run by a session of its own in the same kind of environment: ``nox -s
tests-compile`` (torch.compile across processes) and ``nox -s tests-faults`` (processes
killed, stopped or restarted); ``nox -s tests-<package>`` proves one package installs and
passes alone (its tests but the ``slow`` multi-process ones, which ``tests`` runs); ``nox -s
tests-oldest`` runs every package's tests but the ``faults`` ones on the oldest torch the
packages declare (``torch>=X.Y``: the newest X.Y.* release); ``lint``, ``typecheck``,
``bench`` and ``build`` do what they say; ``reuse-torchtitan`` runs the torchtitan example
of ``docs/reuse`` in an environment of its own; ``demo`` trains a tiny Llama on the
standard library and ``eval`` scores a checkpoint with lm-evaluation-harness
(``tools/evaluate.py``), both on CPU and outside CI.

torch is pinned to a CPU-friendly release; GPU users override it, e.g.
``HLAT_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" nox -s tests``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox itself needs tomli there
    import tomli as tomllib

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
TORCH = shlex.split(os.environ.get("HLAT_TORCH", "torch==2.13.0"))
PYTHON = os.environ.get("HLAT_PYTHON")  # None: the interpreter nox runs under

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True
# Note: pip's byte-compiling of every installed module (torch's included) took longer than
# unpacking the torch wheel itself. Python compiles what a session imports, on first use, and
# writes it even where the environment says not to (an empty PYTHONDONTWRITEBYTECODE counts
# as unset): otherwise every process the multi-process tests spawn compiles torch again.
NO_COMPILE = "--no-compile"
os.environ["PYTHONDONTWRITEBYTECODE"] = ""
# ``tests`` and ``tests-oldest`` run their test files on pytest-xdist workers, each file whole
# on one worker (its module fixtures built once). Most tests keep one core busy at a time, so
# even two workers on two cores finish these suites sooner (most multi-process tests run each
# rank on one thread). The per-package sessions, each dominated by one or two files, ran
# longer that way and stay in one process. HLAT_TEST_WORKERS sets the count ("0": one
# process, as plain pytest; "auto": one per core); a later "-n" in the posargs wins.
WORKERS = ["-n", os.environ.get("HLAT_TEST_WORKERS", "2"), "--dist", "loadfile"]
# Note: torch's OpenMP threads spin after each parallel region by default; beside another
# worker on the same cores that spinning took CPU time from it (hlat-model and hlat-optim's
# tests: 92-97 s of CPU with passive waiting, 102-128 s without, on 2 workers and 2 cores).
# Passive threads sleep instead; what runs is the same. An OMP_WAIT_POLICY already set wins.
WORKER_ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
XDIST = "pytest-xdist>=3.6"
# the slowest tests of each run, in its log: where CI's time goes
DURATIONS = "--durations=20"


def _project(package: str) -> dict:
    with open(ROOT / "packages" / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _local_requirements(package: str, extra: str, seen: set[str] | None = None) -> list[str]:
    """The hlat packages ``package`` needs (transitively, with ``extra``), so that they install
    from this tree rather than from an index."""
    seen = set() if seen is None else seen
    project = _project(package)
    requirements = project.get("dependencies", []) + project.get("optional-dependencies", {}).get(
        extra, []
    )
    for requirement in requirements:
        name = re.split(r"[\s\[;<>=!~]", requirement, maxsplit=1)[0]
        if name in PACKAGES and name != package and name not in seen:
            seen.add(name)
            _local_requirements(name, "", seen)
    return sorted(seen)


def _find_uv() -> str | None:
    """uv's binary, where the interpreter running nox has it (``pip install uv``), unless
    ``HLAT_NO_UV`` is set."""
    if os.environ.get("HLAT_NO_UV"):
        return None
    found = shutil.which("uv")
    if found:
        return found
    try:
        import uv  # the PyPI package that carries the binary
    except ImportError:
        return None
    try:
        return str(uv.find_uv_bin())
    except FileNotFoundError:
        return None


# Note: pip took about 110 s to resolve and install the test environment's dependencies
# (every package editable with its test extra, a warm cache, torch already in place), uv 8 s
# with an empty cache; CI creates a dozen such environments. torch itself still comes through
# pip: pip's own configuration may name a local wheel, and HLAT_TORCH carries pip's options.
UV = _find_uv()


def _torch_pin(session: nox.Session) -> Path:
    return Path(session.create_tmp()) / "torch-constraint.txt"


def _install_torch(session: nox.Session, torch: list[str]) -> None:
    """``torch`` (a requirement and pip options) through pip, then pinned to the release it
    installed for every later install of the session: nothing those bring may replace it."""
    session.install(*torch, NO_COMPILE)
    version = session.run_install(
        "python",
        "-c",
        "from importlib.metadata import version; print(version('torch'))",
        silent=True,
        stderr=None,
    )
    if isinstance(version, str):  # None where --no-install skipped the run
        session.log(f"torch {version.strip()}")
        _torch_pin(session).write_text(f"torch=={version.strip()}\n")


def _add(session: nox.Session, *args: str) -> None:
    """pip-style requirements into the session's environment: through uv where nox's Python
    has it, else pip; the torch installed first stays."""
    pin = _torch_pin(session)
    constraints = ["-c", str(pin)] if pin.exists() else []
    if UV is None:
        session.install(*args, *constraints, NO_COMPILE)
        return
    python = Path(session.bin) / ("python.exe" if sys.platform == "win32" else "python")
    session.run_install(
        UV, "pip", "install", "--python", str(python), *args, *constraints, external=True
    )


def _install(session: nox.Session, packages: list[str], extra: str, editable: bool) -> None:
    _install_torch(session, TORCH)
    args: list[str] = []
    for package in packages:
        extras = _project(package).get("optional-dependencies", {})
        spec = f"packages/{package}[{extra}]" if extra in extras else f"packages/{package}"
        args += ["-e", spec] if editable else [spec]
    _add(session, *args)


@nox.session(python=PYTHON, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    _add(session, "ruff>=0.8")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON, tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources."""
    _install(session, PACKAGES, "test", editable=True)
    _add(session, "mypy>=1.10")
    session.run("mypy", *(f"packages/{p}/src" for p in PACKAGES))


# Tests that take minutes of their own and check one concern: each marker's tests run in a
# session of its own (``tests-<marker>``), so that ``tests`` stays under 15 minutes on a 2-core
# machine with a cold compile cache. ``upstream`` ones run in the per-package sessions.
OWN_SESSIONS = {
    "compile": "torch.compile's inductor on kernels, across processes or in whole training runs, minutes on a cold compile cache",
    "faults": "processes killed, stopped or restarted, and tools/fault_campaign.py run for real",
    "parity": "spawned multi-process runs of the parallel layouts and the device-parity harness against one process",
}


def _all_tests(session: nox.Session, marks: str) -> None:
    """pytest over every package and the repository's tests (tools/, docs/) in one environment
    with every package installed editable, on the xdist workers, selecting ``marks``."""
    _install(session, PACKAGES, "test", editable=True)
    _add(session, XDIST)
    repo_tests = ["tests"] if (ROOT / "tests").is_dir() else []
    # a "-m" among the posargs comes later and wins
    session.run(
        "pytest",
        DURATIONS,
        *WORKERS,
        *(f"packages/{p}" for p in PACKAGES),
        *repo_tests,
        "-m",
        marks,
        *session.posargs,
        env=WORKER_ENV,
    )


@nox.session(python=PYTHON, tags=["ci"])
def tests(session: nox.Session) -> None:
    """All packages installed editable in one environment; every test suite and README example
    but the tests of ``tests-compile``, ``tests-faults`` and ``tests-parity`` (markers
    ``compile``, ``faults`` and ``parity``). Tests marked ``upstream`` (a limitation of torch
    itself, up to minutes of retries) run in the per-package sessions (``tests-<package>``)
    only."""
    _all_tests(session, " and ".join(f"not {m}" for m in ("upstream", *OWN_SESSIONS)))


for _index, (_marker, _what) in enumerate(OWN_SESSIONS.items()):
    # a test with two of these markers runs in the session of the first one only
    _marks = " and ".join([_marker, *(f"not {m}" for m in list(OWN_SESSIONS)[:_index])])

    @nox.session(name=f"tests-{_marker}", python=PYTHON, tags=["ci"])
    def _tests_marked(session: nox.Session, marks: str = _marks) -> None:
        _all_tests(session, marks)

    _tests_marked.__doc__ = (
        f"The tests marked ``{_marker}``, in the environment of ``tests``: {_what}."
    )


for _package in PACKAGES:

    @nox.session(name=f"tests-{_package}", python=PYTHON, tags=["ci"])
    def _tests_one(session: nox.Session, package: str = _package) -> None:
        """One package in a fresh environment with only its own dependencies and test tools:
        its README example and every test but those marked ``slow`` (spawned multi-process
        runs and training loops, which ``tests`` or ``tests-parity`` runs on the same code and
        torch); those marked ``upstream`` run here only. ``nox -s tests-<package> -- -m ""``
        runs all."""
        _install(session, [*_local_requirements(package, "test"), package], "test", editable=False)
        # a "-m" among the posargs comes later and wins
        session.run(
            "pytest",
            DURATIONS,
            f"packages/{package}",
            "-m",
            "not slow or upstream",
            *session.posargs,
        )


def _torch_floors() -> dict[str, list[str]]:
    """``{"2.9": [packages]}``: the packages grouped by the torch floor they declare."""
    floors: dict[str, list[str]] = {}
    for package in PACKAGES:
        project = _project(package)
        requirements = project.get("dependencies", []) + [
            r for extra in project.get("optional-dependencies", {}).values() for r in extra
        ]
        found = {m.group(1) for r in requirements if (m := re.fullmatch(r"torch>=(\d+\.\d+)", r))}
        if len(found) != 1:
            raise ValueError(
                f"{package} should declare one torch floor 'torch>=X.Y', found {found}"
            )
        floors.setdefault(found.pop(), []).append(package)
    return floors


@nox.session(name="tests-oldest", python=PYTHON, tags=["ci"])
def tests_oldest(session: nox.Session) -> None:
    """Every package's tests on the oldest torch it declares (the newest patch release of
    that X.Y), but those of ``tests-faults``, ``tests-compile`` and ``tests-parity`` (markers
    ``faults``, ``compile`` and ``parity``; those marked ``oldtorch`` run whatever their other
    markers): processes killed and restarted test hlat's own recovery, and inductor's
    compiles and the spawned multi-process layouts take minutes each, so they run once, on the
    pinned torch, keeping CI within its time (``-- -m ""`` runs them all). On x86-64 Linux,
    PyPI's torch below the pinned CPU wheel is a CUDA build (about 4 GB); it runs on the CPU.
    ``HLAT_TORCH_OLDEST`` replaces the torch requirement (e.g. with ``--index-url
    https://download.pytorch.org/whl/cpu``)."""
    for floor, packages in sorted(_torch_floors().items()):
        torch = shlex.split(os.environ.get("HLAT_TORCH_OLDEST", f"torch~={floor}.0"))
        _install_torch(session, torch)
        args: list[str] = []
        for package in packages:
            extras = _project(package).get("optional-dependencies", {})
            args.append(f"packages/{package}[test]" if "test" in extras else f"packages/{package}")
        _add(session, *args, XDIST)
        # a "-m" among the posargs comes later and wins
        session.run(
            "pytest",
            DURATIONS,
            *WORKERS,
            *(f"packages/{p}" for p in packages),
            "-m",
            "not faults and (oldtorch or not (compile or parity))",
            *session.posargs,
            env=WORKER_ENV,
        )


if "hlat-train" in PACKAGES:

    @nox.session(python=PYTHON)
    def demo(session: nox.Session) -> None:
        """The main job: train a tiny Llama on this Python's own standard library, on CPU."""
        _install(session, PACKAGES, "demo", editable=True)
        session.run("hlat-train", "demo", *session.posargs)

    # lm-evaluation-harness and what its "hf" model needs; not a test dependency (heavy)
    LM_EVAL = ["lm_eval>=0.4.9,<0.5", "accelerate>=0.26", "transformers>=4.45"]

    def _install_eval(session: nox.Session, *extra: str) -> None:
        _install(session, PACKAGES, "hf", editable=True)
        _add(session, *LM_EVAL, *extra)  # the torch just installed stays

    @nox.session(name="eval", python=PYTHON)
    def eval_(session: nox.Session) -> None:
        """Export the newest checkpoint (``nox -s eval -- runs/demo/checkpoints``; none given:
        a short fresh run) to Hugging Face and score it with lm-evaluation-harness, offline on
        CPU, on a local multiple-choice task over standard-library code."""
        _install_eval(session)
        session.run("python", "tools/evaluate.py", *session.posargs)

    @nox.session(name="tests-eval", python=PYTHON, tags=["ci"])
    def tests_eval(session: nox.Session) -> None:
        """The tests that need lm-evaluation-harness (not a test dependency: heavy): a full
        small run of ``tools/evaluate.py`` and the ``docs/reuse`` example that scores an
        exported checkpoint, each checked against the model's own log-likelihoods."""
        _install_eval(session, "pytest>=8")
        session.run(
            "pytest",
            "tests/test_evaluate.py",
            "tests/test_reuse.py::test_an_exported_checkpoint_generates_and_lm_eval_scores_it_as_transformers_does",
            *session.posargs,
        )


@nox.session(name="reuse-torchtitan", python=PYTHON, tags=["ci"])
def reuse_torchtitan(session: nox.Session) -> None:
    """hlat-optim and hlat-data inside torchtitan's trainer
    (``docs/reuse/torchtitan_hlat_optim_data.py``), in an environment of its own: torchtitan
    0.3 pins ``datasets<4.8``, below the test environment's, and imports triton, which CPU
    wheels of torch do not bring."""
    _install_torch(session, TORCH)
    _add(
        session,
        "torchtitan>=0.3,<0.4",
        "triton",
        "pytest>=8",
        "-e",
        "packages/hlat-optim",
        "-e",
        "packages/hlat-data[torch]",
    )
    session.run("pytest", "packages/hlat-optim/tests/test_reuse_torchtitan.py", *session.posargs)


def _bench_targets(session: nox.Session, default: list[str]) -> list[str]:
    """The posargs, led by ``default`` when they name no path (only options, such as
    ``-k fp32`` or ``--benchmark-json=out.json``), so that options alone do not widen the
    run to every test pytest finds from the repository root."""
    args = list(session.posargs)
    names_a_path = any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists() for a in args)
    return args if names_a_path else [*default, *args]


@nox.session(name="bench-torchtitan", python=PYTHON)
def bench_torchtitan(session: nox.Session) -> None:
    """The whole trainer against torchtitan's on the same Llama shape and data
    (``packages/hlat-train/benchmarks/test_bench_vs_torchtitan.py``), in an environment of its
    own for the reason ``reuse-torchtitan`` gives."""
    _install(session, PACKAGES, "torch", editable=True)  # hlat-data[torch], the rest plain
    _add(session, "torchtitan>=0.3,<0.4", "triton", "pytest>=8", "pytest-benchmark>=4")
    targets = _bench_targets(
        session, ["packages/hlat-train/benchmarks/test_bench_vs_torchtitan.py"]
    )
    session.run(
        "pytest", "--benchmark-only", "--benchmark-columns=min,median,rounds", "-s", *targets
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """pytest-benchmark suites of every package (or ``nox -s bench -- packages/hlat-optim``)."""
    _install(session, PACKAGES, "bench", editable=True)
    targets = _bench_targets(
        session,
        [
            f"packages/{p}/benchmarks"
            for p in PACKAGES
            if (ROOT / "packages" / p / "benchmarks").is_dir()
        ],
    )
    session.run(
        "pytest", "--benchmark-only", "--benchmark-columns=min,median,mean,rounds", *targets
    )


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """A wheel and an sdist of every package into dist/."""
    _add(session, "build>=1.2")
    for package in PACKAGES:
        session.run("python", "-m", "build", "--outdir", "dist", f"packages/{package}")
