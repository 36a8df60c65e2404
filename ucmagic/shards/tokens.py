"""TokenWindows: LLM token arrays (flat uint16/uint32 ``.bin`` files and ``.npy``) as fixed-size windows.

The files (sorted by path) are one stream of tokens, concatenated. Window ``i`` is
``tokens[i * block_size : i * block_size + block_size + 1]`` -- ``block_size + 1`` tokens, so
``x, y = w[:-1], w[1:]`` predicts every token once, as nanoGPT's ``get_batch`` does (neighbouring
windows share one token) -- or, with ``target=False``, ``tokens[i * block_size : (i + 1) * block_size]``
exactly as litdata's ``TokensLoader(block_size)`` cuts them. A window may cross a file boundary; its
bytes come through the chunk cache, never by copying whole files. ``len(ds)`` is the number of whole
windows (a short tail is left out). ``ds[i]`` is an int64 tensor holding exactly the stored tokens:
``dtype=`` must be an integer type (:func:`token_dtype`), every ``.npy`` file must hold that type
(:func:`check_npy_dtype`), and a ``uint64`` token beyond int64 is refused where it is read.
"""
from __future__ import annotations

import ast
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import InvalidArgumentError, ShardFormatError
from ..files.ranged import RangedFile
from ..files.volume import FileEntry, Volume, filter_entries, open_volume
from .chunks import CHUNK_SIZE
from .samples import ShardDataset, Span

TOKEN_SUFFIXES = (".bin", ".npy")
NPY_HEADER_READ = 1 << 16
TOKEN_KINDS = ("i", "u")  # signed and unsigned integers: every value is exact in an int64 tensor (uint64: checked)
INT64_MAX = np.iinfo(np.int64).max


def describe_dtype(dt: np.dtype[Any]) -> str:
    """``dt`` as a message names it: ``uint16``, or ``big-endian uint16 ('>u2')`` when its byte order matters."""
    if dt.byteorder in ("=", "|") or dt.isnative:
        return str(dt.name)
    return f"{'big' if dt.byteorder == '>' else 'little'}-endian {dt.name} ({dt.str!r})"


def spell_dtype(dt: np.dtype[Any]) -> str:
    """What to pass as ``dtype=`` to read values of ``dt``: ``'uint16'``, or ``'>u2'`` for another byte order."""
    return str(dt.name if dt.isnative else dt.str)


def is_token_dtype(dt: np.dtype[Any]) -> bool:
    """True for integer types (signed or unsigned, any byte order): token ids an int64 tensor holds exactly."""
    return dt.kind in TOKEN_KINDS and dt.fields is None and dt.subdtype is None


def token_dtype(dtype: Any) -> np.dtype[Any]:
    """The token type ``dtype=`` names; InvalidArgumentError unless it is an integer type (floats, bools,
    objects and strings are not token ids, and an int64 tensor of them would not hold the stored values)."""
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"dtype={dtype!r} is not a numpy dtype: pass the integer type of the token "
                                   "files, e.g. dtype='uint16' (nanoGPT's .bin files) or 'uint32'") from None
    if not is_token_dtype(dt):
        raise InvalidArgumentError(
            f"dtype={dtype!r} is {describe_dtype(dt)}, not an integer token type: TokenWindows yields int64 "
            "tensors of token ids and reads only integer files exactly; pass the integer type the files hold "
            "(dtype='uint16' as nanoGPT writes them, or 'uint32'), or convert them first, e.g. "
            f"np.fromfile(path, {spell_dtype(dt)!r}).astype('uint32').tofile(new_path)")
    return dt


def check_npy_dtype(found: np.dtype[Any], want: np.dtype[Any], where: str) -> None:
    """ShardFormatError unless the ``.npy`` file ``where`` holds tokens of exactly ``want`` (byte order included)."""
    if not is_token_dtype(found):
        raise ShardFormatError(f"{where} holds {describe_dtype(found)} values ({found.str!r}), not integer tokens: "
                               "save the token ids as integers, e.g. np.save(path, np.asarray(tokens, dtype='uint32'))")
    if found != want:
        raise ShardFormatError(f"{where} holds {describe_dtype(found)} tokens, but dtype= reads "
                               f"{describe_dtype(want)}: pass dtype={spell_dtype(found)!r} (every .bin and .npy "
                               "file is read with it) or convert the file")


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
    except (ValueError, SyntaxError, KeyError, TypeError, AttributeError) as exc:
        raise ShardFormatError(f"{where}: unreadable .npy header ({exc})") from None
    if header.get("fortran_order") and len(shape) > 1:
        raise ShardFormatError(f"{where} is Fortran-ordered: save token arrays in C order (np.save of a 1-D array)")
    items = int(np.prod(shape)) if shape else 1
    need = items * dtype.itemsize
    if start + hlen + need > entry.size:
        raise ShardFormatError(f"{where} is cut short: its header promises {items} values of {dtype.itemsize} bytes "
                               f"({need} bytes from byte {start + hlen}), the file has {entry.size} bytes: "
                               "write it again")
    return dtype, start + hlen, items


class TokenWindows(ShardDataset):
    """Windows of ``block_size`` tokens over the token files under ``path`` (see the module doc).

    Args:
        path: a directory (or a single-file directory) of ``.bin`` / ``.npy`` token files.
        block_size: tokens per window (plus one with ``target=True``).
        dtype: the token type of ``.bin`` files (``"uint16"`` as nanoGPT writes them, or ``"uint32"``; any
            integer type, ``">u2"`` for another byte order); ``.npy`` files carry their own, which must agree.
            Float, bool, object and string types are refused (``InvalidArgumentError``).
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
        token_type = token_dtype(dtype)
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
        self.dtype = token_type
        offsets, counts = [], []
        for e in entries:
            if e.path.endswith(".npy"):
                dt, off, n = npy_layout(volume, e)
                check_npy_dtype(dt, self.dtype, volume.display(e.path))
            else:
                off, n = 0, e.size // self.dtype.itemsize
                if e.size % self.dtype.itemsize:
                    raise ShardFormatError(f"{volume.display(e.path)} has {e.size} bytes, not a whole number of "
                                           f"{describe_dtype(self.dtype)} tokens ({self.dtype.itemsize} bytes "
                                           "each): pass the dtype= the file was written with (nanoGPT: 'uint16')")
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
        tokens = np.frombuffer(data, dtype=self.dtype)
        if self.dtype.kind == "u" and self.dtype.itemsize == 8 and tokens.size and int(tokens.max()) > INT64_MAX:
            a = self.token_range(i)[0] + int(np.argmax(tokens > INT64_MAX))
            f = int(np.searchsorted(self.token_start, a, side="right")) - 1
            raise ShardFormatError(f"{self.volume.display(self.entries[f].path)} holds token {int(tokens.max())} "
                                   f"(token {a - int(self.token_start[f])} of the file), beyond int64: token ids "
                                   "over 2**63 - 1 cannot be yielded exactly; store them as int64 or smaller")
        return torch.from_numpy(tokens.astype(np.int64))

    def file_of(self, samples: Sequence[int] | np.ndarray) -> np.ndarray:
        """The file holding the first token of each window (for shuffle-quality figures)."""
        a = np.asarray(samples, dtype=np.int64) * self.block_size
        return np.searchsorted(self.token_start, a, side="right") - 1
