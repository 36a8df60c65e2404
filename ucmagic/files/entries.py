"""What a listing is made of: :class:`FileEntry` and :class:`DirScan`, glob patterns, safe relative paths and the
listing fingerprint (pure functions)."""
from __future__ import annotations

import hashlib
import itertools
import re
from functools import lru_cache
from typing import Iterable, Iterator, NamedTuple, Sequence


class FileEntry(NamedTuple):
    """One file of a listing: path relative to the volume root (POSIX separators), size, mtime."""

    path: str
    size: int
    mtime: float


class DirScan(NamedTuple):
    """One step of a streaming listing (:meth:`Volume.scan`): the files found in one directory.

    ``dir`` is relative to the volume root (``""`` for the root); ``mtime_ns`` is the directory's
    mtime taken *before* it was read (``-1`` where the volume keeps no directory mtimes);
    ``files`` are the matching files directly in it, with paths relative to the root.
    """

    dir: str
    mtime_ns: int
    files: list[FileEntry]


# ---------------------------------------------------------------- glob patterns (pure)

@lru_cache(maxsize=128)
def compile_pattern(pattern: str, *, anchored: bool = False) -> re.Pattern[str]:
    """Translate a glob into a regex over relative POSIX paths.

    ``*`` and ``?`` stay inside one path segment, ``**`` spans segments (``**/`` also matches
    nothing), ``[abc]`` is a character class. A pattern without ``/`` matches the file name at any
    depth (``"*.jpg"`` finds every JPEG in the tree), like ``.gitignore``; with ``anchored`` it
    matches from the root only, as a shell (and fsspec's ``glob``) does.
    """
    pat = pattern.strip().lstrip("/") if pattern.startswith("/") else pattern.strip()
    if "/" not in pat and not anchored:
        pat = "**/" + pat
    out: list[str] = []
    i, n = 0, len(pat)
    while i < n:
        c = pat[i]
        if pat.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pat.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = pat.find("]", i + 2 if pat[i + 1:i + 2] in ("!", "]") else i + 1)
            if j < 0:
                out.append(re.escape(c))
                i += 1
                continue
            body = pat[i + 1:j]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


def filter_entries(entries: Iterable[FileEntry], pattern: str | None) -> list[FileEntry]:
    """Keep the entries matching ``pattern`` (all when None), sorted by path."""
    rx = compile_pattern(pattern) if pattern else None
    return sorted((e for e in entries if rx is None or rx.match(e.path)), key=lambda e: e.path)


def is_safe_rel(rel: str) -> bool:
    """True for a relative path whose parts are plain names (no ``..``, ``.``, empty part or NUL).

    Some object stores accept keys such as ``a/../../x``; joined to a destination directory they
    would point outside it, so listings drop them.
    """
    return bool(rel) and "\0" not in rel and not rel.startswith("/") and \
        all(part not in ("", ".", "..") for part in rel.split("/"))


def fingerprint_rows(chunks: Iterable[tuple[Sequence[bytes], Sequence[int]]]) -> str:
    """The listing fingerprint (one home): SHA-256 of ``path\\0size\\n`` rows, 16 hex digits. Fed in
    chunks of (UTF-8 paths, sizes), each joined into one buffer: one hash update per chunk, not two per
    file (the listing feeds its Arrow columns 64K rows at a time)."""
    h = hashlib.sha256()
    for paths, sizes in chunks:
        h.update(b"".join([p + b"\0%d\n" % s for p, s in zip(paths, sizes)]))
    return h.hexdigest()[:16]


def listing_fingerprint(entries: Iterable[FileEntry]) -> str:
    """A short stable hash of a listing's paths and sizes (resume states carry it)."""
    rows = iter(entries)

    def chunks() -> Iterator[tuple[list[bytes], list[int]]]:
        while part := list(itertools.islice(rows, 1 << 16)):
            yield [e.path.encode("utf-8", "surrogateescape") for e in part], [e.size for e in part]
    return fingerprint_rows(chunks())
