"""tools/evaluate.py (``nox -s eval``): the task it writes for lm-evaluation-harness, its
argument errors, and, where ``lm_eval`` is installed, a full small run.

``lm_eval`` (with ``accelerate``) is deliberately not in any package's ``test`` extra: it is
heavy, and only this tool uses it. In the test environment the task builder, the files it
writes and the errors are tested; the end-to-end test (train a short run, export it, score
8 items with lm_eval and check the scores against the exported model's own log-likelihoods)
runs where lm_eval is importable, e.g. in the ``eval`` session's environment.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "evaluate.py"
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _load_module():
    spec = importlib.util.spec_from_file_location("evaluate_tool", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ev = _load_module()


@pytest.fixture(scope="module")
def items() -> list[dict]:
    return ev.build_items(40)


# --- the task --------------------------------------------------------------------------------


def test_items_are_deterministic(items):
    assert ev.build_items(40) == items
    # a longer task begins with the same items
    assert ev.build_items(60)[:40] == items


def test_items_have_the_right_shape(items):
    assert len(items) == 40
    assert len({(i["source"], i["offset"]) for i in items}) == 40  # no item twice
    for item in items:
        assert set(item) == {"prefix", "choices", "label", "source", "offset"}
        assert len(item["prefix"]) == ev.PREFIX_CHARS == 300
        assert len(item["choices"]) == 2
        assert [len(c) for c in item["choices"]] == [ev.CHOICE_CHARS] * 2 == [40, 40]
        assert item["label"] in (0, 1)
        assert item["choices"][0] != item["choices"][1]
        assert item["prefix"].strip() and all(c.strip() for c in item["choices"])
    # the true continuation alternates between the two positions
    assert [i["label"] for i in items] == [0, 1] * 20


def test_the_labelled_choice_is_the_true_continuation(items):
    """Read each source file again: the prefix is the text at ``offset``, the labelled choice
    the 40 characters after it, the other choice text found outside that window."""
    for item in items:
        text = (STDLIB / item["source"]).read_text(encoding="utf-8")
        start = item["offset"]
        assert start == 0 or text[start - 1] == "\n"  # the window starts at a line
        assert text[start : start + 300] == item["prefix"]
        correct = item["choices"][item["label"]]
        other = item["choices"][1 - item["label"]]
        assert text[start + 300 : start + 340] == correct
        found = [m.start() for m in re.finditer(re.escape(other), text)]
        assert any(p + 40 <= start or p >= start + 340 for p in found), found


def test_items_come_from_files_the_demo_holds_out(items, tmp_path):
    """hlat-train demo's corpus builder, run here: every item's file is one of its validation
    documents, and no item's prefix and continuation occur in its training documents (the
    codec tables under ``encodings/`` share most of their lines: such windows are skipped)."""
    import pyarrow as pa

    from hlat_train.demo import build_corpus

    train, valid = build_corpus(str(tmp_path / "corpus"))

    def texts(path: str) -> list[str]:
        with pa.memory_map(path) as source:
            return pa.ipc.open_file(source).read_all().column("text").to_pylist()

    train_docs, valid_docs = texts(train), set(texts(valid))
    train_text = "\0".join(train_docs)
    for item in items:
        text = (STDLIB / item["source"]).read_text(encoding="utf-8")
        assert text in valid_docs
        assert item["prefix"] + item["choices"][item["label"]] not in train_text


def test_too_many_items_is_refused():
    with pytest.raises(ev.UsageError, match=r"at most \d+ items"):
        ev.build_items(10**6)


def test_task_files_are_written_and_loadable(items, tmp_path):
    yaml = pytest.importorskip("yaml")
    data, config = ev.write_task(items, tmp_path / "tasks")
    assert data == tmp_path / "tasks" / "stdlib_completion.jsonl"
    assert config == tmp_path / "tasks" / "stdlib_completion.yaml"
    lines = data.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == items
    task = yaml.safe_load(config.read_text(encoding="utf-8"))
    assert task["task"] == "stdlib_completion"
    assert task["dataset_path"] == "json"
    assert task["dataset_kwargs"]["data_files"]["test"] == str(data.resolve())
    assert task["test_split"] == "test"
    assert task["output_type"] == "multiple_choice"
    # fields of the documents: the prefix is the context, each choice follows it directly
    assert task["doc_to_text"] == "prefix"
    assert task["doc_to_choice"] == "choices"
    assert task["doc_to_target"] == "label"
    assert task["target_delimiter"] == ""
    assert task["metric_list"] == [
        {"metric": "acc", "aggregation": "mean", "higher_is_better": True}
    ]


def test_task_yaml_quotes_awkward_paths(tmp_path):
    yaml = pytest.importorskip("yaml")
    folder = tmp_path / 'a dir: with "quotes" #and a hash'
    data, config = ev.write_task([], folder)
    task = yaml.safe_load(config.read_text(encoding="utf-8"))
    assert task["dataset_kwargs"]["data_files"]["test"] == str(data.resolve())


# --- results ---------------------------------------------------------------------------------


def test_jsonable_keeps_only_what_json_holds():
    np = pytest.importorskip("numpy")
    value = {
        "a": (1, 2.5, "x"),
        3: {"nested": [None, True, np.float64(0.25), np.arange(3)]},
        "nan": float("nan"),
        "object": object(),
        "function": len,
        "list": [object(), 1],
    }
    got = ev.jsonable(value)
    assert got == {
        "a": [1, 2.5, "x"],
        "3": {"nested": [None, True, 0.25, [0, 1, 2]]},
        "nan": "nan",
        "list": [1],
    }
    json.dumps(got)


def test_result_line():
    results = {
        "results": {"stdlib_completion": {"acc,none": 0.625, "acc_stderr,none": 0.0776}},
        "n-samples": {"stdlib_completion": {"original": 40, "effective": 40}},
    }
    line = ev.result_line(results, "stdlib_completion", 19.24, 31.04)
    assert line == "stdlib_completion: acc 0.625 ± 0.078 (40 items, 19.2 s scoring, 31.0 s in all)"
    del results["n-samples"]
    assert ev.result_line(results, "stdlib_completion", 2.0) == (
        "stdlib_completion: acc 0.625 ± 0.078 (2.0 s scoring)"
    )


# --- the command line ------------------------------------------------------------------------


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        ev.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("checkpoint", "--out", "--limit", "--batch-size", "--items"):
        assert option in out


def _error(capsys, argv: list[str]) -> str:
    assert ev.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing started
    return captured.err


@pytest.fixture
def lm_eval_present(monkeypatch):
    """The errors about arguments come first whether or not lm_eval is installed."""
    monkeypatch.setattr(ev, "_installed", lambda module: True)


def test_missing_checkpoint_directory(capsys, tmp_path, lm_eval_present):
    missing = tmp_path / "no-such-run" / "checkpoints"
    err = _error(capsys, [str(missing), "--out", str(tmp_path / "out")])
    assert f"checkpoint directory {missing} does not exist" in err
    assert not (tmp_path / "out").exists()


def test_directory_that_is_not_a_checkpoint(capsys, tmp_path, lm_eval_present):
    (tmp_path / "empty").mkdir()
    err = _error(capsys, [str(tmp_path / "empty"), "--out", str(tmp_path / "out")])
    assert "not a checkpoint directory written by hlat-train" in err
    assert "hlat-train-config.toml" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", ["--limit", "--batch-size", "--items", "--train-steps"])
def test_counts_must_be_positive(capsys, tmp_path, option, lm_eval_present):
    err = _error(capsys, [option, "0", "--out", str(tmp_path / "out")])
    assert f"{option} must be at least 1, got 0" in err
    assert not (tmp_path / "out").exists()


def test_too_many_items_before_any_work(capsys, tmp_path, lm_eval_present):
    err = _error(capsys, ["--items", "1000000", "--out", str(tmp_path / "out")])
    assert "--items 1000000" in err and "at most" in err
    assert not (tmp_path / "out").exists()


def test_lm_eval_missing_names_how_to_install(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(ev, "_installed", lambda module: module != "lm_eval")
    err = _error(capsys, ["--out", str(tmp_path / "out")])
    assert "lm_eval not installed" in err
    assert "pip install" in err and "lm_eval" in err
    assert "nox -s eval" in err
    assert not (tmp_path / "out").exists()


def test_lm_eval_missing_for_real(tmp_path):
    """The script run as a program where lm_eval is not installed (the test environment)."""
    if importlib.util.find_spec("lm_eval") is not None:
        pytest.skip("lm_eval is installed here")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "lm_eval" in done.stderr and "nox -s eval" in done.stderr
    assert not (tmp_path / "out").exists()


# --- a full small run (where lm_eval is installed) -------------------------------------------


@pytest.mark.slow
def test_full_run_with_lm_eval(tmp_path):
    """Train 20 steps of tiny-check, export, score the first 8 items with lm_eval; then check
    lm_eval's per-item log-likelihoods against the exported model run by transformers."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "eval"
    env = {**os.environ, "HLAT_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "2"}
    args = ["--out", str(out), "--limit", "8", "--batch-size", "4", "--train-steps", "20"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    print(done.stdout, done.stderr)  # shown when the test fails
    assert done.returncode == 0
    line = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"stdlib_completion: acc \d\.\d{3} ± \d\.\d{3} "
        r"\(8 items, \d+\.\d s scoring, \d+\.\d s in all\)",
        line,
    ), line

    results = json.loads((out / "results.json").read_text())
    metrics = results["results"]["stdlib_completion"]
    assert 0.0 <= metrics["acc,none"] <= 1.0
    assert metrics["acc_stderr,none"] > 0
    assert results["n-samples"]["stdlib_completion"]["effective"] == 8
    assert results["hlat"]["checkpoint"] == str(out / "train" / "checkpoints")
    assert f"acc {metrics['acc,none']:.3f}" in line

    items = [json.loads(x) for x in (out / "tasks" / "stdlib_completion.jsonl").open()]
    samples = sorted(results["samples"]["stdlib_completion"], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == items[:8]
    hf_dir = out / "hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    correct = 0
    for sample, item in zip(samples, items, strict=False):
        # the prefix is the context, each choice its continuation, nothing between
        assert sample["arguments"] == [[item["prefix"], c] for c in item["choices"]]
        assert sample["target"] == item["label"]
        ours = [_loglikelihood(model, tokenizer, item["prefix"], c) for c in item["choices"]]
        theirs = [r[0][0] for r in sample["resps"]]
        # lm_eval batches padded sequences: the same sums up to float rounding (measured:
        # below 2e-4 relative); another tokenization or delimiter would differ by nats
        assert ours == pytest.approx(theirs, rel=1e-3, abs=1e-2)
        chosen = max(range(2), key=lambda i: theirs[i])
        assert sample["acc"] == float(chosen == item["label"])
        correct += chosen == item["label"]
    assert math.isclose(metrics["acc,none"], correct / 8)


def _loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), tokenized as lm_eval does: trailing spaces of the
    context move to the continuation, whose tokens are those of the whole text after the
    context's."""
    import torch

    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n_context = len(tokenizer.encode(context, add_special_tokens=False))
    target = whole[n_context:]
    with torch.no_grad():
        logits = model(torch.tensor([whole[:-1]])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[-len(target) :]
    return float(logprobs.gather(1, torch.tensor(target)[:, None]).sum())
