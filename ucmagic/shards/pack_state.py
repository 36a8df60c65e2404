"""A pack's destination and its state: the nesting check, the one-pack-per-destination lock, hidden temp names,
``.ucpack-state.json`` (completed shards, so a killed pack resumes) and the summary of a run."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._util import fsync_dir, is_remote_url
from ..errors import PackError
from ..units import format_size
from ..files.volume import Volume, resolve_local_path
from .index import INDEX_NAME, ShardInfo, dumps_index, write_index
from .pack_plan import PlannedShard


STATE_NAME = ".ucpack-state.json"
LOCK_NAME = ".ucpack.lock"   # held by the pack writing into the directory
TMP_PREFIX = ".ucpack-"
SHARD_RE = re.compile(r"^shard-\d{6}\.tar$")


# ---------------------------------------------------------------- the summary

@dataclass
class PackSummary:
    """What :func:`pack` did; ``str()`` is a one-line summary."""

    source: str
    dest: str
    shards: int = 0            # shards in the pack
    written: int = 0           # ... written by this run
    kept: int = 0              # ... kept from an earlier, interrupted run (verified by size and digest)
    samples: int = 0
    files: int = 0             # tar members (source files, plus cls labels)
    bytes: int = 0             # shard bytes written by this run
    retries: int = 0           # source reads retried by this run (transient errors)
    total_bytes: int = 0       # bytes of all shards
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # source files left out (no extension, hidden)
    classes: list[str] | None = None
    index: str = ""            # path of index.json

    @property
    def mb_per_s(self) -> float:
        """Shard bytes written per second, in MB (10^6 bytes)."""
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        rate = f", {self.mb_per_s:,.1f} MB/s" if self.bytes and self.seconds > 0 else ""
        s = (f"packed {self.samples:,} samples ({format_size(self.total_bytes)}) into {self.shards:,} shards in "
             f"{self.seconds:.1f} s{rate}; {self.written:,} written, {self.kept:,} kept from an earlier run -> "
             f"{self.dest}")
        if self.classes is not None:
            s += f"; {len(self.classes):,} classes"
        if self.retries:
            s += f"; {self.retries:,} reads retried"
        if self.skipped:
            s += f"; {len(self.skipped):,} files without an extension left out (e.g. {self.skipped[0]})"
        return s


# ---------------------------------------------------------------- destination and state

def source_root(src: Any, vol: Volume | None) -> str | None:
    """The local directory behind the source, when there is one (for the nesting check)."""
    if vol is not None:
        return vol.local_root
    if isinstance(src, (str, os.PathLike)) and not is_remote_url(os.fspath(src)):
        p = os.fspath(src)
        return resolve_local_path(p[len("file://"):] if p.startswith("file://") else p)
    return None


def check_dest(src_root: str | None, dest: str) -> None:
    """Refuse a destination inside the source (or the source itself, or one holding the source)."""
    if src_root is None:
        return
    s, d = os.path.realpath(src_root), os.path.realpath(dest)
    if os.path.commonpath([s, d]) == s:
        raise PackError(f"destination {dest} is inside the source {src_root} (or is it): the pack would read "
                        "its own shards; pick a destination outside the source")
    if os.path.commonpath([s, d]) == d:
        raise PackError(f"source {src_root} is inside the destination {dest}: pick a destination outside the source")


def _temp_pid(name: str) -> int | None:
    """The pid in the name of a temp file of ours (a shard's, or the index's or state's atomic write), else None."""
    if name.startswith(TMP_PREFIX) and name.endswith(".tmp"):
        pid = name[len(TMP_PREFIX):].split("-", 1)[0]
    elif name.startswith((INDEX_NAME + ".tmp-", STATE_NAME + ".tmp-")):
        pid = name.split(".tmp-", 1)[1].split("-", 1)[0]
    else:
        return None
    return int(pid) if pid.isdigit() else None


def _is_ours(name: str) -> bool:
    return name in (INDEX_NAME, STATE_NAME, LOCK_NAME) or bool(SHARD_RE.match(name)) or _temp_pid(name) is not None


def prepare_dest(dest: str) -> dict[str, dict[str, Any]]:
    """Create ``dest`` or check that it holds only an earlier pack; remove temp files of killed runs;
    return the completed shards recorded by an earlier run (name -> size, digest)."""
    os.makedirs(dest, exist_ok=True)
    names = _check_ours(dest)
    from ..files.locks import pid_running

    from ..files.locks import unlink_held

    for n in names:  # temp files of a killed run (its pid no longer runs)
        pid = _temp_pid(n)
        if pid is not None and not pid_running(pid):
            with contextlib.suppress(OSError):
                unlink_held(os.path.join(dest, n))
    try:
        with open(os.path.join(dest, STATE_NAME), "rb") as f:
            doc = json.loads(f.read())
        done = doc.get("shards", {}) if isinstance(doc, dict) and doc.get("version") == 1 else {}
        return {k: v for k, v in done.items() if isinstance(v, dict)}
    except (OSError, ValueError):
        return {}


class PackState:
    """``.ucpack-state.json``: the shards completed so far (updated after each rename, atomically)."""

    def __init__(self, dest: str, done: dict[str, dict[str, Any]]) -> None:
        self.path = os.path.join(dest, STATE_NAME)
        self.done = dict(done)
        self.mu = threading.Lock()

    def save(self) -> None:
        from ..files.locks import write_atomically

        write_atomically(self.path, json.dumps({"version": 1, "shards": self.done}, sort_keys=True).encode(), sync=True)

    def complete(self, shard: PlannedShard) -> None:
        with self.mu:
            self.done[shard.name] = {"size": shard.size, "digest": shard.digest}
            self.save()


def is_complete(dest: str, done: Mapping[str, Mapping[str, Any]], name: str, size: int, digest: str) -> bool:
    """True when an earlier run completed shard ``name`` with this size and digest and its file is whole."""
    rec = done.get(name)
    if not rec or rec.get("size") != size or rec.get("digest") != digest:
        return False
    try:
        return os.stat(os.path.join(dest, name)).st_size == size
    except OSError:
        return False


def tmp_name(dest: str, name: str) -> str:
    """A new temp name for shard ``name``: ``.ucpack-<pid>-<random>-<name>.tmp`` (no one can guess it)."""
    return os.path.join(dest, f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}-{name}.tmp")


def open_new(path: str) -> Any:
    """``path`` opened for writing as a new file (``O_EXCL``), never through a symbolic link, through the
    destination's descriptor while the pack holds it (:func:`dest_lock`)."""
    from ..files.locks import create_new

    fd = create_new(path, 0o644)
    try:
        return open(fd, "wb", buffering=1 << 20)  # the caller closes it (a module-level open: tests patch it)
    except BaseException:
        os.close(fd)
        raise



def _write_index(dest: str, shards: Sequence[ShardInfo], classes: list[str] | None) -> str:
    """index.json through :mod:`.index`; with class names, its text plus the extra field ``classes``
    (readers of the format ignore fields they do not know)."""
    if classes is None:
        return write_index(dest, shards)
    from ..files.locks import write_atomically

    doc = json.loads(dumps_index(shards))
    doc["classes"] = classes
    path = os.path.join(dest, INDEX_NAME)
    write_atomically(path, json.dumps(doc, separators=(",", ":")).encode(), sync=True)
    return path


@contextlib.contextmanager
def dest_lock(dest: str, allow_shared: bool = False) -> Iterator[None]:
    """One pack at a time per destination: a second one waits for the first, then finds its shards.
    A destination of another user's or writable by others (or below a folder others may write to) is
    refused unless ``allow_shared``. While the pack runs the destination is held open (:func:`~ucmagic.
    files.locks.hold_dir`): its shards, index and state are made and renamed through that descriptor."""
    from ..files.locks import check_write_dest, file_lock, hold_dir, release_dir

    _check_ours(dest)  # before the lock file is made: a refused directory is left as it was
    os.makedirs(dest, mode=0o755, exist_ok=True)
    check_write_dest(dest, allow_shared=allow_shared, what="pack destination")
    hold_dir(dest, shared_ok=allow_shared, what="pack destination")
    try:
        with file_lock(os.path.join(dest, LOCK_NAME)):
            yield
    finally:
        release_dir(dest)


def _check_ours(dest: str) -> list[str]:
    """The names in ``dest`` (none if it does not exist yet); PackError if it is a file or holds other files."""
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise PackError(f"destination {dest} is a file: pass a directory")
    names = os.listdir(dest) if os.path.isdir(dest) else []
    foreign = sorted(n for n in names if not _is_ours(n))
    if foreign:
        raise PackError(f"destination {dest} is not empty and holds no earlier pack (e.g. {foreign[0]!r}): "
                        "pick an empty or new directory")
    return names


def raise_if_disk_full(exc: BaseException, dest: str) -> None:
    """For a full disk, an OSError saying what to do instead of the bare ENOSPC."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        raise OSError(errno.ENOSPC, f"no space left on the destination {dest}: free space (or pick another "
                                    "destination) and run pack again; the complete shards are kept") from exc


def begin_run(dest: str, kept: dict[str, dict[str, Any]], changes: bool) -> PackState:
    """Record which shards are kept; when anything will change, remove index.json first so that no
    reader sees an index over half-rewritten shards."""
    state = PackState(dest, kept)
    if changes:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(dest, INDEX_NAME))
        state.save()
    return state


def end_run(dest: str, shards: Sequence[ShardInfo], state: PackState, classes: list[str] | None) -> str:
    """Remove shards an earlier plan had beyond this one, then write index.json (last)."""
    names = {s.name for s in shards}
    for n in os.listdir(dest):
        if SHARD_RE.match(n) and n not in names:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(dest, n))
    if set(state.done) - names:
        state.done = {k: v for k, v in state.done.items() if k in names}
        state.save()
    fsync_dir(dest)
    return _write_index(dest, shards, classes)
