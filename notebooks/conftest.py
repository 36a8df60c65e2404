"""While nbval runs the example notebooks (the README's test command runs them with the tests): a
notebook leaves no ``ucmagic-*`` entry in the temp dir once its kernel is stopped."""
from __future__ import annotations

import os
import tempfile

import pytest

_before: dict[str, set[str]] = {}  # notebook path -> ucmagic-* temp entries present before its first cell


def _ours() -> set[str]:
    where = tempfile.gettempdir()  # the kernels' too: they inherit TMPDIR (tests/conftest.py sets it)
    return {n for n in os.listdir(where) if n.startswith("ucmagic")}


def pytest_runtest_setup(item: pytest.Item) -> None:
    nb = str(item.path)
    if nb.endswith(".ipynb") and nb not in _before:
        _before[nb] = _ours()


@pytest.hookimpl(trylast=True)  # after pytest's own teardown, which stops the notebook's kernel after its last cell
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    nb = str(item.path)
    if nb.endswith(".ipynb") and (nextitem is None or str(nextitem.path) != nb):
        left = sorted(_ours() - _before.pop(nb, set()))
        if left:
            pytest.fail(f"{os.path.basename(nb)} left {left} in the temp dir {tempfile.gettempdir()}", pytrace=False)
