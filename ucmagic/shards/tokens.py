"""TokenWindows: LLM token arrays (flat uint16/uint32 ``.bin`` files and ``.npy``) as fixed-size windows.

The files (sorted by path) are one stream of tokens, concatenated. Window ``i`` is
``tokens[i * block_size : i * block_size + block_size + 1]`` -- ``block_size + 1`` tokens, so
``x, y = w[:-1], w[1:]`` predicts every token once, as nanoGPT's ``get_batch`` does (neighbouring
windows share one token) -- or, with ``target=False``, ``tokens[i * block_size : (i + 1) * block_size]``
exactly as litdata's ``TokensLoader(block_size)`` cuts them. A window may cross a file boundary; its
bytes come through the chunk cache, never by copying whole files. ``len(ds)`` is the number of whole
windows (a short tail is left out). ``ds[i]`` is an int64 tensor.
"""
from __future__ import annotations

import ast
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import ShardFormatError
from ..files.volume import FileEntry, Volume, filter_entries, open_volume
from .chunks import CHUNK_SIZE
from .index import RangedFile
from .samples import ShardDataset, Span

TOKEN_SUFFIXES = (".bin", ".npy")
NPY_HEADER_READ = 1 << 16


def npy_layout(volume: Volume, entry: FileEntry) -> tuple[np.dtype, int, int]:
    """``(dtype, data offset, items)`` of a ``.npy`` file from its header (one small ranged read)."""
    with RangedFile(volume.range_reader(entry.path), entry.size) as f:
        head = f.read(min(entry.size, NPY_HEADER_READ))
    where = volume.display(entry.path)
    if head[:6] != b"\x93NUMPY":
        raise ShardFormatError(f"{where} is not a .npy file (no NUMPY magic)")
    major = head[6]
    hl_size = 2 if major == 1 else 4
    hlen = int.from_bytes(head[8:8 + hl_size], "little")
    start = 8 + hl_size
    try:
        header = ast.literal_eval(head[start:start + hlen].decode("latin1"))
        dtype = np.dtype(header["descr"])
        shape = tuple(header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError) as exc:
        raise ShardFormatError(f"{where}: unreadable .npy header ({exc})") from None
    if header.get("fortran_order") and len(shape) > 1:
        raise ShardFormatError(f"{where} is Fortran-ordered: save token arrays in C order (np.save of a 1-D array)")
    items = int(np.prod(shape)) if shape else 1
    return dtype, start + hlen, items


class TokenWindows(ShardDataset):
    """Windows of ``block_size`` tokens over the token files under ``path`` (see the module doc).

    Args:
        path: a directory (or a single-file directory) of ``.bin`` / ``.npy`` token files.
        block_size: tokens per window (plus one with ``target=True``).
        dtype: the token type of ``.bin`` files (``"uint16"`` as nanoGPT writes them, or ``"uint32"``);
            ``.npy`` files carry their own, which must agree.
        pattern: which files hold tokens (default: every ``.bin`` and ``.npy`` file).
        target: windows of ``block_size + 1`` tokens (inputs and next-token targets); False: exactly
            ``block_size`` tokens, non-overlapping (litdata's TokensLoader).
        cache_dir, cache_limit, chunk_size, min_free: the chunk cache.
    """

    kind = "TokenWindows"

    def __init__(self, path: Any, *, block_size: int, dtype: Any = "uint16", pattern: str | None = None,
                 target: bool = True, cache_dir: str | None = None, cache_limit: int | str | None = None,
                 chunk_size: int = CHUNK_SIZE, storage_options: dict[str, Any] | None = None,
                 min_free: float = 0.10) -> None:
        if int(block_size) < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        volume = open_volume(path, storage_options)
        listed = volume.list(None)
        chosen = filter_entries(listed, pattern) if pattern else [e for e in listed if e.path.endswith(TOKEN_SUFFIXES)]
        entries = sorted(chosen, key=lambda e: e.path)
        if not entries:
            raise ShardFormatError(f"no token files (.bin, .npy) under {volume.display()}")
        super().__init__(volume, entries, cache_dir=cache_dir, cache_limit=cache_limit, chunk_size=chunk_size,
                         min_free=min_free)
        self.path = volume.display()
        self.block_size = int(block_size)
        self.target = bool(target)
        self.dtype = np.dtype(dtype)
        offsets, counts = [], []
        for e in entries:
            if e.path.endswith(".npy"):
                dt, off, n = npy_layout(volume, e)
                if dt.newbyteorder("=") != self.dtype.newbyteorder("=") or dt.byteorder not in ("=", "|", "<"):
                    raise ShardFormatError(f"{volume.display(e.path)} holds {dt} tokens, not {self.dtype}: "
                                           f"pass dtype={dt.name!r} or convert the file")
            else:
                off, n = 0, e.size // self.dtype.itemsize
                if e.size % self.dtype.itemsize:
                    raise ShardFormatError(f"{volume.display(e.path)} has {e.size} bytes, not a whole number of "
                                           f"{self.dtype} tokens: is dtype= right?")
            offsets.append(off)
            counts.append(n)
        self.data_offset = np.asarray(offsets, dtype=np.int64)
        self.token_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # first token of each file
        self.num_tokens = int(self.token_start[-1])
        extra = 1 if self.target else 0
        self.num_samples = max(0, (self.num_tokens - extra) // self.block_size)
        if self.num_samples == 0:
            raise ShardFormatError(f"the token files under {self.path} hold {self.num_tokens} tokens: fewer than one "
                                   f"window of {self.block_size + extra}")
        per = max(1, self.chunk_size // (self.block_size * self.dtype.itemsize))  # windows starting in one chunk
        full, rest = divmod(self.num_samples, per)
        self.group_sizes = [per] * full + ([rest] if rest else [])

    def __repr__(self) -> str:
        return (f"TokenWindows({self.path!r}, files={len(self.files)}, tokens={self.num_tokens}, "
                f"block_size={self.block_size}, windows={self.num_samples})")

    def token_range(self, i: int) -> tuple[int, int]:
        """Tokens ``[a, b)`` of the concatenated stream that window ``i`` holds."""
        a = i * self.block_size
        return a, a + self.block_size + (1 if self.target else 0)

    def spans(self, i: int) -> list[Span]:
        a, b = self.token_range(i)
        starts = self.token_start
        f = int(np.searchsorted(starts, a, side="right")) - 1
        out: list[Span] = []
        item = self.dtype.itemsize
        while a < b:
            end = min(b, int(starts[f + 1]))
            if end > a:
                out.append((f, int(self.data_offset[f]) + (a - int(starts[f])) * item, (end - a) * item))
            a = end
            f += 1
        return out

    def decode(self, i: int, parts: list[bytes]) -> torch.Tensor:
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return torch.from_numpy(np.frombuffer(data, dtype=self.dtype).astype(np.int64))

    def file_of(self, samples: Sequence[int] | np.ndarray) -> np.ndarray:
        """The file holding the first token of each window (for shuffle-quality figures)."""
        a = np.asarray(samples, dtype=np.int64) * self.block_size
        return np.searchsorted(self.token_start, a, side="right") - 1
