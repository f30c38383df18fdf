"""The ``hlat-train`` command explains itself: every config key in ``--help`` with its type,
default and docstring; bare boolean flags; clear errors for the rest."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from hlat_train import TrainConfig
from hlat_train.cli import main
from hlat_train.confighelp import field_docs, plain


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "print-config", "plan"])
def test_help_lists_every_key_with_its_type_default_and_docstring(command, capsys):
    text = _help(command, capsys)
    flat = " ".join(text.split())
    config = TrainConfig()
    for section in dataclasses.fields(TrainConfig):
        values = getattr(config, section.name)
        assert f"[{section.name}]" in text
        docs = field_docs(type(values))
        for f in dataclasses.fields(values):
            default = getattr(values, f.name)
            shown = "(preset)" if default is None else repr(default)
            assert f"--{section.name}.{f.name}  " in text, f.name
            line = next(x for x in text.splitlines() if f"--{section.name}.{f.name}  " in x)
            assert line.endswith(f"default {shown}"), line
            assert docs[f.name], f"{section.name}.{f.name} has no docstring"
            assert " ".join(plain(docs[f.name]).split()) in flat
    assert "``" not in text and ":func:" not in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_bare_boolean_flags_set_true_and_no_prefix_sets_false(capsys):
    code = main(
        ["print-config", "--config", "tiny-check", "--no-check-files",
         "--checkpoint.async_save", "--no-logging.progress", "--train.steps", "7",
         "--no-data.document_mask"]
    )  # fmt: skip
    assert code == 0
    toml = capsys.readouterr().out
    assert "async_save = true" in toml
    assert "progress = false" in toml
    assert "document_mask = false" in toml
    assert "steps = 7" in toml


def test_a_bare_key_that_is_not_boolean_is_refused_naming_it(capsys):
    code = main(["print-config", "--config", "tiny-check", "--train.steps"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--train.steps has no value" in err and "only boolean keys" in err


def test_help_costs_no_torch_import():
    code = "import sys; from hlat_train.cli import main\ntry:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
