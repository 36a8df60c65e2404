"""The exactly-once oracle (issue 40 item 2): a pure model of the planned epoch, and the judge of real runs.

Pure: plain data in, plain data out; no ucmagic, no torch, no files. tests/test_delivery_matrix.py runs
the cells (tests/scripts/matrix_delivery.py) and hands their facts to :func:`judge`; other suites may
reuse :func:`planned_epoch`, :func:`resume_plan` and :func:`delivery_problems`.

The model's rules (the promise of README "Resume mid-epoch" and docs/loading.md, issue 40 item 1):

1. **The planned epoch.** An epoch over ``count`` items on ``world`` ranks delivers every item exactly
   once across ranks and workers, plus at most ``(-count) % world`` repeats: the wrap-around padding that
   keeps ranks equal (``partition="pad"``, DistributedSampler's default). A user IterableDataset that
   splits its items itself delivers them exactly once, no padding.
2. **The order.** Unshuffled, on one rank and without workers, the loop gets the planned order (sorted
   listing, row order, sample order, index order). Shuffled, epoch 1's order differs from epoch 0's
   (the order depends on (seed, epoch); ``set_epoch`` is optional; from RESHUFFLE_MIN items), except
   for a user IterableDataset that shuffles once with a fixed seed (it has no epoch).
3. **Resume.** A state saved after some batches of an epoch (inside the loop, or after a ``break``), or
   after the epoch ended, loaded in a new process: the resumed run delivers exactly the rest of that
   epoch (before + after == the planned epoch as multisets: no duplicate, no gap), or the whole next
   epoch when the saved one had ended; then the following epoch whole. Also at epoch >= 1 without
   ``set_epoch``.
4. **Elastic.** The rest is exact with another ``num_workers`` or world size for every ucmagic iterable
   dataset and for a user wrapper whose inner dataset is one. A map-style dataset (ours or the user's)
   under ``ucmagic.DataLoader`` without a sampler of the user's is split by the loader and resumes on any
   world size; under the user's own sampler (torch's DistributedSampler on several ranks, as a torch
   user writes it) with any ``num_workers`` on the world size it was saved on. A user IterableDataset
   of its own resumes on the same layout only. What is not resumed is refused in ``load_state_dict()`` with a named
   ``UCMagicError`` (never NotImplementedError). (docs/loading.md "Exactly once".)
"""
from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Mapping, Sequence

# ---------------------------------------------------------------- dimensions

KINDS = ("files", "wrapper", "parquet", "tar_map", "tar_stream", "tokens", "mix", "user_map", "user_iter", "table")
DIMS: dict[str, tuple[Any, ...]] = {
    "kind": KINDS,
    "consumer": ("plain", "torch", "uc"),
    "workers": (0, 1, 2, 3),
    "start": ("fork", "spawn"),
    "shuffle": (False, True),
    "resume": ("none", "batch", "epoch_end", "epoch1", "break"),
    "change": ("none", "workers", "world"),
}
MAP_STYLE = frozenset({"tar_map", "tokens", "user_map"})  # len() and [i]: a sampler orders them
# kinds whose own state_dict() serves a plain single-process loop
PLAIN_STATE = frozenset({"files", "parquet", "tar_stream", "mix", "table"})
# kinds that reshuffle per epoch (a user IterableDataset of its own shuffles once, with a fixed seed)
RESHUFFLED = frozenset(KINDS) - {"user_iter"}
RESHUFFLE_MIN = 8  # from 8 items up two epochs' permutations coincide with odds under 1/40,000
OTHER_WORKERS = {0: 2, 1: 3, 2: 0, 3: 1}  # the resumed run's num_workers when they change
WORLD_BEFORE_CHANGE = 2  # change "world": saved on 2 ranks, resumed on 1


def impossible(cell: Mapping[str, Any]) -> str | None:
    """Why a combination cannot be run (None: it can)."""
    c = cell
    if c["consumer"] == "plain" and c["workers"]:
        return "a plain loop over the dataset has no DataLoader, hence no workers"
    if c["workers"] == 0 and c["start"] != "fork":
        return "num_workers=0: no worker process, the start method does not apply (the fork cell is the one)"
    if c["resume"] == "none" and c["change"] != "none":
        return "nothing is resumed, so nothing changes on resume"
    if c["resume"] != "none" and c["consumer"] == "torch":
        return "torch's DataLoader has no state_dict(): resume goes through ucmagic.DataLoader"
    if c["resume"] != "none" and c["consumer"] == "plain" and c["kind"] not in PLAIN_STATE:
        return "a plain loop over this kind keeps its position in user code: nothing of ucmagic to resume"
    if c["consumer"] == "plain" and c["change"] != "none":
        return ("a plain loop has no workers, and dataset.state_dict() sees one rank (several ranks resume "
                "through ucmagic.DataLoader.state_dict())")
    return None


def cell_id(c: Mapping[str, Any]) -> str:
    return (f"{c['kind']}-{c['consumer']}-w{c['workers']}-{c['start']}-{'shuf' if c['shuffle'] else 'seq'}-"
            f"{c['resume']}-{c['change']}")


def layouts(c: Mapping[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(world, num_workers) of the run before the resume and of the resumed run."""
    before = (WORLD_BEFORE_CHANGE if c["change"] == "world" else 1, c["workers"])
    after = (1, OTHER_WORKERS[c["workers"]] if c["change"] == "workers" else c["workers"])
    return before, after


def refused(c: Mapping[str, Any]) -> bool:
    """The resume must be refused in load_state_dict() with a named UCMagicError (rule 4)."""
    if c["resume"] == "none":
        return False
    # a map-style dataset under ucmagic.DataLoader (no sampler of the user's) is split by the loader and resumes
    # on any world size; under a sampler of the user's (torch's DistributedSampler) only on the same world size
    return (c["kind"] == "user_iter" and c["change"] != "none") or (
        c["kind"] in MAP_STYLE and c["change"] == "world" and c["consumer"] != "uc")


def stop_batch(c: Mapping[str, Any], batches: int) -> int:
    """The batch after which a mid-epoch resume point saves (1 .. batches-1, fixed per cell)."""
    h = int(hashlib.sha256(cell_id(c).encode()).hexdigest()[:8], 16)
    return 1 + h % max(1, batches - 1)


# ---------------------------------------------------------------- the planned epoch

def padding(kind: str, count: int, world: int) -> int:
    """Repeats an epoch may hold on ``world`` ranks (rule 1)."""
    return 0 if kind == "user_iter" else (-count) % world


def planned_epoch(items: Sequence[str], kind: str, world: int) -> dict[str, Any]:
    """What one epoch must deliver across every rank and worker: each item once (``once``), up to
    ``pad`` repeats of items of the epoch."""
    return {"once": sorted(items), "pad": padding(kind, len(items), world)}


def promised_order(items: Sequence[str], c: Mapping[str, Any], world: int, workers: int) -> list[str] | None:
    """The order the loop must get, where the product promises one (rule 2), else None."""
    return list(items) if not c["shuffle"] and world == 1 and workers == 0 else None


def resume_plan(items: Sequence[str], before: Sequence[str], *, epoch_ended: bool) -> Counter[str]:
    """What the resumed run must deliver: the rest of the epoch (the planned items the run before did
    not deliver), or the whole next epoch when the saved epoch had ended (rule 3)."""
    if epoch_ended:
        return Counter(items)
    rest = Counter(items)
    rest.subtract(Counter(before))
    return +rest


# ---------------------------------------------------------------- the judge

def delivery_problems(what: str, got: Sequence[str], want: Counter[str], pad: int) -> list[str]:
    """How ``got`` breaks "exactly the items of ``want``, plus at most ``pad`` repeats"."""
    have = Counter(got)
    missing = want - have
    extra = have - want
    unknown = sorted(k for k in extra if k not in want)
    repeats = sum(extra.values()) - sum(extra[k] for k in unknown)
    out = []
    if missing:
        out.append(f"{what}: {sum(missing.values())} missing of {sum(want.values())} (e.g. {sorted(missing)[:3]})")
    if repeats > pad:
        dup = sorted(k for k in extra if k in want)
        out.append(f"{what}: {repeats} duplicates (allowed padding {pad}; e.g. {dup[:3]})")
    if unknown:
        out.append(f"{what}: {len(unknown)} items not in the plan (e.g. {unknown[:3]})")
    return out


def partial_problems(what: str, got: Sequence[str], items: Sequence[str], pad: int) -> list[str]:
    """A partial epoch: no item twice (beyond padding), nothing outside the plan."""
    have = Counter(got)
    known = set(items)
    out = []
    repeats = sum(n - 1 for k, n in have.items() if n > 1 and k in known)
    if repeats > pad:
        out.append(f"{what}: {repeats} duplicates before the epoch ended (e.g. "
                   f"{sorted(k for k, n in have.items() if n > 1)[:3]})")
    unknown = sorted(k for k in have if k not in known)
    if unknown:
        out.append(f"{what}: {len(unknown)} items not in the plan (e.g. {unknown[:3]})")
    return out


def named(err: Mapping[str, Any] | None) -> bool:
    return err is not None and "UCMagicError" in err.get("mro", [])


def describe(err: Mapping[str, Any]) -> str:
    msg = err.get("msg", "")
    return f"{err.get('type')}: {msg if len(msg) < 300 else msg[:300] + ' ...'} [in {err.get('where', '?')}]"


def first_difference(a: Sequence[str], b: Sequence[str]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def merged(ranks: Sequence[Sequence[str]]) -> list[str]:
    return [x for r in ranks for x in r]


def judge(c: Mapping[str, Any], r: Mapping[str, Any]) -> list[str]:
    """Every rule the facts ``r`` of cell ``c`` break (empty: the cell passes).

    ``r``: ``items`` (the planned items of epochs 0-2 in planned order: ``{"0": [...], "1": [...], ...}``),
    ``before`` (per epoch of the first run, ``{"ranks": [[ids per rank]], "complete": bool}``),
    ``error`` (a failure of the first run), and for a resume ``after`` (per rank ids of the resumed
    run) and ``next`` (those of the epoch after it), or ``after_error`` (with ``where``: ``load`` or
    ``iterate``); ``crash`` when no facts came.
    """
    if "crash" in r:
        return [r["crash"]]
    (w0, n0), (w1, n1) = layouts(c)
    kind = c["kind"]
    items = {int(e): list(v) for e, v in r["items"].items()}
    out: list[str] = []
    if r.get("error"):
        return [f"the run before the resume failed: {describe(r['error'])}"]
    epochs = r["before"]
    for e, ep in enumerate(epochs):
        got = merged(ep["ranks"])
        pad = padding(kind, len(items[e]), w0)
        if ep["complete"]:
            out += delivery_problems(f"epoch {e}", got, Counter(items[e]), pad)
            order = promised_order(items[e], c, w0, n0)
            if order is not None and got != order and not out:
                out.append(f"epoch {e}: not in the planned order (first difference at position "
                           f"{first_difference(got, order)})")
        else:
            out += partial_problems(f"epoch {e} before the resume", got, items[e], pad)
    full = [merged(ep["ranks"]) for ep in epochs if ep["complete"]]
    if (c["shuffle"] and kind in RESHUFFLED and c["resume"] == "none" and len(full) == 2 and full[0] == full[1]
            and len(items[0]) >= RESHUFFLE_MIN):
        out.append("shuffle=True: epoch 1 came in epoch 0's order")
    if c["resume"] == "none":
        return out
    ended = c["resume"] == "epoch_end"
    e = len(epochs) - 1  # the saved epoch
    if refused(c):
        err = r.get("after_error")
        if err is None:
            out.append("a resume this layout change cannot keep exact: expected a named UCMagicError from "
                       "load_state_dict(), got a resumed run")
        elif not named(err) or err.get("where") != "load":
            out.append(f"a resume this layout change cannot keep exact: expected a named UCMagicError from "
                       f"load_state_dict(), got {describe(err)}")
        return out
    if r.get("after_error"):
        return out + [f"the resumed run failed: {describe(r['after_error'])}"]
    before = merged(epochs[e]["ranks"])
    target = e + 1 if ended else e
    after = merged(r["after"])
    pad = padding(kind, len(items[target]), w1) + (0 if ended else padding(kind, len(items[target]), w0))
    # the resumed run delivers resume_plan(...): with what came before, the planned epoch
    whole = after if ended else before + after
    what = f"resumed epoch {target}" + ("" if ended else f" (before {len(before)} + after {len(after)})")
    out += delivery_problems(what, whole, Counter(items[target]), pad)
    if (ended and c["shuffle"] and kind in RESHUFFLED and (w0, n0) == (w1, n1) and after == before
            and len(before) >= RESHUFFLE_MIN):
        out.append("shuffle=True: the epoch after the resume came in the saved epoch's order")
    order = promised_order(items[target], c, w1, n1)
    if order is not None and not out and (w0, n0) == (w1, n1) and whole != order:
        out.append(f"resumed epoch {target}: before + after is not the planned order")
    if "next" in r:  # then the epochs go on: the next one whole
        nxt = target + 1
        out += delivery_problems(f"epoch {nxt} after the resumed one", merged(r["next"]), Counter(items[nxt]),
                                 padding(kind, len(items[nxt]), w1))
    return out
