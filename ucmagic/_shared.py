"""Values in shared memory that DataLoader worker processes write and the main process reads, and
their one pickling rule.

The rule (:class:`SharedMemory`): while a worker process is being started (fork, spawn or
forkserver), the object pickles as its shared buffers, so parent and workers see one memory; any
other pickle (a user saving the dataset object, ``copy.deepcopy``) carries a plain snapshot and
unpickles into fresh memory of its own. Each value is written by one process per slot or index,
so no locks are needed.

Home of every shared-memory type: :class:`SharedInt`, :class:`SharedInts`, :class:`SharedBits` (the
per-file bitset of ``dataset.CheckedFiles`` and ``cache.SeenEntries``) here, ``telemetry.SharedCounters``
on the same base.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
from multiprocessing import context
from typing import Any, Generic, Sequence, TypeVar

import numpy as np

B = TypeVar("B")  # the shared buffers a starting worker receives
S = TypeVar("S")  # the plain snapshot any other pickle carries


def starting_worker() -> bool:
    """True while this pickle goes to a worker process being started (shared memory may travel)."""
    return context.get_spawning_popen() is not None


class SharedMemory(Generic[B, S]):
    """Base of the shared-memory types: subclasses say what their buffers and their snapshot are."""

    def _buffers(self) -> B:
        """The shared buffers, as one picklable object (what a starting worker receives)."""
        raise NotImplementedError

    def _attach(self, buffers: B) -> None:
        """Use ``buffers`` (from :meth:`_buffers` in the parent) as this object's memory."""
        raise NotImplementedError

    def _snapshot(self) -> S:
        """A plain copy of the values (for any other pickle)."""
        raise NotImplementedError

    def _restore(self, snapshot: S) -> None:
        """Fresh shared memory holding ``snapshot``."""
        raise NotImplementedError

    def __getstate__(self) -> dict[str, B | S]:
        return {"shared": self._buffers()} if starting_worker() else {"copy": self._snapshot()}

    def __setstate__(self, state: dict[str, Any]) -> None:  # what a pickle brings back
        if "shared" in state:
            self._attach(state["shared"])
        else:
            self._restore(state["copy"])


class SharedInt(SharedMemory[ctypes.c_int64, int]):
    """One integer in shared memory (the epoch number)."""

    def __init__(self, value: int = 0) -> None:
        self._v = mp.get_context().RawValue(ctypes.c_int64, value)

    @property
    def value(self) -> int:
        return int(self._v.value)

    @value.setter
    def value(self, v: int) -> None:
        self._v.value = int(v)

    def _buffers(self) -> ctypes.c_int64:
        return self._v

    def _attach(self, buffers: ctypes.c_int64) -> None:
        self._v = buffers

    def _snapshot(self) -> int:
        return self.value

    def _restore(self, snapshot: int) -> None:
        SharedInt.__init__(self, snapshot)


class SharedInts(SharedMemory["ctypes.Array[ctypes.c_int64]", "list[int]"]):
    """A fixed array of integers in shared memory.

    Each index is written by one process at a time (no lock); readers see a recent value.
    """

    def __init__(self, n: int) -> None:
        self._a = mp.get_context().RawArray(ctypes.c_int64, int(n))

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, i: int) -> int:
        return int(self._a[i])

    def __setitem__(self, i: int, v: int) -> None:
        self._a[i] = int(v)

    def _buffers(self) -> ctypes.Array[ctypes.c_int64]:
        return self._a

    def _attach(self, buffers: ctypes.Array[ctypes.c_int64]) -> None:
        self._a = buffers

    def _snapshot(self) -> list[int]:
        return list(self._a)

    def _restore(self, snapshot: list[int]) -> None:
        SharedInts.__init__(self, len(snapshot))
        values: list[ctypes.c_int64 | int] = list(snapshot)
        self._a[:] = values


class SharedBits(SharedMemory["tuple[int, ctypes.Array[ctypes.c_uint8]]", "tuple[int, bytes]"]):
    """A bit per index ``0 .. n-1`` in shared memory (n/8 bytes): the one per-file bitset type
    (``dataset.CheckedFiles``: files checked against the volume, seen by every worker;
    ``cache.SeenEntries``: entries this process found).

    Setting is not atomic across processes: two setting bits of one byte at once may lose one, so
    a missing bit must only mean "look again". A plain pickle carries the bits (:meth:`_snapshot`;
    a subclass may forget them instead).
    """

    def __init__(self, n: int) -> None:
        self._attach((int(n), mp.get_context().RawArray(ctypes.c_uint8, int(n) // 8 + 1)))

    def __contains__(self, i: int) -> bool:
        return bool(self._a[i >> 3] >> (i & 7) & 1)

    def add(self, i: int) -> None:
        self._a[i >> 3] |= 1 << (i & 7)

    def add_many(self, indices: np.ndarray) -> None:
        """Set the bits of ``indices`` (int64 array)."""
        np.bitwise_or.at(self._view, indices >> 3, (1 << (indices & 7)).astype(np.uint8))

    def known(self, indices: np.ndarray) -> np.ndarray:
        """A bool per index of ``indices`` (int64 array): its bit is set."""
        bits: np.ndarray = self._view[indices >> 3] >> (indices & 7) & 1
        return bits.astype(bool)

    def prefix(self, indices: Sequence[int] | np.ndarray) -> int:
        """How many of ``indices``, from the first, have their bit set (vectorised)."""
        if not len(indices):
            return 0
        ok = self.known(np.asarray(indices, dtype=np.int64))
        return len(ok) if ok.all() else int(np.argmin(ok))

    def clear(self) -> None:
        self._view[:] = 0

    def _buffers(self) -> tuple[int, ctypes.Array[ctypes.c_uint8]]:
        return self.n, self._a

    def _attach(self, buffers: tuple[int, ctypes.Array[ctypes.c_uint8]]) -> None:
        self.n, self._a = buffers
        self._view = np.frombuffer(memoryview(self._a), dtype=np.uint8)

    def _snapshot(self) -> tuple[int, bytes]:
        return self.n, bytes(self._a)

    def _restore(self, snapshot: tuple[int, bytes]) -> None:
        n, bits = snapshot
        SharedBits.__init__(self, n)
        if bits:
            self._view[:len(bits)] = np.frombuffer(bits, dtype=np.uint8)
