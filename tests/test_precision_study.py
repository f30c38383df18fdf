"""tools/precision_study.py run for real in its smoke mode: two modes side by side on a shared
tokenizer, then merged, as docs/precision.md describes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "precision_study.py"


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_modes_run_separately_share_a_tokenizer_and_merge(tmp_path):
    tok = tmp_path / "tok.model"
    common = ["--quick", "--steps", "6", "--eval-every", "3", "--threads", "1"]
    for mode in ("bf16", "bf16-sr"):
        _run(*common, "--modes", mode, "--tokenizer", str(tok), "--out", str(tmp_path / mode))
    assert tok.exists()
    _run("--merge", str(tmp_path / "bf16"), str(tmp_path / "bf16-sr"), "--out", str(tmp_path))

    records = [json.loads(line) for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
    by_mode: dict[str, list[dict]] = {}
    for r in records:
        if "mode" in r:
            by_mode.setdefault(r["mode"], []).append(r)
    assert set(by_mode) == {"bf16", "bf16-sr"}
    steps = {m: [r["step"] for r in rows if "train_loss" in r] for m, rows in by_mode.items()}
    assert steps["bf16"] == steps["bf16-sr"] and steps["bf16"]
    assert max(steps["bf16"]) == 6  # --steps given beside --quick wins over its 30
    for rows in by_mode.values():
        assert all(0 < r["train_loss"] < 20 for r in rows if "train_loss" in r)
    summary = (tmp_path / "summary.md").read_text()
    assert "| bf16 |" in summary and "| bf16-sr |" in summary
    assert (tmp_path / "losses.png").stat().st_size > 0
