"""Parsing and formatting of byte sizes ("50GB", "1.5 GiB", 1024) — pure functions."""
from __future__ import annotations

import re

from .errors import SizeParseError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12, "p": 10**15, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str | None) -> int | None:
    """Return a byte count for ``value``: an int, a float, or a string like "50GB", "1.5GiB", "200 mb".

    ``None`` passes through. Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones
    (KiB, MiB, GiB, TiB) powers of 1024. Raises :class:`SizeParseError` for anything else.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise SizeParseError(f"size must be a number of bytes or a string such as '50GB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or value != value:
            raise SizeParseError(f"size must be >= 0 bytes, got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = m.group(2).lower()
            if unit in _UNITS:
                return int(float(m.group(1)) * _UNITS[unit])
        raise SizeParseError(
            f"cannot parse size {value!r}: use a number of bytes or a number with a unit, "
            "e.g. '500MB', '50GB', '1.5GiB'"
        )
    raise SizeParseError(f"size must be a number of bytes or a string such as '50GB', got {type(value).__name__}")


def format_size(nbytes: float) -> str:
    """Human-readable size with decimal units: 1500000 -> '1.5 MB'."""
    n = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover


def short_name(name: str, width: int = 60) -> str:
    """``name`` cut to its last ``width`` characters (``...`` in front) for one-line display."""
    return name if len(name) <= width else "..." + name[-(width - 3):]
