"""The descriptors a process keeps open for its cache directories, one set per process.

Every :class:`~ucmagic.files.cache.FileCache` of a process shares them: the small files rewritten
often (the removal token ``locks/removals``, protection records: :class:`KeptOpen`, by absolute path)
and the per-key fill locks of ``locks/fill.lock`` (:class:`KeyLocks`, one per lock file). So a
process holds one descriptor per cache directory for the token and one for the fill locks, however
many dataset objects it creates and drops (before, each dataset object kept its own for good: 1,000
created in a notebook sweep reached the default limit of open files). A forked child gets its own
set at its first use (it must not lock or write through its parent's descriptors).
"""
from __future__ import annotations

import os
import threading

from .cache_layout import KeptOpen
from .locks import KeyLocks

_mu = threading.Lock()
_kept: dict[int, KeptOpen] = {}
_keys: dict[tuple[int, str], KeyLocks] = {}


def kept_open() -> KeptOpen:
    """This process's :class:`KeptOpen` (descriptors of records and removal tokens, by path)."""
    pid = os.getpid()
    kept = _kept.get(pid)
    if kept is None:
        with _mu:
            kept = _kept.get(pid)
            if kept is None:
                _kept.clear()  # a forked child: the parent's entry is not its own
                kept = _kept[pid] = KeptOpen()
    return kept


def key_locks(path: str) -> KeyLocks:
    """This process's :class:`KeyLocks` on the lock file ``path`` (one descriptor, opened on first use)."""
    pid = os.getpid()
    locks = _keys.get((pid, path))
    if locks is None:
        with _mu:
            locks = _keys.get((pid, path))
            if locks is None:
                for stale in [k for k in _keys if k[0] != pid]:
                    del _keys[stale]
                locks = _keys[(pid, path)] = KeyLocks(path)
    return locks
