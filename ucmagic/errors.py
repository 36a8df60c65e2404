"""Exception types raised by ucmagic. Each message names what failed and how to fix it."""
from __future__ import annotations


class UCMagicError(Exception):
    """Base class for every error ucmagic raises on purpose."""


class SourceNotFoundError(UCMagicError, FileNotFoundError):
    """A dataset/stage/checkpoint source path does not exist."""


class NotADirectoryErrorUC(UCMagicError, NotADirectoryError):
    """A file was given where a directory is expected."""


class EmptyListingError(UCMagicError, ValueError):
    """A listing (with its pattern) matched no file."""


class SizeParseError(UCMagicError, ValueError):
    """A size string such as "50GB" could not be parsed."""


class FetchError(UCMagicError, OSError):
    """A file could not be copied from the volume after all retries."""


class SourceChangedError(FetchError):
    """A source file changed (size or mtime) while it was being copied; the copy was discarded."""


class FetchTimeoutError(FetchError, TimeoutError):
    """A single file took longer than the per-file timeout."""


class CacheFullError(UCMagicError, OSError):
    """The cache disk has no room left and nothing can be evicted."""


class ListingChangedError(UCMagicError, ValueError):
    """A saved resume state does not match the dataset's current listing."""


class ResumeOrderError(UCMagicError, ValueError):
    """A saved resume state follows an epoch order this version of ucmagic does not produce."""


class UnsafeCacheError(UCMagicError, PermissionError):
    """The cache directory is not private to the current user."""
