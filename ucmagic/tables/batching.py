"""Re-cutting decoded row-group pieces into batches of ``batch_size`` rows, in every ``format`` of
ParquetDataset (torch: dicts of tensors and lists, packed into one buffer per batch when it leaves a worker;
numpy, arrow, pandas: from the pieces' Arrow tables)."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .columns import mask_key, numpy_column, to_pandas

__all__ = ["BatchCutter"]


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` on this thread only: torch's intra-op threads wait for cores that pyarrow's decoding holds
    (a 0.5 MB cat took 20 ms on 2 busy cores, 3x the whole scan); numpy copies on the calling thread, into memory
    of Arrow's pool, where the decoded columns come from and go back to: the C heap gives such blocks back to the
    system at once and the next batch faults them in again (a warm 30 M-row scan joins half its batches)."""
    if ts[0].dtype == torch.bfloat16:  # no numpy type
        return torch.cat(ts)
    import pyarrow as pa

    parts = [t.numpy() for t in ts]
    dt = parts[0].dtype
    shape = (sum(p.shape[0] for p in parts),) + parts[0].shape[1:]
    out = np.frombuffer(pa.allocate_buffer(int(np.prod(shape)) * dt.itemsize), dtype=dt).reshape(shape)  # writable
    np.concatenate(parts, out=out)
    return torch.from_numpy(out)


class BatchCutter:
    """Cuts a stream of decoded pieces ``(piece, rows)`` into batches (see the module).

    Call order: build it once per dataset with the output settings; call :meth:`batches` per stream."""

    def __init__(self, format: str, batch_size: int, columns: Sequence[str], out_keys: Sequence[str],  # noqa: A002 - the option's documented name
                 lists: set[str], mask_set: set[str]) -> None:
        self.format, self.batch_size = format, batch_size
        self.columns, self.out_keys = list(columns), list(out_keys)
        self.lists, self.mask_set = lists, mask_set

    def batches(self, pieces: Iterator[tuple[dict[str, Any], int]], own: bool) -> Iterator[Any]:
        """Re-cut decoded pieces into batches of ``batch_size`` rows (the last may be short).

        ``own``: batches leave this process (DataLoader worker): numeric columns are packed into
        one fresh buffer per batch, so each batch crosses to the main process as one shared block.
        """
        import pyarrow as pa

        if self.format != "torch":
            yield from self.table_batches(pieces)
            return
        bs = self.batch_size
        cols = self.out_keys
        tensor_cols = [c for c in cols if c not in self.lists]
        pending: list[tuple[dict[str, Any], int, int]] = []  # (piece, start, stop)
        npend = 0

        def pack(batch: dict[str, Any]) -> dict[str, Any]:
            if not tensor_cols:
                return batch
            sizes = [(batch[c].numel() * batch[c].element_size() + 7) // 8 * 8 for c in tensor_cols]
            buf = torch.empty(sum(sizes), dtype=torch.uint8)
            off = 0
            for c, n in zip(tensor_cols, sizes):
                t = batch[c]
                view = buf[off:off + t.numel() * t.element_size()].view(t.dtype)
                view.copy_(t)
                batch[c] = view
                off += n
            return batch

        def emit(parts: list[tuple[dict[str, Any], int, int]]) -> dict[str, Any]:
            batch: dict[str, Any] = {}
            for c in cols:
                if c in self.lists:
                    arrs = [p[c].slice(a, b - a) for p, a, b in parts]
                    batch[c] = (arrs[0] if len(arrs) == 1 else pa.concat_arrays(arrs)).to_pylist()
                else:
                    ts = [p[c][a:b] for p, a, b in parts]
                    batch[c] = ts[0] if len(ts) == 1 else _cat(ts)
            return pack(batch) if own else batch

        for piece, n in pieces:
            off = 0
            if npend:
                take = min(bs - npend, n)
                pending.append((piece, 0, take))
                npend += take
                off = take
                if npend < bs:
                    continue
                yield emit(pending)
                pending, npend = [], 0
            if not own and not set(cols) - set(tensor_cols):  # fast path: views of the decoded tensors
                while n - off >= bs:
                    yield {c: piece[c][off:off + bs] for c in cols}
                    off += bs
            else:
                while n - off >= bs:
                    yield emit([(piece, off, off + bs)])
                    off += bs
            if off < n:
                pending.append((piece, off, n))
                npend += n - off
        if npend:
            yield emit(pending)

    def table_batches(self, pieces: Iterator[tuple[dict[str, Any], int]]) -> Iterator[Any]:
        """``format`` numpy/arrow/pandas: re-cut the decoded tables into batches of ``batch_size`` rows."""
        import pyarrow as pa

        bs = self.batch_size
        pending: list[Any] = []
        npend = 0

        def emit(parts: list[Any]) -> Any:
            t = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
            if self.format == "arrow":
                return t
            if self.format == "pandas":
                return to_pandas(t)
            out = {}
            for c in self.columns:
                col = t.column(c)
                out[c] = numpy_column(col)
                if c in self.mask_set:
                    out[mask_key(c)] = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
            return out

        for piece, n in pieces:
            table = piece[""]
            off = 0
            while off < n:
                take = min(bs - npend, n - off)
                pending.append(table.slice(off, take))
                npend += take
                off += take
                if npend == bs:
                    yield emit(pending)
                    pending, npend = [], 0
        if npend:
            yield emit(pending)
