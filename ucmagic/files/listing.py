"""One listing per node: a columnar file under the cache directory, memory-mapped by every process.

A dataset over 10 M files cannot keep a Python list of its files in every rank and DataLoader
worker (about 240 bytes per file each) nor pickle it into each worker. Instead the first process
on a node lists the volume once, under a lock, and writes an Arrow IPC file::

    <cache root>/listings/<key>-<build>.arrow       dir (dictionary-encoded), name, size, mtime, cache key
    <cache root>/listings/<key>-<build>.dirs.arrow  every directory read and its mtime (validation)
    <cache root>/listings/<key>.json                which build is current, when it was last checked

``key`` hashes the volume URI, the pattern and the listing format. Every other process waits on
the lock and maps the same file (``pa.memory_map``): its pages are shared through the page cache,
so a process's own memory does not grow with the number of files, and a :class:`Listing` pickles
as its file path (a few hundred bytes). Each file's cache key (:func:`ucmagic.files.cache_layout.cache_key`, 20
bytes) is stored too, so iterating never hashes paths.

Reuse across restarts is guarded by a re-validation (``validate=``, one of :data:`VALIDATE_MODES`,
the one definition ``UCVolumeDataset`` checks its option against too):

* ``"lazy"`` (``UCVolumeDataset``'s default): directory mtimes up front, as ``"dirs"`` here; the
  dataset checks each file's size and mtime when it first fetches it (on its read-ahead threads),
  so a file rewritten in place raises :class:`~ucmagic.errors.SourceChangedError` instead of being
  served from its old cached copy, without a ``stat`` per file before the first item.
* ``"files"``: every directory's mtime (catches files added, removed or renamed) *and*
  every file's size and mtime (catches a file rewritten in place). One ``stat`` per file and
  directory, no directory reads, in parallel threads.
* ``"dirs"``: directory mtimes only -- one ``stat`` per directory. Catches added, removed and
  renamed files, and files replaced by rename (how most tools update a file), but not a file
  rewritten in place: use it for write-once data sets.
* ``"none"``: reuse without checking (the files never change).

Volumes that keep no directory mtimes (object stores) are re-listed and compared for any mode but
``"none"``; a changed listing is rewritten, an unchanged one kept. Entries modified within
:data:`RACY_S` seconds before a listing was taken cannot be told apart from a later change in
the same clock tick, so such a listing is rebuilt on its next check (as ``git`` does for its index).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .._util import atomic_target
from .cache_layout import cache_key_digest, default_cache_dir, map_relpath, version_stamps
from .locks import file_lock, private_dir
from ..errors import ListingChangedError
from .volume import FileEntry, Volume, fingerprint_rows

LISTING_FORMAT = 3  # 2: the cache-key column; 3: the plain-path column (entries keep source paths)
VALIDATE_MODES = ("lazy", "files", "dirs", "none")  # meanings: the module doc
RACY_S = 1.0  # an entry modified this close before the listing may change again unseen
PROGRESS_AFTER_S = 1.0  # the progress callback starts after this long ...
PROGRESS_EVERY_S = 0.5  # ... and is called at most this often
SUPERSEDED_GRACE_S = 24 * 3600.0  # older builds of a key are kept this long for processes still using them
CHUNK = 1 << 16
BUILD_CHUNK = 1 << 14  # entries gathered as Python objects before they become Arrow columns
STAT_THREADS = 16

ProgressFn = Callable[[int], None]


def _enc(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def _dec(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def _view(arr: Any, dtype: Any) -> np.ndarray:
    """Zero-copy numpy view of a null-free fixed-width Arrow array (``to_numpy`` would import pandas)."""
    dt = np.dtype(dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dt, count=len(arr), offset=arr.offset * dt.itemsize)


def _arrow(a: np.ndarray) -> Any:
    """Zero-copy Arrow array over a numpy array (``pa.array`` would import pandas)."""
    import pyarrow as pa

    a = np.ascontiguousarray(a)
    types = {"uint8": pa.uint8(), "int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64()}
    return pa.Array.from_buffers(types[a.dtype.name], len(a), [None, pa.py_buffer(a)])


def _binary(values: list[bytes], large: bool = True) -> Any:
    """Arrow (large_)binary array of ``values``, built from buffers (``pa.array`` would import pandas)."""
    import pyarrow as pa

    offsets = np.zeros(len(values) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    return pa.Array.from_buffers(pa.large_binary() if large else pa.binary(), len(values),
                                 [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(values))])


def listing_key(volume: Volume, pattern: str | None) -> str:
    """Name of the listing of ``pattern`` under ``volume`` (stable across processes and restarts)."""
    # which symlinks a listing holds depends on the policy: a listing made under "all" is not one for "inside"
    blob = json.dumps([LISTING_FORMAT, volume.uri, pattern or "", volume.follow_symlinks]).encode("utf-8",
                                                                                                  "surrogateescape")
    return hashlib.sha256(blob).hexdigest()[:32]


def listings_dir(cache_root: str | None = None) -> str:
    """``<cache root>/listings`` (created private to the user)."""
    root = os.path.abspath(os.path.expanduser(cache_root)) if cache_root else default_cache_dir()
    return private_dir(os.path.join(root, "listings"), what="listings folder")


# ---------------------------------------------------------------- the mapped listing

class Listing:
    """A sorted listing (path, size, mtime per file) memory-mapped from its Arrow IPC file.

    Indexing is by position in the sorted listing, as in ``volume.list(pattern)``. Nothing per
    file lives in Python objects until asked for; :meth:`entries` decodes a batch of indices at
    once. Pickles as its file path, so sending it to a worker costs a few hundred bytes.
    """

    def __init__(self, path: str) -> None:
        import pyarrow as pa
        from pyarrow import ipc

        self.path = path
        try:
            source = pa.memory_map(path, "r")
        except FileNotFoundError as e:
            raise ListingChangedError(
                f"the listing file {path} is gone (its cache directory was cleared or it was superseded "
                "more than a day ago): create the dataset again"
            ) from e
        reader = ipc.open_file(source)
        if reader.num_record_batches != 1:  # always written as one batch
            raise ListingChangedError(f"the listing file {path} is damaged: remove it and list again")
        rb = reader.get_batch(0)  # zero-copy: the buffers point into the mapping
        meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
        self.meta: dict[str, Any] = json.loads(meta["ucmagic"])
        self._dir = rb.column(0)
        self._name = rb.column(1)
        self._dir_codes = _view(self._dir.indices, np.int32)
        self._dir_values = self._dir.dictionary
        self.sizes: np.ndarray = _view(rb.column(2), np.int64)
        self.mtimes: np.ndarray = _view(rb.column(3), np.float64)
        keys = rb.column(4)
        self._keys = np.frombuffer(keys.buffers()[1], dtype=np.uint8, count=20 * len(keys),
                                   offset=keys.offset * 20).reshape(-1, 20)
        self._plain: np.ndarray = _view(rb.column(5), np.uint8)

    def __reduce__(self) -> tuple[type[Listing], tuple[str]]:
        return (Listing, (self.path,))

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"Listing({self.volume_uri!r}, pattern={self.pattern!r}, files={len(self)}, path={self.path!r})"

    # metadata
    @property
    def volume_uri(self) -> str:
        return str(self.meta["volume_uri"])

    @property
    def pattern(self) -> str | None:
        pattern: str | None = self.meta["pattern"]
        return pattern

    @property
    def fingerprint(self) -> str:
        """Same value as :func:`ucmagic.files.volume.listing_fingerprint` of the same entries."""
        return str(self.meta["fingerprint"])

    @property
    def total_bytes(self) -> int:
        return int(self.meta["total_bytes"])

    @property
    def listed_at(self) -> float:
        """Wall-clock time the listing started."""
        return float(self.meta["listed_at"])

    # entries
    def paths(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """Relative paths of the files at ``indices``."""
        idx = np.asarray(indices, dtype=np.int64)
        dirs = self._dir_values.take(_arrow(self._dir_codes[idx])).to_pylist()
        names = self._name.take(_arrow(idx)).to_pylist()
        return [_dec(d + n) for d, n in zip(dirs, names)]

    def entries(self, indices: Sequence[int] | np.ndarray) -> list[FileEntry]:
        """The files at ``indices`` (vectorised: decode a chunk of a stream at once)."""
        idx = np.asarray(indices, dtype=np.int64)
        return [FileEntry(p, int(s), float(m))
                for p, s, m in zip(self.paths(idx), self.sizes[idx].tolist(), self.mtimes[idx].tolist())]

    def keys(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """The cache keys (:func:`.cache.cache_key` under :attr:`volume_uri`) of the files at ``indices``."""
        h = self._keys[np.asarray(indices, dtype=np.int64)].tobytes().hex()
        return [h[a:a + 40] for a in range(0, len(h), 40)]

    def stamps(self, indices: Sequence[int] | np.ndarray) -> list[int]:
        """The version stamps (:func:`.cache_layout.version_stamp`) of the :meth:`keys` at ``indices``."""
        return version_stamps(self._keys[np.asarray(indices, dtype=np.int64)])

    def all_plain(self, indices: Sequence[int] | np.ndarray) -> bool:
        """True when every file at ``indices`` is its own path inside its cache entry
        (:func:`ucmagic.files.cache_layout.map_relpath` changes nothing), as checked when the listing was built."""
        return bool(self._plain[np.asarray(indices, dtype=np.int64)].all())

    def unplain_indices(self) -> np.ndarray:
        """Indices of the files whose cache entry path differs from their own (see :meth:`all_plain`)."""
        return np.flatnonzero(~self._plain)

    def find(self, rel: str) -> int | None:
        """Index of the file at relative path ``rel`` (a binary search of the sorted paths), else None."""
        target = _enc(rel)
        codes = self._dir_codes
        names = self._name
        dirs = self._dir_values
        lo, hi = 0, len(self)
        while lo < hi:  # about 24 probes for 10 M files
            mid = (lo + hi) // 2
            here = dirs[int(codes[mid])].as_py() + names[mid].as_py()
            if here < target:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(self) and dirs[int(codes[lo])].as_py() + names[lo].as_py() == target:
            return lo
        return None

    def find_key(self, digest: bytes) -> int | None:
        """Index of the file whose cache key digest is ``digest`` (a scan of the key column), else None."""
        hit = np.flatnonzero((self._keys == np.frombuffer(digest, dtype=np.uint8)).all(axis=1))
        return int(hit[0]) if len(hit) else None

    def entry(self, i: int) -> FileEntry:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"listing index {i} out of range for {n} files")
        return self.entries([i % n])[0]

    def iter_entries(self, chunk: int = CHUNK) -> Iterator[FileEntry]:
        """Every file in listing order, decoded ``chunk`` at a time."""
        for a in range(0, len(self), chunk):
            yield from self.entries(np.arange(a, min(a + chunk, len(self))))

    def dirs(self) -> tuple[list[str], np.ndarray]:
        """Every directory read for this listing and its mtime in ns (``-1``: unknown)."""
        import pyarrow as pa
        from pyarrow import ipc

        t = ipc.open_file(pa.memory_map(self.path[:-len(".arrow")] + ".dirs.arrow", "r")).read_all()
        return [_dec(b) for b in t.column(0).to_pylist()], _view(t.column(1).combine_chunks(), np.int64)


# ---------------------------------------------------------------- building

def _collect(volume: Volume, pattern: str | None, progress: ProgressFn | None, *,
             keys: bool = True) -> tuple[Any, ...]:
    """Scan ``volume``; return sorted columns (dirs dict, dir codes, names, sizes, mtimes), the dirs
    read, the fingerprint and (``keys``) the files' cache keys as an ``(n, 20)`` uint8 array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    dir_ids: dict[str, int] = {}
    code_chunks, name_chunks, path_chunks, size_chunks, mtime_chunks, key_chunks = [], [], [], [], [], []
    codes: list[int] = []
    names: list[bytes] = []
    paths: list[bytes] = []
    sizes: list[int] = []
    mtimes: list[float] = []
    digests: list[bytes] = []
    plains: list[bool] = []  # the file's path is its own cache entry path (map_relpath changes nothing)
    plain_chunks: list[np.ndarray] = []
    uri = volume.uri
    seen_dirs: list[tuple[str, int]] = []
    count = 0
    t0 = time.monotonic()
    last = t0 + PROGRESS_AFTER_S - PROGRESS_EVERY_S

    def flush() -> None:
        code_chunks.append(np.asarray(codes, dtype=np.int32))
        name_chunks.append(_binary(names))
        path_chunks.append(_binary(paths))
        size_chunks.append(np.asarray(sizes, dtype=np.int64))
        mtime_chunks.append(np.asarray(mtimes, dtype=np.float64))
        key_chunks.append(np.frombuffer(b"".join(digests), dtype=np.uint8))
        plain_chunks.append(np.asarray(plains, dtype=np.uint8))
        for chunk in (codes, names, paths, sizes, mtimes, digests, plains):
            chunk.clear()

    for d in volume.scan(pattern):
        seen_dirs.append((d.dir, d.mtime_ns))
        files = d.files
        split = [e.path.rpartition("/") for e in files]
        for head in {h for h, _, _ in split}:
            if head not in dir_ids:
                dir_ids[head] = len(dir_ids)
        codes.extend([dir_ids[h] for h, _, _ in split])
        names.extend([n.encode("utf-8", "surrogateescape") for _, _, n in split])
        paths.extend([e.path.encode("utf-8", "surrogateescape") for e in files])
        sizes.extend([e.size for e in files])
        mtimes.extend([e.mtime for e in files])
        if keys:
            digests.extend([cache_key_digest(uri, e.path, e.size, e.mtime) for e in files])
            plains.extend([map_relpath(e.path) == e.path for e in files])
        count += len(files)
        if len(codes) >= BUILD_CHUNK:
            flush()
        if progress is not None:
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                progress(count)
    flush()
    if progress is not None and time.monotonic() - t0 >= PROGRESS_AFTER_S:
        progress(count)
    if count == 0:
        raise volume.empty_listing_error(pattern)
    dict_values = _binary([_enc(h + "/") if h else b"" for h in dir_ids], large=False)
    # concatenate column by column, dropping the chunks as we go (the builder's peak is at the sort)
    code_arr = np.concatenate(code_chunks)
    code_chunks.clear()
    full = pa.concat_arrays(path_chunks)
    path_chunks.clear()
    # sort by the full path, as volume.list does (UTF-8 byte order is code point order)
    order = _view(pc.sort_indices(full), np.uint64).astype(np.int64)
    size_col = np.concatenate(size_chunks)[order]
    size_chunks.clear()
    fingerprint = _fingerprint(full, order, size_col)
    del full
    mtime_col = np.concatenate(mtime_chunks)[order]
    mtime_chunks.clear()
    names = pa.concat_arrays(name_chunks).take(_arrow(order))
    name_chunks.clear()
    key_col = np.concatenate(key_chunks).reshape(-1, 20)[order] if keys else None
    key_chunks.clear()
    plain_col = np.concatenate(plain_chunks)[order] if keys else None
    plain_chunks.clear()
    return dict_values, code_arr[order], names, size_col, mtime_col, seen_dirs, fingerprint, key_col, plain_col


def _fingerprint(paths: Any, order: np.ndarray, sizes: np.ndarray) -> str:
    """:func:`ucmagic.files.volume.fingerprint_rows` of ``paths[order]`` and ``sizes``, CHUNK rows at a time."""
    return fingerprint_rows((paths.take(_arrow(order[a:a + CHUNK])).to_pylist(), sizes[a:a + CHUNK].tolist())
                            for a in range(0, len(sizes), CHUNK))


def _write(folder: str, key: str, volume: Volume, pattern: str | None, listed_at: float,
           cols: tuple[Any, ...]) -> str:
    """Write a new build of ``key`` (temp files + rename); return its path."""
    import pyarrow as pa
    from pyarrow import ipc

    dict_values, codes, names, sizes, mtimes, seen_dirs, fingerprint, key_col, plain_col = cols
    racy_from = listed_at - RACY_S
    racy = bool((mtimes >= racy_from).any()) or any(m >= racy_from * 1e9 for _, m in seen_dirs if m >= 0)
    meta = {
        "format": LISTING_FORMAT, "volume_uri": volume.uri, "pattern": pattern, "files": len(sizes),
        "total_bytes": int(sizes.sum()), "fingerprint": fingerprint,
        "listed_at": listed_at, "racy": racy, "keeps_dir_mtimes": bool(volume.keeps_dir_mtimes),
    }
    batch = pa.record_batch(
        [pa.DictionaryArray.from_arrays(_arrow(codes.astype(np.int32)), dict_values), names,
         _arrow(sizes.astype(np.int64)), _arrow(mtimes.astype(np.float64)),
         pa.Array.from_buffers(pa.binary(20), len(sizes), [None, pa.py_buffer(np.ascontiguousarray(key_col))]),
         _arrow(plain_col.astype(np.uint8))],
        names=["dir", "name", "size", "mtime", "key", "plain"],
    ).replace_schema_metadata({"ucmagic": json.dumps(meta)})
    dirs_batch = pa.record_batch(
        [_binary([_enc(d) for d, _ in seen_dirs]),
         _arrow(np.array([m for _, m in seen_dirs], dtype=np.int64))], names=["dir", "mtime_ns"])
    base = os.path.join(folder, f"{key}-{int(listed_at * 1000):x}-{uuid.uuid4().hex[:8]}")
    for path, b in ((base + ".dirs.arrow", dirs_batch), (base + ".arrow", batch)):
        with atomic_target(path, f"{path}.tmp-{os.getpid()}") as tmp, ipc.new_file(tmp, b.schema) as w:
            w.write_batch(b)
    return base + ".arrow"


# ---------------------------------------------------------------- validation

def _stat_all(paths: list[str]) -> list[os.stat_result | None]:
    """``os.stat`` of each path (None where it fails), in parallel threads (stat releases the GIL)."""
    def some(part: list[str]) -> list[os.stat_result | None]:
        out: list[os.stat_result | None] = []
        for p in part:
            try:
                out.append(os.stat(p))
            except OSError:
                out.append(None)
        return out

    step = max(64, -(-len(paths) // (4 * STAT_THREADS)))
    parts = [paths[a:a + step] for a in range(0, len(paths), step)]
    if len(parts) <= 1:
        return some(paths)
    with ThreadPoolExecutor(min(STAT_THREADS, len(parts)), thread_name_prefix="ucmagic-check") as pool:
        return [st for got in pool.map(some, parts) for st in got]


def stale_reason(listing: Listing, volume: Volume, validate: str = "files") -> str | None:
    """Why ``listing`` no longer describes ``volume`` (None when it still does), per ``validate``."""
    if validate not in VALIDATE_MODES:
        raise ValueError(f"validate must be one of {VALIDATE_MODES}, got {validate!r}")
    if validate == "none":
        return None
    if listing.meta.get("racy"):
        return "entries were modified just before it was taken"
    if not (volume.keeps_dir_mtimes and listing.meta.get("keeps_dir_mtimes") and hasattr(volume, "root")):
        fresh = _collect(volume, listing.pattern, None, keys=False)
        sizes, mtimes, fingerprint = fresh[3], fresh[4], fresh[6]
        if len(sizes) != len(listing):
            return f"{len(listing)} files then, {len(sizes)} now"
        if not (np.array_equal(sizes, listing.sizes) and np.array_equal(mtimes, listing.mtimes)):
            return "a file's size or mtime changed"
        if fingerprint != listing.fingerprint:
            return "a file was renamed"
        return None
    root = volume.root
    dirs, dir_mtimes = listing.dirs()
    stats = _stat_all([os.path.join(root, d) if d else root for d in dirs])
    for d, st, m in zip(dirs, stats, dir_mtimes.tolist()):
        if st is None or st.st_mtime_ns != m:
            return f"directory {d or '.'!r} changed"
    if validate == "files":
        for a in range(0, len(listing), CHUNK):
            idx = np.arange(a, min(a + CHUNK, len(listing)))
            rels = listing.paths(idx)
            stats = _stat_all([os.path.join(root, p) for p in rels])
            sizes, mtimes = listing.sizes[idx], listing.mtimes[idx]
            for k, st in enumerate(stats):
                if st is None:
                    return f"{rels[k]!r} is gone"
                if st.st_size != sizes[k] or st.st_mtime != mtimes[k]:
                    return f"{rels[k]!r} changed"
    return None


# ---------------------------------------------------------------- open (single flight)

def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            meta: dict[str, Any] = json.load(f)
            return meta
    except (FileNotFoundError, ValueError):
        return None


def _write_json(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _remove_superseded(folder: str, key: str, keep: str) -> None:
    """Drop builds of ``key`` superseded more than a day ago, and temp files a killed builder left."""
    now = time.time()
    for name in os.listdir(folder):
        if not name.startswith(key + "-") and not (name.startswith(key) and ".tmp-" in name):
            continue
        path = os.path.join(folder, name)
        if path == keep or path == keep[:-len(".arrow")] + ".dirs.arrow":
            continue
        with contextlib.suppress(FileNotFoundError):
            if now - os.stat(path).st_mtime > SUPERSEDED_GRACE_S:
                os.unlink(path)


def open_listing(volume: Volume, pattern: str | None = None, cache_root: str | None = None, *,
                 relist: bool = False, validate: str = "files", progress: ProgressFn | None = None) -> Listing:
    """The node's listing of ``pattern`` under ``volume``, built once and memory-mapped.

    The first caller on the machine builds it under a lock while others wait; later callers (other
    ranks, a restarted kernel) map the existing file once it passes ``validate`` (see the module
    doc). ``relist=True`` rebuilds it. A listing built or checked by another caller that finished
    after this call began is taken as is, so ranks starting together share one build or check (and
    one rebuild with ``relist=True``). ``progress`` is called
    with the number of files found so far, from one second into a listing on. Raises
    :class:`~ucmagic.errors.EmptyListingError` when nothing matches.
    """
    if validate not in VALIDATE_MODES:
        raise ValueError(f"validate must be one of {VALIDATE_MODES}, got {validate!r}")
    called_at = time.time()
    folder = listings_dir(cache_root)
    key = listing_key(volume, pattern)
    pointer = os.path.join(folder, key + ".json")
    with file_lock(os.path.join(folder, key + ".lock")):
        cur = _read_json(pointer)
        if cur is not None:
            try:
                listing = Listing(os.path.join(folder, cur["file"]))
            except (ListingChangedError, OSError, KeyError, ValueError):
                listing = None
            if listing is not None:
                if cur.get("checked_at", 0.0) >= called_at:  # built or checked by another caller meanwhile
                    return listing
                if not relist and stale_reason(listing, volume, validate) is None:
                    _write_json(pointer, {"file": cur["file"], "checked_at": time.time()})
                    return listing
        listed_at = time.time()
        path = _write(folder, key, volume, pattern, listed_at, _collect(volume, pattern, progress))
        _write_json(pointer, {"file": os.path.basename(path), "checked_at": time.time()})
        _remove_superseded(folder, key, path)
    return Listing(path)


def forget_listing(listing: Listing) -> bool:
    """Mark ``listing`` stale on this node: the next :func:`open_listing` of its volume and pattern
    lists again whatever ``validate`` says. Returns False when a newer build is current already.

    For a caller that found a file changed which the re-validation it chose does not catch (a
    file rewritten in place under ``validate="dirs"``).
    """
    folder = os.path.dirname(listing.path)
    key = os.path.basename(listing.path).split("-", 1)[0]
    pointer = os.path.join(folder, key + ".json")
    with file_lock(os.path.join(folder, key + ".lock")):
        cur = _read_json(pointer)
        if cur is None or cur.get("file") != os.path.basename(listing.path):
            return False
        os.unlink(pointer)
    return True
