"""How large the generated runs are: the default suite's sizes, or the long ones under ``pytest --full``.

``FULL`` is set by ``tests/conftest.py`` from ``--full`` (or ``UCMAGIC_FULL=1``) before test modules are
imported. Use :func:`examples` for hypothesis example counts and :func:`pick` for other sizes, and mark a
test that only makes sense as a long run with ``@pytest.mark.full``.
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Iterator, Sequence, TypeVar

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


def cell_pairs(cell: dict[str, Any], names: Sequence[str]) -> set[tuple[str, Any, str, Any]]:
    return {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(names, 2)}


def all_pairs(dims: dict[str, list[Any]], possible: Callable[[dict[str, Any]], bool],
              cost: Callable[[dict[str, Any]], float] = lambda c: 0.0) -> list[dict[str, Any]]:
    """A deterministic all-pairs sample of low total cost: every pair of values (of two dimensions)
    that some possible cell holds is held by at least one chosen cell.

    Greedy first (each step takes the possible cell that covers the most uncovered pairs per square
    root of its cost: cheap cells first, without trading one costly cell for many that each cover a
    pair; ties go to the cheaper cell, then to product order), then a local search until no move is left: a chosen
    cell is dropped, or replaced by a cheaper possible cell, or two chosen cells swap their values of
    one dimension for a cheaper pair of possible cells, wherever every pair stays covered."""
    names = list(dims)
    cells = [c for c in (dict(zip(names, vals)) for vals in itertools.product(*dims.values())) if possible(c)]
    index = {tuple(c.values()): i for i, c in enumerate(cells)}
    pairs = [cell_pairs(c, names) for c in cells]
    costs = [max(cost(c), 1e-9) for c in cells]
    uncovered: set[tuple[str, Any, str, Any]] = set().union(*pairs) if pairs else set()
    chosen: list[int] = []
    while uncovered:
        best = max(range(len(cells)), key=lambda i: (len(pairs[i] & uncovered) / costs[i] ** 0.5, -costs[i], -i))
        chosen.append(best)
        uncovered -= pairs[best]
    held: dict[tuple[str, Any, str, Any], int] = {}  # how many chosen cells hold each pair
    for i in chosen:
        for p in pairs[i]:
            held[p] = held.get(p, 0) + 1

    def swap(old: Sequence[int], new: Sequence[int]) -> bool:
        """Replace the chosen cells ``old`` by ``new`` if every pair stays covered."""
        for i in old:
            for p in pairs[i]:
                held[p] -= 1
        for j in new:
            for p in pairs[j]:
                held[p] = held.get(p, 0) + 1
        if all(held[p] > 0 for i in old for p in pairs[i]):
            chosen[:] = [i for i in chosen if i not in old] + list(new)
            return True
        for j in new:  # undo
            for p in pairs[j]:
                held[p] -= 1
        for i in old:
            for p in pairs[i]:
                held[p] += 1
        return False

    def moves() -> Iterator[tuple[list[int], list[int]]]:
        """Candidate moves, each cheaper than what it replaces, in a fixed order."""
        taken = set(chosen)
        for i in sorted(chosen, key=lambda i: (-costs[i], i)):
            yield [i], []
            for j in sorted(range(len(cells)), key=lambda j: (costs[j], j)):
                if costs[j] >= costs[i]:
                    break
                if j not in taken:
                    yield [i], [j]
        for i, j in itertools.combinations(sorted(chosen), 2):
            for d in range(len(names)):
                a, b = list(cells[i].values()), list(cells[j].values())
                a[d], b[d] = b[d], a[d]
                ia, ib = index.get(tuple(a)), index.get(tuple(b))
                if (ia is not None and ib is not None and ia not in taken and ib not in taken and ia != ib
                        and costs[ia] + costs[ib] < costs[i] + costs[j]):
                    yield [i, j], [ia, ib]

    while any(swap(old, new) for old, new in moves()):
        pass
    return [cells[i] for i in sorted(chosen)]
