"""The one hook from the engine to a display layer.

``DataLoader.monitor()``, ``LoaderStats.plot()``, ``LoaderStats.explore()`` and the notebook bar of
``progress.Progress`` show things; the engine holds no display code and imports no display module.
A display layer registers a function per name when it is imported (``ucmagic.notebook`` registers
``"monitor"``, ``"plot"``, ``"explore"`` and ``"progress_bar"`` in its ``__init__``); the engine
looks the name up here. A name nobody registered yet
imports :data:`PROVIDER` first, by name, the way an entry point is loaded -- the one place the
engine names the notebook layer (tests/test_conventions.py checks that).

Each presenter takes the object to show as its first argument, then the method's keywords:
``monitor(loader, **kw)``, ``plot(stats, **kw)``, ``explore(stats, **kw)``; ``progress_bar(desc, total)``
returns an object with ``draw(done, total, text, *, final, failed)``.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

PROVIDER = "ucmagic.notebook"  # the package that registers the default presenters when imported

Presenter = Callable[..., Any]

_registry: dict[str, Presenter] = {}


def register_presenter(name: str, fn: Presenter) -> None:
    """Show ``name`` (``"monitor"``, ``"plot"``, ``"explore"``) with ``fn`` from now on."""
    _registry[name] = fn


def presenter(name: str) -> Presenter:
    """The function registered for ``name``, importing :data:`PROVIDER` when none is yet."""
    if name not in _registry:
        importlib.import_module(PROVIDER)
    try:
        return _registry[name]
    except KeyError:
        raise LookupError(f"no presenter {name!r} registered: import a display layer that registers one "
                          f"with ucmagic.presenters.register_presenter({name!r}, fn)") from None
