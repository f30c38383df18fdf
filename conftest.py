"""Collects every package README's ```python blocks as one test, so the examples keep working."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.name == "README.md" and file_path.parent.parent.name == "packages":
        return ReadmeFile.from_parent(parent, path=file_path)
    return None


class ReadmeFile(pytest.File):
    def collect(self):
        code = "\n".join(_BLOCK.findall(self.path.read_text()))
        if code:
            yield ReadmeExample.from_parent(self, name="example", code=code)


class ReadmeExample(pytest.Item):
    def __init__(self, *, code: str, **kwargs):
        super().__init__(**kwargs)
        self.code = code

    def runtest(self) -> None:
        tmp = self.config._tmp_path_factory.mktemp("readme")
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(tmp)
            exec(compile(self.code, str(self.path), "exec"), {"__name__": "__readme__"})

    def reportinfo(self):
        return self.path, 0, f"{self.path.parent.name} README example"
