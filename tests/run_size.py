"""How large the generated runs are: the default suite's sizes, or the long ones under ``pytest --full``.

``FULL`` is set by ``tests/conftest.py`` from ``--full`` (or ``UCMAGIC_FULL=1``) before test modules are
imported. Use :func:`examples` for hypothesis example counts and :func:`pick` for other sizes, and mark a
test that only makes sense as a long run with ``@pytest.mark.full``.
"""
from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")

FULL = os.environ.get("UCMAGIC_FULL") == "1"


def pick(default: T, full: T) -> T:
    """``full`` under ``pytest --full``, else ``default``."""
    return full if FULL else default


def examples(default: int, full: int) -> int:
    """A hypothesis ``max_examples``: ``default`` in the default suite, ``full`` under ``--full``."""
    return pick(default, full)
