"""Sample datasets over big files: map-style access by index and a planned, resumable stream.

A :class:`ShardDataset` knows, for each sample index, which byte ranges of which files hold it
and how to turn those bytes into a sample (:mod:`.webdataset`: tar members; :mod:`.tokens`:
token windows). Bytes come through the ranged chunk cache (:mod:`.chunks`), never whole files.
``ds[i]`` reads one sample (random access); ``ds.stream(...)`` is a :class:`SampleStream`, an
IterableDataset split over ranks x workers with equal lengths (:mod:`ucmagic.files.plan`), seeded
epochs, a sample-level shuffle that keeps only a few chunks per stream in flight (:mod:`.shuffle`),
and exact, elastic resume (``state_dict`` / ``load_state_dict``, or ``ucmagic.DataLoader``'s).
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Generator, Iterator, Sequence

import numpy as np
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from ..files import plan
from .. import telemetry
from .._util import settle_worker
from ..files.cache import FileCache
from ..files.locks import process_tag
from ..dist import dist_info
from ..files.epochs import EpochTracking
from ..files.planned import StateSchema
from ..telemetry import SharedCounters
from ..files.volume import FileEntry, Volume
from .chunks import CHUNK_SIZE, SUFFIX, ChunkedFile, ChunkReader
from .shuffle import DEFAULT_WINDOW, sample_layout

STATE_VERSION = 1
DEFAULT_READ_AHEAD = 8
"""Chunks a stream fills ahead of its reader: one default shuffle window, so the next window is on its way
while this one is read (4 measured 25% slower cold on P100: a stream waited at each window's start)."""
Span = tuple[int, int, int]  # (file index, byte offset, size)


def fingerprint(entries: Sequence[FileEntry], samples: int) -> str:
    """Identity of a dataset's files (paths, sizes, mtimes) and sample count, for resume checks."""
    h = hashlib.blake2b(digest_size=12)
    for e in entries:
        h.update(f"{e.path}\0{e.size}\0{e.mtime!r}\n".encode("utf-8", "surrogateescape"))
    h.update(str(samples).encode())
    return h.hexdigest()


class ShardDataset(Dataset[Any]):
    """Base of the map-style sample datasets: ``len(ds)`` samples, ``ds[i]`` reads sample ``i``.

    Subclasses set ``files`` (:class:`ChunkedFile` each), ``num_samples`` and ``group_sizes``
    (samples per run of consecutive samples that start in one chunk, in order: the shuffle's unit),
    and implement :meth:`spans` and :meth:`decode`.
    """

    kind = "ShardDataset"
    files: list[ChunkedFile]
    num_samples: int
    group_sizes: list[int]

    def __init__(self, volume: Volume, entries: Sequence[FileEntry], *, cache_dir: str | None = None,
                 cache_limit: int | str | None = None, chunk_size: int = CHUNK_SIZE, min_free: float = 0.10) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
        self.volume = volume
        self.entries = list(entries)
        self.chunk_size = int(chunk_size)
        self.cache = FileCache(cache_dir, cache_limit, min_free)
        self.files = [ChunkedFile(volume, e, self.chunk_size) for e in self.entries]
        self._counters = SharedCounters()
        self._reader: tuple[int, ChunkReader] | None = None

    # ------------------------------------------------------------ to implement

    def spans(self, i: int) -> list[Span]:
        """``(file, offset, size)`` byte ranges holding sample ``i``, in the order :meth:`decode` takes them."""
        raise NotImplementedError

    def decode(self, i: int, parts: list[bytes]) -> Any:
        """The sample ``i`` from the bytes of its spans."""
        raise NotImplementedError

    # ------------------------------------------------------------ basics

    def __len__(self) -> int:
        return self.num_samples

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.entries, self.num_samples)

    @property
    def counters(self) -> SharedCounters:
        """Chunk hits, fills (misses) and bytes fetched, shared with DataLoader workers."""
        return self._counters

    def __getstate__(self) -> dict[str, Any]:
        st = self.__dict__.copy()
        st["_reader"] = None  # per process
        return st

    def reader(self, *, keep: int = 4, slot: int | str = "map") -> ChunkReader:
        """This process's chunk reader for random access (a new one after fork or in a worker)."""
        r = self._reader
        if r is None or r[0] != os.getpid():
            r = self._reader = (os.getpid(), ChunkReader(self.cache, self.files, keep=keep, slot=slot,
                                                         counters=self._counters))
        return r[1]

    def read_sample(self, reader: ChunkReader, i: int, spans: list[Span] | None = None) -> Any:
        """Sample ``i`` read through ``reader`` (``spans``: :meth:`spans` of ``i``, when known)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        parts = [reader.read(f, off, n) for f, off, n in (self.spans(i) if spans is None else spans)]
        return self.decode(i, parts)

    def __getitem__(self, i: int) -> Any:
        t0 = time.perf_counter() if telemetry.fetch_timing() else 0.0  # a user's dataset around this one
        i = int(i)
        if i < 0:
            i += self.num_samples
        reader = self.reader()
        reader.begin()
        out = self.read_sample(reader, i)
        self.record_sample(reader, i)
        if t0:
            telemetry.add_fetch(time.perf_counter() - t0)
        return out

    def record_sample(self, reader: ChunkReader, i: int, spans: list[Span] | None = None) -> None:
        """One per-item fetch record for sample ``i`` (its first chunk, hit or fill, wait)."""
        sp = self.spans(i) if spans is None else spans
        f = sp[0][0] if sp else 0
        chunk = sp[0][1] // self.chunk_size if sp else 0
        telemetry.record_item(self.chunk_id(f, chunk), reader.last_hit, reader.last_wait_s,
                              sum(n for _, _, n in sp))

    def chunks_of_sample(self, i: int, spans: list[Span] | None = None) -> list[tuple[int, int]]:
        """``(file, chunk)`` pairs sample ``i`` reads."""
        return [(f, c) for f, off, n in (self.spans(i) if spans is None else spans)
                for c in self.files[f].chunks_of(off, n)]

    # ------------------------------------------------------------ names for telemetry

    def _chunk_base(self) -> np.ndarray:
        base = self.__dict__.get("_chunk_bases")
        if base is None:
            base = self._chunk_bases = np.concatenate([[0], np.cumsum([f.chunks for f in self.files])])
        return base

    def chunk_id(self, file: int, chunk: int) -> int:
        """The chunk's number among all chunks of the dataset (what per-item fetch records carry: int32)."""
        return int(self._chunk_base()[file]) + chunk

    def describe_item(self, index: int) -> tuple[str, int]:
        """``(file#chunk, bytes)`` of a chunk number of :meth:`chunk_id` (the explorer names slow shards and chunks)."""
        base = self._chunk_base()
        if not 0 <= int(index) < int(base[-1]):
            return f"chunk {index}", 0
        file = int(np.searchsorted(base, int(index), side="right")) - 1
        chunk = int(index) - int(base[file])
        f = self.files[file]
        start, end = f.span(chunk)
        return f"{self.volume.display(f.entry.path)}#chunk{chunk}", max(0, end - start)

    def cached_chunks(self) -> tuple[int, int]:
        """``(chunks, bytes)`` of this dataset in the cache now (one lookup per chunk)."""
        n = nbytes = 0
        for f in self.files:
            for c in range(f.chunks):
                start, end = f.span(c)
                if self.cache.lookup(f.key(c), SUFFIX, end - start):
                    n += 1
                    nbytes += end - start
        return n, nbytes

    def stats(self) -> dict[str, Any]:
        """Chunks and bytes in the cache of the total (``files``/``files_cached`` count chunks: what the
        live panel's cache bars show), chunk hits and fills (``misses``), bytes fetched, samples."""
        n, nbytes = self.cached_chunks()
        t = self._counters.totals()
        chunks = sum(f.chunks for f in self.files)
        return {"files": chunks, "files_cached": n, "bytes": sum(f.entry.size for f in self.files),
                "bytes_cached": nbytes, "chunks": chunks, "chunks_cached": n, "shards": len(self.files),
                "samples": self.num_samples, "hits": t["hits"], "misses": t["misses"],
                "bytes_fetched": t["bytes_fetched"], "retries": t["retries"], "errors": t["errors"],
                "cache_dir": self.cache.root, "cache_limit": self.cache.limit, "chunk_size": self.chunk_size}

    def clear_cache(self) -> int:
        """Remove this dataset's cached chunks. Returns the number removed."""
        found = (self.cache.lookup(f.key(c), SUFFIX, end - start) for f in self.files for c in range(f.chunks)
                 for start, end in (f.span(c),))
        return self.cache.remove(p for p in found if p)

    def stream(self, *, shuffle: bool | str = False, seed: int = 0, shuffle_window: int = DEFAULT_WINDOW,
               partition: str = "pad", reshuffle_every: int | None = None,
               read_ahead: int = DEFAULT_READ_AHEAD) -> "SampleStream":
        """This dataset as an iterable stream (see :class:`SampleStream`)."""
        return SampleStream(self, shuffle=shuffle, seed=seed, shuffle_window=shuffle_window, partition=partition,
                            reshuffle_every=reshuffle_every, read_ahead=read_ahead)


class SampleStream(EpochTracking, IterableDataset[Any]):
    """The samples of a :class:`ShardDataset`, streamed: split over ranks x workers, seeded epochs, resumable.

    Every (rank, worker) stream gets a contiguous run of the epoch's order with equal lengths per
    rank (``partition="pad"`` repeats a few samples, ``"drop"`` leaves the remainder out).
    ``shuffle``: ``False`` (file order), ``True`` / ``"global"`` (runs of samples that start in one
    chunk are permuted, ``shuffle_window`` of them are mixed at a time and the samples of each
    window permuted: a stream reads about ``shuffle_window`` chunks at once), ``"node"`` (each node
    keeps its slice of the samples across epochs, shuffled the same way within it; ``True`` means
    this on several nodes). ``read_ahead``: chunks filled ahead of the reader per stream.

    Resume: :meth:`state_dict` (plain iteration) or ``ucmagic.DataLoader.state_dict()`` (workers,
    ranks), then :meth:`load_state_dict`: the next iteration delivers exactly what was not yet
    delivered in the saved epoch, under any number of workers or ranks.
    """

    kind = "SampleStream"
    read_ahead_scope = "stream"  # each worker stream reads its own chunks ahead
    state_schema = StateSchema(kind, STATE_VERSION, "samples")

    def __init__(self, dataset: ShardDataset, *, shuffle: bool | str = False, seed: int = 0,
                 shuffle_window: int = DEFAULT_WINDOW, partition: str = "pad", reshuffle_every: int | None = None,
                 read_ahead: int = DEFAULT_READ_AHEAD) -> None:
        if partition not in plan.PARTITION_MODES:
            raise ValueError(f"partition must be one of {plan.PARTITION_MODES}, got {partition!r}")
        if shuffle not in (False, True, "global", "node"):
            raise ValueError(f"shuffle must be False, True, 'global' or 'node', got {shuffle!r}")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = int(seed)
        self.shuffle_window = max(1, int(shuffle_window))
        self.partition = partition
        self.reshuffle_every = int(reshuffle_every) if reshuffle_every else None
        self.read_ahead = max(0, int(read_ahead))
        self.batch_quantum = 1
        self.lease_items = 1024
        self._init_epochs()
        self._layouts: dict[Any, Any] = {}

    def __len__(self) -> int:
        """Samples this rank delivers in a whole epoch: the same after a resume (which delivers fewer), as
        torchdata's StatefulDataLoader keeps ``len()``."""
        return plan.per_rank(self.dataset.num_samples, dist_info().world, self.partition)

    def __repr__(self) -> str:
        return (f"SampleStream({type(self.dataset).__name__}, samples={self.dataset.num_samples}, "
                f"shuffle={self.shuffle!r}, seed={self.seed})")

    def __getstate__(self) -> dict[str, Any]:
        st = self.__dict__.copy()
        st["_layouts"] = {}
        return st

    @property
    def counters(self) -> SharedCounters:
        return self.dataset.counters

    # ------------------------------------------------------------ plan

    def layout(self, epoch: int, world: int | None = None) -> Any:
        """The sample order of ``epoch`` (a :class:`ucmagic.tables.rows.EpochLayout` over chunk runs)."""
        mode, ow, olws = self._order_params(epoch, world)
        key = (epoch, mode, ow, olws)
        lay = self._layouts.get(key)
        if lay is None:
            lay = sample_layout(self.dataset.group_sizes, shuffle=mode, seed=self.seed, epoch=epoch,
                                window=self.shuffle_window, world=ow, local_world=olws, partition=self.partition,
                                reshuffle_every=self.reshuffle_every)
            self._layouts = {key: lay}
        return lay

    def epoch_items(self, epoch: int) -> int:
        """Items of a whole ``epoch`` (a resume's rest aside): what ``len()`` and the loader's length count."""
        return int(self.dataset.num_samples)

    def epoch_plan(self, epoch: int) -> tuple[list[plan.Range], None]:
        return self._resumed_pool(epoch, self.dataset.num_samples), None

    def stream_ranges(self, epoch: int, rank: int, world: int, worker: int, num_workers: int) -> list[plan.Range]:
        """Epoch positions stream (rank, worker) delivers, in order (the rest of its own, after a stream's state)."""
        return self._stream_ranges(epoch, rank, world, worker, num_workers)

    def stream_samples(self, epoch: int | None = None, rank: int | None = None, world: int | None = None,
                       worker: int | None = None, num_workers: int | None = None) -> np.ndarray:
        """Sample indices one stream delivers in ``epoch`` (default: the calling stream and epoch)."""
        d = dist_info()
        rank = d.rank if rank is None else rank
        world = d.world if world is None else world
        worker = d.worker if worker is None else worker
        num_workers = d.num_workers if num_workers is None else num_workers
        ep = self.epoch if epoch is None else epoch
        rows: np.ndarray = self.layout(ep, world).rows_of(self.stream_ranges(ep, rank, world, worker, num_workers))
        return rows

    # ------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        return telemetry.fetch_timed(self._iterate(self._iteration_ticket()))  # timed when a user's wrapper iterates it

    def _iterate(self, ticket: int) -> Iterator[Any]:
        self._check_consumer()  # Accelerate splitting again or skipping twice, a stateless wrapper resumed
        ds = self.dataset
        if get_worker_info() is None:
            epoch = self.begin_epoch(ticket=ticket)
        else:
            epoch = self._worker_epoch(os.path.join(ds.cache.root, "locks", f"epoch-{self._epoch_id}.lock"), ticket)
            settle_worker()  # a worker holds and frees batches of big samples: see _util.settle_worker
        progress = self._open_progress(epoch)
        rank, world, _, _, worker, nworkers = dist_info()
        lay = self.layout(epoch, world)
        segs = lay.segments(self.stream_ranges(epoch, rank, world, worker, nworkers))
        reader = self.stream_reader(f"s{worker}")
        try:
            for sample in self.read_segments(reader, lay, segs):
                progress.count += 1
                yield sample
            progress.ended = True
        finally:
            reader.close()

    def stream_reader(self, slot: str) -> ChunkReader:
        """A chunk reader for one stream of this process (close it when the stream ends)."""
        ds = self.dataset
        return ChunkReader(ds.cache, ds.files, keep=1 << 30, owner=process_tag(), slot=slot, counters=ds.counters)

    def read_segments(self, reader: ChunkReader, lay: Any, segs: list[Any]) -> Generator[Any, None, None]:
        """The samples of ``segs`` (window segments of ``lay``) in order, reading the chunks the next
        ones need ahead and letting each chunk go after its last use."""
        ds = self.dataset
        nxt = lay.segment_rows(segs[0]) if segs else np.zeros(0, dtype=np.int64)
        for k in range(len(segs)):
            rows = nxt
            nxt = lay.segment_rows(segs[k + 1]) if k + 1 < len(segs) else np.zeros(0, dtype=np.int64)
            spans = [ds.spans(i) for i in rows.tolist()]
            chunks = [ds.chunks_of_sample(0, sp) for sp in spans]
            upcoming = {fc for i in nxt[:64] for fc in ds.chunks_of_sample(int(i))}
            last: dict[tuple[int, int], int] = {}
            for j, cs in enumerate(chunks):
                for fc in cs:
                    last[fc] = j
            first_use: dict[tuple[int, int], int] = {}
            for j, cs in enumerate(chunks):
                for fc in cs:
                    first_use.setdefault(fc, j)
            for fc in upcoming:
                first_use.setdefault(fc, len(chunks))
            order = sorted(first_use, key=first_use.__getitem__)  # chunks by first use, the next segment's last
            p, asked = 0, -1
            for j, i in enumerate(rows.tolist()):
                while p < len(order) and first_use[order[p]] < j:
                    p += 1  # in use already: opened (or being filled) when its first sample was read
                if self.read_ahead and p != asked:  # the chunks ahead change only when p moves
                    reader.prefetch(order[p:p + 1 + self.read_ahead])
                    asked = p
                reader.begin()
                sample = ds.read_sample(reader, i, spans[j])
                ds.record_sample(reader, i, spans[j])
                done = [fc for fc in chunks[j] if last[fc] == j]  # the next window finds it again if kept
                if done:
                    reader.release(done)
                yield sample
            reader.discard(set(reader.pending()) - upcoming)  # read ahead for nothing: unprotect

    # ------------------------------------------------------------ resume

    def make_state(self, epoch: int, delivered: Sequence[int], *, world: int, num_workers: int) -> dict[str, Any]:
        """Resume state after stream ``s`` (rank-major) delivered ``delivered[s]`` samples of ``epoch``."""
        return self._planned_state(epoch, self.epoch_plan(epoch)[0], delivered, world=world, num_workers=num_workers,
                                   fingerprint=self.dataset.fingerprint, count=self.dataset.num_samples,
                                   shuffle_option=self.shuffle, shuffle_window=self.shuffle_window)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration delivers exactly the samples not yet delivered in the saved epoch
        (any world size or number of workers). Raises ListingChangedError if the files changed."""
        self.state_schema.check(state, fingerprint=self.dataset.fingerprint, count=self.dataset.num_samples,
                                what=f"the files of this {type(self.dataset).__name__}")
        self.shuffle = state.get("shuffle_option", state["shuffle"])
        self.shuffle_window = int(state["shuffle_window"])
        self._layouts = {}
        self._resume_from(state)

    def describe_item(self, index: int) -> tuple[str, int]:
        return self.dataset.describe_item(index)

    def stats(self) -> dict[str, Any]:
        """The dataset's :meth:`ShardDataset.stats` and the epoch (the live panel reads them)."""
        return {**self.dataset.stats(), "epoch": self.epoch}

    @property
    def path(self) -> str:
        return str(getattr(self.dataset, "path", ""))
