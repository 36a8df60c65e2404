"""Checkpoint layout on a volume: names, the commit marker (which carries the manifest), retention.

Pure functions over plain data (plus the error classes); no file I/O happens here.

A committed checkpoint directory holds torch DCP's own files (``__<rank>_<n>.distcp`` and
``.metadata``) or, in single-file mode, ``checkpoint.pt``, plus ``.ucmagic_commit.json`` written
last. That marker is the manifest: the size and CRC-32 of every file, the save id (which must match
the one inside ``.metadata``), the step and the user's JSON ``extra``.

A save first writes ``.ucmagic_saving.json`` (the save-in-progress record: save id, start time,
host and pid), then withdraws the old marker and ``.metadata``, and removes the record only after
its own marker is written. So a directory is, in this order of precedence: *in progress* (a record
whose save id is not the marker's), *committed* (a valid marker), *torn* (a damaged marker) or, with
no ucmagic file at all, *foreign* (written by torch's ``FileSystemWriter`` or another tool).
"""
from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from .._util import is_integer
from ..files.entries import is_safe_rel
from ..errors import (  # noqa: F401 - re-exported: checkpoint errors were defined here before
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointInProgressError,
    CheckpointMismatchError,
    CheckpointNotCommittedError,
    CheckpointUploadError,
    NoCheckpointError,
    UnsafeCheckpointError,
)

COMMIT_NAME = ".ucmagic_commit.json"
SAVING_NAME = ".ucmagic_saving.json"
METADATA_NAME = ".metadata"
SINGLE_FILE_NAME = "checkpoint.pt"
FORMAT_DCP = "ucmagic.dcp"
FORMAT_SINGLE = "ucmagic.single"
FORMAT_VERSION = 1
STEP_PREFIX = "step_"
_STEP_RE = re.compile(r"^step_(\d+)$")
_SHARD_RE = re.compile(r"^__\d+_\d+(?:-[0-9a-f]+)?\.distcp$")  # ucmagic's carry the save's id


class FileRecord(NamedTuple):
    """Size and CRC-32 of one checkpoint file."""

    size: int
    crc32: int


KIND_DCP = "dcp"  # a DCP directory another writer made (torch's FileSystemWriter, databricks.air.data)
KIND_TORCH_SAVE = "torch.save"  # one file written by torch.save
TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".ckpt")


class CheckpointInfo(NamedTuple):
    """One complete checkpoint: its step (None when a foreign name carries no number), directory or file,
    commit time (epoch seconds; a foreign one's modification time), total bytes, and ``kind``:
    ``"ucmagic.dcp"`` / ``"ucmagic.single"`` (committed by ucmagic), ``"dcp"`` (a DCP directory written by
    torch's ``FileSystemWriter`` or ``databricks.air.data``) or ``"torch.save"`` (one file)."""

    step: int | None
    path: str
    time: float
    size: int
    kind: str = FORMAT_DCP


# ---------------------------------------------------------------- names

def step_dirname(step: int) -> str:
    """``step_<step>`` for a non-negative integer step."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"{STEP_PREFIX}{step}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a ``step_<n>`` directory name, else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


#: The step words: a number is a step only right after one of these (ucmagic's and DCP's ``step_<N>`` /
#: ``step-<N>``, Lightning's ``step=<N>``, Hugging Face's ``checkpoint-<N>``, ``ckpt_<N>`` / ``ckpt-<N>``,
#: DeepSpeed's ``global_step<N>``). The word starts the name or follows a character that is not a letter or
#: digit (``epoch=3-step=1000``, ``run1_step_5``), and the number ends at the name's end or a non-digit.
STEP_WORDS = ("step_", "step-", "step=", "checkpoint-", "ckpt_", "ckpt-", "global_step")
_STEP_WORD_RE = re.compile(r"(?:^|(?<=[^a-z0-9]))(?:global_step|step[_=-]|checkpoint-|ckpt[_-])(\d+)(?!\d)",
                           re.IGNORECASE)


def foreign_step(name: str) -> int | None:
    """The step a foreign checkpoint's name carries after a step word (:data:`STEP_WORDS`): ``step_100``,
    ``epoch=3-step=1000.ckpt`` (1000), ``checkpoint-500``, ``ckpt_20.pt``, ``global_step200``. Any other
    name, a bare number or a date included (``model_20240601.pt``, ``resnet50.pth``), has none: None, never
    chosen as latest. With several step words (``ckpt_3-step=900``) the last one counts."""
    stem = name
    for suffix in TORCH_SAVE_SUFFIXES:
        if stem.lower().endswith(suffix):
            stem = stem[: -len(suffix)]
    found = _STEP_WORD_RE.findall(stem)
    return int(found[-1]) if found else None


def is_torch_save_name(name: str) -> bool:
    """True for a file name that ``torch.save`` checkpoints use (``.pt``, ``.pth``, ``.ckpt``)."""
    return name.lower().endswith(TORCH_SAVE_SUFFIXES) and not name.startswith(".")


def looks_like_torch_save(head: bytes) -> bool:
    """True when a file's first bytes are a ``torch.save`` archive (zip) or a legacy pickle."""
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


ZIP_TAIL = (1 << 16) + 22  # the zip's end-of-central-directory record lies within this many bytes of its end


def torn_torch_save(head: bytes, tail: bytes) -> bool:
    """True when a ``torch.save`` archive (``head``: its first bytes; ``tail``: its last :data:`ZIP_TAIL` bytes)
    lacks the end of its zip directory: a save cut short (killed, or a full disk), which ``torch.load``
    refuses with a raw zip error. A legacy pickle cannot be told: False."""
    return head.startswith(b"PK\x03\x04") and b"PK\x05\x06" not in tail


def sort_infos(infos: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    """Oldest step first; entries without a step last, by path."""
    return sorted(infos, key=lambda i: (i.step is None, i.step or 0, not i.kind.startswith("ucmagic"), i.path))


def pick_latest(infos: Iterable[CheckpointInfo], step: int | None = None) -> CheckpointInfo | None:
    """The entry ``"latest"`` means (or, given ``step``, the one of that step): the highest step; of one step,
    ucmagic's own, else the newest written (two foreign files named for one step); entries without a step never."""
    numbered = [i for i in infos if i.step is not None and (step is None or i.step == step)]
    if not numbered:
        return None
    return max(numbered, key=lambda i: (i.step, i.kind.startswith("ucmagic"), i.time, i.path))


def shape_mismatch(expected: Mapping[str, tuple[int, ...]], present: Mapping[str, tuple[int, ...]]) -> list[str]:
    """``"key: checkpoint (a, b), model (c, d)"`` for every key in both whose shape differs."""
    return [f"{k}: checkpoint {tuple(present[k])}, model {tuple(expected[k])}"
            for k in sorted(expected) if k in present and tuple(present[k]) != tuple(expected[k])]


def is_shard_name(name: str) -> bool:
    """True for a torch DCP data file name (``__<rank>_<n>.distcp``)."""
    return bool(_SHARD_RE.match(name))


def stale_files(present: Iterable[str], manifest: Mapping[str, Any]) -> list[str]:
    """Shard files left by an earlier save of the same directory that the new manifest does not list."""
    return sorted(n for n in present if is_shard_name(n) and n not in manifest)


# ---------------------------------------------------------------- commit marker / manifest

def make_commit(*, kind: str, save_id: str, files: Mapping[str, FileRecord], info: Mapping[str, Any] | None = None,
                now: float | None = None) -> bytes:
    """The commit marker's bytes: JSON with format, save id, time, per-file size+CRC and ``info``."""
    body: dict[str, Any] = {
        "format": kind,
        "version": FORMAT_VERSION,
        "save_id": save_id,
        "time": time.time() if now is None else now,
        "bytes": int(sum(r.size for r in files.values())),
        "files": {name: {"size": int(r.size), "crc32": int(r.crc32)} for name, r in sorted(files.items())},
    }
    for k, v in (info or {}).items():
        if k in body:
            raise ValueError(f"commit info key {k!r} is reserved")
        body[k] = v
    try:
        return json.dumps(body, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError("checkpoint extra data must be JSON-serialisable (dicts, lists, str, numbers): "
                              f"{e}") from e


def parse_commit(data: bytes, where: str) -> dict[str, Any]:
    """Validate a commit marker's bytes; raise :class:`CheckpointNotCommittedError` when torn or foreign."""
    try:
        body = json.loads(data.decode())
        files = {k: FileRecord(v["size"], v["crc32"]) for k, v in body["files"].items()}
        bad = next((f"the file {k!r} ({r})" for k, r in files.items() if not is_safe_rel(k) or "/" in k
                    or not (is_integer(r.size) and is_integer(r.crc32) and r.size >= 0 and 0 <= r.crc32 < 1 << 32)),
                   None)
        if bad is not None:  # read from a file someone may have written: names stay in the folder, sizes real
            raise ValueError(f"it lists {bad}")
        if body["format"] not in (FORMAT_DCP, FORMAT_SINGLE) or not isinstance(body["save_id"], str):
            raise ValueError("unknown format")
        if not _is_real(body["time"]) or not (is_integer(body["bytes"]) and body["bytes"] >= 0) \
                or not (body.get("step") is None or (is_integer(body["step"]) and body["step"] >= 0)):
            raise ValueError("its time, bytes or step is not a number")
        if not is_integer(body["version"]):
            raise ValueError("its version is not a number")
        if int(body["version"]) > FORMAT_VERSION:
            raise CheckpointError(
                f"{where} was written by a newer ucmagic (format version {body['version']}); "
                "upgrade ucmagic to load it")
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed marker means "not committed"
        raise CheckpointNotCommittedError(
            f"{where} has a damaged commit marker ({e}): the save was interrupted; load another step or save again"
        ) from None
    body["files"] = files
    out: dict[str, Any] = body
    return out


def _is_real(value: Any) -> bool:
    """A finite int or float, never a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def not_committed(path: str) -> CheckpointNotCommittedError:
    """The error for a directory that has no commit marker."""
    return CheckpointNotCommittedError(
        f"{path} is not a committed checkpoint (no {COMMIT_NAME}): its save did not finish, was killed, "
        "or is being overwritten; load an earlier step (list_checkpoints shows them) or save it again")


def check_record(name: str, where: str, expected: FileRecord, size: int, crc: int | None) -> None:
    """Raise :class:`CheckpointCorruptError` when ``size``/``crc`` differ from the manifest."""
    if size != expected.size:
        raise CheckpointCorruptError(
            f"{where}: {name} has {size} bytes but the manifest says {expected.size}; the checkpoint is damaged "
            "(re-save it or load another step)")
    if crc is not None and crc != expected.crc32:
        raise CheckpointCorruptError(
            f"{where}: checksum mismatch in {name} (crc32 {crc:08x}, manifest {expected.crc32:08x}); the file was "
            "corrupted on the volume; re-save it or load another step")


# ---------------------------------------------------------------- save-in-progress record

def make_saving_record(*, save_id: str, host: str, pid: int, now: float | None = None,
                       owner: str | None = None) -> bytes:
    """The save-in-progress record's bytes; ``owner`` is the saving process's ``files.locks.process_tag``."""
    body: dict[str, Any] = {"save_id": save_id, "since": time.time() if now is None else now, "host": host,
                            "pid": pid}
    if owner is not None:
        body["owner"] = owner
    return json.dumps(body, sort_keys=True).encode()


def parse_saving_record(data: bytes) -> dict[str, Any]:
    """A record's fields; a torn or foreign record still means "in progress" (fields then missing)."""
    try:
        body = json.loads(data.decode())
        return body if isinstance(body, dict) else {}
    except (ValueError, UnicodeDecodeError):
        return {}


def in_progress_message(path: str, record: Mapping[str, Any], *, waited: float | None = None) -> str:
    """Why a reader refuses a directory with a save-in-progress record, and what to do."""
    since = record.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    who = f" by pid {record.get('pid')} on {record.get('host')}" if record.get("pid") else ""
    failed = record.get("failed")
    if failed:
        return (f"{path}: the save into this directory that started at {when}{who} failed ({failed}); "
                "nothing there is loadable: save again or load another checkpoint")
    waited_s = f" (waited {waited:.0f} s)" if waited else ""
    return (f"{path}: a save into this directory is in progress since {when}{who}{waited_s}; the previous "
            "checkpoint there was withdrawn when it started. Wait for the save to finish (pass wait=SECONDS to "
            "UCVolumeReader, or call .result() on the save's future first); if that save was killed, save again")


def is_committed_by(commit_save_id: str | None, record: Mapping[str, Any] | None) -> bool:
    """True when the record belongs to the save that wrote the marker (its removal was just pending)."""
    return record is not None and commit_save_id is not None and record.get("save_id") == commit_save_id


# ---------------------------------------------------------------- checkpoints written by others

def missing_or_short(needed: Mapping[str, int], sizes: Mapping[str, int | None]) -> list[str]:
    """Problems of a foreign DCP directory: files its ``.metadata`` references that are absent or too short.

    ``needed`` maps each referenced file to the end offset of its last item; ``sizes`` the files present
    (None when absent).
    """
    out = []
    for name in sorted(needed):
        size = sizes.get(name)
        if size is None:
            out.append(f"{name} is missing")
        elif size < needed[name]:
            out.append(f"{name} has {size} bytes but .metadata references {needed[name]}")
    return out


def storage_problem(name: Any, offset: Any, length: Any, size: int | None) -> str | None:
    """Why a DCP storage entry read from ``.metadata`` (``length`` bytes at ``offset`` of file ``name``) may not
    be read from a file of ``size`` bytes (None: missing), else None. ``name`` must be a plain relative path
    (no ``..``, ``.``, empty part, absolute start or NUL: it stays inside the checkpoint folder), ``offset``
    and ``length`` non-negative integers whose end lies within the file."""
    if not isinstance(name, str) or not is_safe_rel(name):
        return f"names the file {name!r}, outside the checkpoint folder"
    if not is_integer(offset) or not is_integer(length) or offset < 0 or length < 0:
        return f"gives {name} the byte range offset={offset!r} length={length!r}, not two non-negative integers"
    if size is None:
        return f"{name} is missing"
    if offset + length > size:
        return f"{name} has {size} bytes but .metadata references {offset + length}"
    return None


def split_buckets(n: int, items: list[Any], size_of: Any, *, is_bytes: Any) -> list[list[Any]]:
    """Split write items over ``n`` files: byte blobs round-robin, tensors largest-first onto the lightest file.

    Empty buckets are dropped; the result is deterministic for a given input order.
    """
    n = max(1, n)
    buckets: list[list[Any]] = [[] for _ in range(n)]
    load = [0] * n
    blobs = [i for i in items if is_bytes(i)]
    tensors = sorted((i for i in items if not is_bytes(i)), key=size_of, reverse=True)
    for k, item in enumerate(blobs):
        buckets[k % n].append(item)
    for item in tensors:
        j = min(range(n), key=lambda b: (load[b], b))
        buckets[j].append(item)
        load[j] += size_of(item)
    return [b for b in buckets if b]


# ---------------------------------------------------------------- retention

def to_delete(committed_steps: Iterable[int], keep: int | None, newest: int) -> list[int]:
    """Committed steps to delete so that only the ``keep`` highest remain, never ``newest`` itself."""
    if keep is None:
        return []
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive int or None, got {keep!r}")
    steps = sorted(set(committed_steps), reverse=True)
    return sorted(s for s in steps[keep:] if s != newest)


def pick_step(committed: Iterable[int], step: int | str) -> int | None:
    """Resolve ``"latest"`` to the highest committed step (None if none); pass ints through."""
    if step == "latest":
        steps = list(committed)
        return max(steps) if steps else None
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"step must be an int or 'latest', got {step!r}")
    return step


def key_mismatch(expected: Iterable[str], present: Iterable[str]) -> tuple[list[str], list[str]]:
    """(keys the model needs that the checkpoint lacks, checkpoint keys the model does not have)."""
    e, p = set(expected), set(present)
    return sorted(e - p), sorted(p - e)


def describe_keys(keys: list[str], limit: int = 5) -> str:
    """``a, b, c (+7 more)``."""
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


# ---------------------------------------------------------------- the table of checkpoints (CLI, %ucckpt list)

def _field(item: object, name: str, index: int) -> object:
    if isinstance(item, dict):
        return item.get(name)
    if hasattr(item, name):
        return getattr(item, name)
    return item[index] if isinstance(item, (tuple, list)) and len(item) > index else None


def format_checkpoints(items: Sequence[object], *, utc: bool = True) -> str:
    """A table of complete checkpoints: step (``-`` when a foreign name has none), commit time (UTC, or with
    ``utc=False`` this machine's local time with its zone), size, path, and a KIND column (``dcp``,
    ``torch.save``) when any was not written by ucmagic."""
    from ..units import format_size

    kinds = [str(_field(it, "kind", 4) or "ucmagic") for it in items]
    foreign = any(not k.startswith("ucmagic") for k in kinds)
    rows = [("STEP", "COMMITTED (UTC)" if utc else "COMMITTED", "SIZE", "PATH") + (("KIND",) if foreign else ())]
    for it, kind in zip(items, kinds):
        step, path, t, size = (_field(it, "step", 0), _field(it, "path", 1), _field(it, "time", 2),
                               _field(it, "size", 3))
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            when = (time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(t))) if utc
                    else time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(t))))
        else:
            when = str(t or "")
        rows.append((str(step) if step is not None else "-", when,
                     format_size(size) if isinstance(size, (int, float)) else str(size or ""), str(path or ""))
                    + ((kind,) if foreign else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
