"""torch's DCP ``FileSystem`` that also takes checkpoint URLs (``s3://bucket/run/ckpts/step_5``).

torch's ``FileSystem`` turns every path into a ``pathlib.Path`` (``s3://b`` would become ``s3:/b``);
this one keeps a URL a string, joins names to it with ``/`` and serves the streams torch opens on it
from the store (:mod:`.transfer`: a read is one ``read_bytes``, a write one atomic ``write_bytes``
when the stream closes). The writer and reader route their data files elsewhere (local staging,
parallel downloads); what reaches this class is the rest. Local paths are torch's, unchanged.
"""
from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator

from torch.distributed.checkpoint.filesystem import FileSystem

from .._util import is_remote_url
from . import transfer as xfer


class CheckpointFileSystem(FileSystem):
    """torch's ``FileSystem`` on local paths; on URLs, the checkpoint store through :mod:`.transfer`."""

    def init_path(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        return xfer.url_path(path) if is_remote_url(path) else super().init_path(path)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        return f"{xfer.url_path(path)}/{suffix}" if is_remote_url(path) else super().concat_path(path, suffix)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if not is_remote_url(path):
            with super().create_stream(path, mode) as s:
                yield s
            return
        url = os.fspath(path)
        if "r" in mode:
            yield io.BytesIO(xfer.read_bytes(url))
            return
        buf = io.BytesIO()
        yield buf
        xfer.write_bytes(url, buf.getvalue())  # whole or not at all, once the stream is complete

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        if not is_remote_url(path):
            super().rename(path, new_path)
            return
        xfer.write_bytes(os.fspath(new_path), xfer.read_bytes(os.fspath(path)))
        xfer.remove_quietly(os.fspath(path))

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        if is_remote_url(path):
            xfer.makedirs(os.fspath(path))
        else:
            super().mkdir(path)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return xfer.exists(os.fspath(path)) if is_remote_url(path) else super().exists(path)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        if is_remote_url(path):
            xfer.remove_quietly(os.fspath(path))
        else:
            super().rm_file(path)

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        if is_remote_url(path):
            return [f"{xfer.url_path(path)}/{n}" for n in xfer.list_names(os.fspath(path))]
        return super().ls(path)
