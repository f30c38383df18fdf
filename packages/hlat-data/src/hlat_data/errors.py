"""The one exception type of hlat-data."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input or a bad request: the message says what was wrong, where, and what to do."""
