"""How large the generated runs are: the default suite's sizes, or the long ones under ``pytest --full``.

``FULL`` is set by ``tests/conftest.py`` from ``--full`` (or ``UCMAGIC_FULL=1``) before test modules are
imported. Use :func:`examples` for hypothesis example counts and :func:`pick` for other sizes, and mark a
test that only makes sense as a long run with ``@pytest.mark.full``.
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")

FULL = os.environ.get("UCMAGIC_FULL") == "1"


def pick(default: T, full: T) -> T:
    """``full`` under ``pytest --full``, else ``default``."""
    return full if FULL else default


def examples(default: int, full: int) -> int:
    """A hypothesis ``max_examples``: ``default`` in the default suite, ``full`` under ``--full``."""
    return pick(default, full)


def cover(cells: list[dict[str, Any]], names: Sequence[str], strength: int,
          cost: Callable[[dict[str, Any]], float] = lambda c: 1.0) -> list[dict[str, Any]]:
    """A greedy ``strength``-wise covering sample of ``cells``: every combination of ``strength`` values (of
    ``strength`` of the dimensions ``names``) that some cell holds is held by a chosen cell; each step takes
    the cell that covers the most uncovered combinations per unit of cost (ties: the cheaper, then the
    first). Deterministic; the cells' order is kept."""
    def combos(c: dict[str, Any]) -> set[tuple[tuple[str, Any], ...]]:
        return {tuple((n, c[n]) for n in ns) for ns in itertools.combinations(names, strength)}

    held = [combos(c) for c in cells]
    left: set[tuple[tuple[str, Any], ...]] = set().union(*held) if held else set()
    chosen: set[int] = set()
    while left:
        best = max(range(len(cells)), key=lambda i: (len(held[i] & left) / max(cost(cells[i]), 1e-9),
                                                       -cost(cells[i]), -i))
        chosen.add(best)
        left -= held[best]
    return [c for i, c in enumerate(cells) if i in chosen]


def wide(cells: list[dict[str, Any]], names: Sequence[str], costly: Callable[[dict[str, Any]], bool],
         cost: Callable[[dict[str, Any]], float] = lambda c: 1.0) -> list[dict[str, Any]]:
    """The ``--full`` sample (``--matrix=wide``) of a matrix whose whole product does not fit CI: every cheap
    cell, and of the ``costly`` ones (spawned workers: an interpreter and torch's import per worker and epoch)
    an all-pairs sample among themselves (:func:`cover`), so every pair of values is run with spawned workers."""
    dear = [c for c in cells if costly(c)]
    keep = {id(c) for c in cover(dear, names, 2, cost)}
    return [c for c in cells if not costly(c) or id(c) in keep]
