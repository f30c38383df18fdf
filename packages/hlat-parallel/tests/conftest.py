"""The test folder on the import path: the multi-process tests share their launcher
(``spawn.py``) and import helpers from their worker modules."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
