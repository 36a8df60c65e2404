"""While nbval runs the example notebooks (the README's test command runs them with the tests): a
notebook leaves no ``ucmagic-*`` entry in the temp dir once its kernel is stopped."""
from __future__ import annotations

import os
import tempfile

import pytest

_watched: set[str] = set()  # notebooks whose kernel stop is checked


def _ours(where: str) -> set[str]:
    return {n for n in os.listdir(where) if n.startswith("ucmagic")}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A notebook's cells run in order in one kernel: under pytest-xdist (``--dist loadgroup``) on one worker."""
    for item in items:
        if str(item.path).endswith(".ipynb"):
            item.add_marker(pytest.mark.xdist_group(item.path.name))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a notebook's first cell (and before pytest sets up its file node, which starts the
    kernel): note the temp dir's entries and wrap the node's teardown, which stops the kernel, with
    the check. It runs before the session's own teardown (tests/conftest.py removes its temp dir)."""
    nb = item.parent
    if nb is None or not str(item.path).endswith(".ipynb") or str(item.path) in _watched:
        return
    _watched.add(str(item.path))
    where = tempfile.gettempdir()  # the kernels' too: they inherit TMPDIR (tests/conftest.py sets it)
    before = _ours(where)
    stop = nb.teardown

    def stop_and_check() -> None:
        stop()
        left = sorted(_ours(where) - before)
        if left:
            pytest.fail(f"{item.path.name} left {left} in the temp dir {where}", pytrace=False)

    nb.teardown = stop_and_check  # type: ignore[method-assign]
