"""The pack plan (pure): tar member sizes and headers, which sample goes in which shard at which offset, and the
samples of a file tree. A function of the sorted listing and the shard size, so a second run plans the same shards."""
from __future__ import annotations

import hashlib
import tarfile
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import PackError
from ..files.volume import FileEntry
from .index import Member, ShardInfo, shard_info, split_key


BLOCK = tarfile.BLOCKSIZE    # 512
RECORD = tarfile.RECORDSIZE  # 10240: tar files end on a record boundary, as GNU tar and tarfile write them
SHARD_NAME = "shard-{:06d}.tar"


@dataclass(frozen=True)
class PlannedMember:
    """One tar member of the plan: its name, data size, header length and where the data comes from
    (``src``: a path relative to the source volume, or ``data``: bytes held in memory)."""

    name: str
    size: int
    hlen: int
    src: str | None = None
    data: bytes | None = None
    mtime: float = 0.0

    @classmethod
    def make(cls, name: str, size: int, *, src: str | None = None, data: bytes | None = None,
             mtime: float = 0.0) -> "PlannedMember":
        return cls(name, size, header_size(name, size), src, data, mtime)

    def header(self) -> bytes:
        return tar_header(self.name, self.size, self.mtime)

    @property
    def span(self) -> int:
        """Bytes this member takes in the tar: header, data, padding to the block."""
        return self.hlen + padded(self.size)


@dataclass(frozen=True)
class PlannedShard:
    """One shard of the plan: name, members in tar order (with header offsets), total size, digest."""

    name: str
    members: tuple[PlannedMember, ...]
    offsets: tuple[int, ...]  # offset of each member's header
    samples: int
    size: int
    digest: str

    def index_entry(self) -> ShardInfo:
        """The shard as :mod:`.index` records it (members with their data offsets)."""
        return shard_info(self.name, self.size, [index_member(m.name, off + m.hlen, m.size)
                                                 for m, off in zip(self.members, self.offsets)])


def index_member(name: str, data_offset: int, size: int) -> Member:
    ke = split_key(name)
    if ke is None:  # pack names every member <key>.<ext>
        raise AssertionError(f"member {name!r} has no key and extension")
    return Member(ke[0], ke[1], data_offset, size)


def padded(n: int) -> int:
    """``n`` rounded up to a whole number of 512-byte blocks."""
    return -(-n // BLOCK) * BLOCK


def tar_header(name: str, size: int, mtime: float = 0.0) -> bytes:
    """The header block(s) of a regular-file member (ustar; pax records where ustar cannot hold the
    name or size), with fixed owner and mode so equal inputs give equal bytes."""
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.type = size, int(max(0.0, mtime)), 0o644, tarfile.REGTYPE
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def header_size(name: str, size: int) -> int:
    """``len(tar_header(name, size))`` (one block for a short ASCII name and a size under 8 GiB)."""
    if size < 8 ** 11 and len(name) <= 100 and name.isascii():
        return BLOCK
    return len(tar_header(name, size))


def tar_size(spans: Iterable[int]) -> int:
    """Size of a tar holding members of these spans: two zero blocks at the end, padded to a record."""
    return -(-(sum(spans) + 2 * BLOCK) // RECORD) * RECORD


def plan_boundaries(sample_spans: Sequence[int], shard_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` sample ranges, one per shard, filled greedily in order up to ``shard_size``
    bytes (counting the tar's end blocks). A sample that alone exceeds ``shard_size`` gets a shard of
    its own; no shard is empty."""
    out: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, span in enumerate(sample_spans):
        if i > start and tar_size([used, span]) > shard_size:
            out.append((start, i))
            start, used = i, 0
        used += span
    if len(sample_spans) > start:
        out.append((start, len(sample_spans)))
    return out


def member_digest(m: PlannedMember) -> bytes:
    """What identifies a member's content without reading it: name, size and the source's mtime (or a
    CRC of in-memory data)."""
    tail = (f"{m.mtime!r}" if m.data is None else f"crc{zlib.crc32(m.data)}").encode()
    return m.name.encode("utf-8", "surrogateescape") + b"\0%d\0" % m.size + tail + b"\n"


def build_shard(index: int, samples: Sequence[Sequence[PlannedMember]]) -> PlannedShard:
    """The :class:`PlannedShard` holding ``samples`` (each a list of members) as shard ``index``."""
    members: list[PlannedMember] = []
    offsets: list[int] = []
    h = hashlib.sha256()
    off = 0
    for sample in samples:
        for m in sample:
            members.append(m)
            offsets.append(off)
            off += m.span
            h.update(member_digest(m))
    return PlannedShard(SHARD_NAME.format(index), tuple(members), tuple(offsets), len(samples), tar_size([off]),
                        h.hexdigest()[:32])


def plan_shards(samples: Sequence[Sequence[PlannedMember]], shard_size: int) -> list[PlannedShard]:
    """Cut ``samples`` (in order) into shards of at most ``shard_size`` bytes (see :func:`plan_boundaries`)."""
    spans = [sum(m.span for m in s) for s in samples]
    return [build_shard(i, samples[a:b]) for i, (a, b) in enumerate(plan_boundaries(spans, shard_size))]


@dataclass
class TreeSamples:
    """The samples of a file tree: members grouped by key, sorted; class names; files left out."""

    samples: list[list[PlannedMember]]
    classes: list[str] | None
    skipped: list[str]


def group_files(entries: Iterable[FileEntry], *, label_from_folder: bool = False) -> TreeSamples:
    """Group a listing into samples by key (the WebDataset convention: ``cat/0001.jpg`` and
    ``cat/0001.json`` are one sample ``cat/0001``), samples sorted by key and members by extension.

    With ``label_from_folder`` every sample gets a ``cls`` member holding the index (ASCII digits)
    of its top folder in the sorted list of top folders, as torchvision's ``ImageFolder`` numbers
    them. Files whose base name has no extension (``README``), hidden files and WebDataset
    metadata names are left out and listed in ``skipped``.
    """
    by_key: dict[str, list[tuple[str, FileEntry]]] = {}
    skipped: list[str] = []
    for e in entries:
        ke = split_key(e.path)
        if ke is None or any(p.startswith(".") for p in e.path.split("/")):
            skipped.append(e.path)
            continue
        by_key.setdefault(ke[0], []).append((ke[1], e))
    classes: list[str] | None = None
    if label_from_folder:
        flat = sorted(k for k in by_key if "/" not in k)
        if flat:
            raise PackError(f"label_from_folder: {len(flat)} samples sit directly in the source folder (e.g. "
                            f"{flat[0]!r}), so they have no class folder: move them into <class>/ folders or "
                            "pack without label_from_folder")
        classes = sorted({k.split("/", 1)[0] for k in by_key})
    class_index = {c: i for i, c in enumerate(classes or [])}
    samples: list[list[PlannedMember]] = []
    for key in sorted(by_key):
        members = sorted(by_key[key], key=lambda x: x[0])
        sample = [PlannedMember.make(f"{key}.{ext}", e.size, src=e.path, mtime=e.mtime) for ext, e in members]
        if classes is not None:
            if any(ext == "cls" for ext, _ in members):
                raise PackError(f"label_from_folder: sample {key!r} already has a .cls file; pack without "
                                "label_from_folder to keep its own label")
            label = str(class_index[key.split("/", 1)[0]]).encode()
            mtime = max(e.mtime for _, e in members)
            sample.append(PlannedMember.make(f"{key}.cls", len(label), data=label, mtime=mtime))
        samples.append(sample)
    return TreeSamples(samples, classes, sorted(skipped))
