"""The scenario matrix (issue 23 item 5): consumer x budget x workers x event, each cell judged on
delivery, errors, the budget bound and what it leaves behind.

Dimensions (values as named in cell ids ``consumer-budget-workers-event``):

- consumer: ``plain`` (``for p in ds``), ``wrap_uc`` (the seed's user IterableDataset wrapping
  UCVolumeDataset, under ``ucmagic.DataLoader``), ``wrap_torch`` (the same under torch's
  ``DataLoader``), ``uc`` (``ucmagic.DataLoader(ds)``), ``torch`` (``torch.utils.data.DataLoader(ds)``).
  Path consumers read every path in the main process when the batch arrives; the wrapper reads it
  in the worker, as the seed's decoding wrapper does. Batch size 4, loaders' other defaults. The
  data: 240 files of 4-8 KiB (1.4 MB) under ``train/class<k>/``, each starting with its own path.
- budget: ``none``; ``large`` (4x the data); ``window`` (1 MiB: 70% of the data, a sixth of the
  1,024-item window protected by default when consumption is not reported, 6x the most torch's
  loader holds queued with 2 workers, and room for 2 streams x 64 files of the mean size);
  ``tiny`` (12 KiB: one and a half files, less than any batch, more than the largest file).
- workers: ``w0``; ``fork2`` (2 workers, fork, persistent); ``spawn2`` (2 workers, spawn, the
  loader's default persistence: torch's off, ucmagic's on).
- event: ``complete``; ``break`` (after a third of the items, then a whole second epoch);
  ``sigint`` (SIGINT to the process while the loop is in ``next()``, after a third); ``kill`` (one
  worker SIGKILLed after a third); ``change`` (the last not-yet-delivered source file rewritten,
  other size and mtime, after a third); ``diskfull`` (cache on a 4 MiB tmpfs; after a third a ballast
  file leaves 48 KiB free); ``second`` (a second process iterates the same source into the same cache
  at the same time: plain loop, its own dataset, no budget of its own).

Expected outcomes (:func:`judge`):

- an epoch that completes delivers every file exactly once with the source's bytes (content hashes),
  at a path ending with the file's source-relative path (item 3);
- ``tiny``: the event's own outcome, as with any budget: with consumption reports (``uc``, ``wrap_uc``)
  a budget of at least the largest file works, fills beyond it wait for room (issue 40 item 4); without
  them (plain loop, torch's loader) a budget that cannot hold a stream's protection window is refused at
  the first item by BudgetTooSmallError naming ``cache_limit``; never a hang;
- ``complete``/``break``: completion (``break``: the partial epoch's items correct and distinct,
  then a whole second epoch);
- ``sigint``: KeyboardInterrupt reaches the loop, then the process exits;
- ``kill``: torch's worker-died RuntimeError or a UCMagicError, no hang;
- ``change``: completion with the rewritten file's old or new bytes (never others), or
  SourceChangedError; a fresh dataset then serves the new bytes;
- ``diskfull``: a UCMagicError naming ``cache_limit``, or completion (the cache made room by
  evicting its own consumed copies); never a raw OSError;
- ``second``: both processes complete correctly, and the smaller budget bounds the directory.

And in every cell: while it runs, the cache directory (every file's st_size) stays within
``budget + metadata at start + SLACK`` with SLACK = 64 KiB + 2 files of the largest size per stream
(a fill a blocked consumer needs next may go past the budget); after the loop no thread or worker
process is left (idle ``ucmagic-*`` pool threads excepted: matrix_cell.leftovers documents it),
the process burns < 0.15 s CPU in a 0.3 s idle window, no file appears or changes outside the
cache directory (source tree, work dir, $HOME, $TMPDIR); after an event that stops the epoch a
fresh plain loop on the same cache delivers correct bytes. Each cell has a deadline (CELL_TIMEOUT,
SPAWN_CELL_TIMEOUT with spawn workers, and EVENT_DEADLINE after its event): a hang fails the cell with
every thread's stack, and worker processes that outlive it fail it too.

Impossible cells are listed by :func:`impossible` with their reason. The default run is the
all-pairs sample (:func:`all_pairs`, 35 cells); ``pytest --full`` (``--matrix=wide``) every cell without spawn
workers and all pairs of the spawn cells among themselves (run_size.wide, 262 cells); ``--matrix=full`` (or
``UCMAGIC_MATRIX=full``) the product (344 cells).
Cells run in child processes (tests/scripts/matrix_cell.py), a few per child; a ``sigint`` cell ends its child.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import re
import subprocess
import sys
from typing import Any, Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_size import all_pairs, cell_pairs, wide  # noqa: E402

CELL_SCRIPT = os.path.join(HERE, "scripts", "matrix_cell.py")

FILES, MIN_SIZE, MAX_SIZE, BATCH = 240, 4 * 1024, 8 * 1024, 4
KiB, MiB = 1024, 1024 * 1024
# Deadlines are hang detectors, not performance bounds: far beyond what a cell takes on a loaded 2-core machine
# (spawn cells start 2-4 interpreters; a passing cell never waits them out).
CELL_TIMEOUT, SPAWN_CELL_TIMEOUT, EVENT_DEADLINE = 120.0, 240.0, 60.0


def cell_timeout(cell: dict[str, str]) -> float:
    return SPAWN_CELL_TIMEOUT if cell["workers"] == "spawn2" else CELL_TIMEOUT
SLACK_FIXED = 64 * KiB
GROUP = 6  # cells per child process

DIMS: dict[str, list[str]] = {
    "consumer": ["plain", "wrap_uc", "wrap_torch", "uc", "torch"],
    "budget": ["none", "large", "window", "tiny"],
    "workers": ["w0", "fork2", "spawn2"],
    "event": ["complete", "break", "sigint", "kill", "change", "diskfull", "second"],
}


def impossible(cell: dict[str, str]) -> str | None:
    """Why a combination cannot be run (None: it can)."""
    if cell["consumer"] == "plain" and cell["workers"] != "w0":
        return "a plain loop over the dataset has no DataLoader, hence no worker processes"
    if cell["event"] == "kill" and cell["workers"] == "w0":
        return "num_workers=0: there is no worker process to SIGKILL"
    return None


# Epochs of loop work an event costs: break = a third, then a whole epoch; sigint and kill stop
# after a third (then a fresh unbudgeted loop); a ``second`` process runs beside the loop.
EVENT_WORK = {"complete": 1.0, "break": 4 / 3, "sigint": 1 / 3, "kill": 1 / 3, "change": 1.0, "diskfull": 1.0,
              "second": 1.0}


def cost(cell: dict[str, str]) -> float:
    """Rough seconds a cell takes on a quiet machine (the sample's objective, measured per phase):
    the harness's own ~0.4 s; two spawn interpreters importing torch (again for the second epoch of
    a ``break`` where torch's loader does not keep its workers); an epoch of 240 files ~0.5 s,
    ~10 s where ucmagic.DataLoader completes under a budget smaller than a batch (each fill waits
    the cache's moment before it goes over), none where the budget was refused at once (measured
    under the old budget rule; only the sample's objective, coverage does not depend on it)."""
    c, w, ev = cell["consumer"], cell["workers"], cell["event"]
    start = {"w0": 0.0, "fork2": 0.3, "spawn2": 3.0}[w] * (2 if w == "spawn2" and ev == "break" and
                                                          c in ("torch", "wrap_torch") else 1)
    epoch = 0.5 if cell["budget"] != "tiny" else 10.0 if c in ("uc", "wrap_uc") else 0.0
    after = 0.3 if ev in ("sigint", "kill", "change", "diskfull", "second") else 0.0  # fresh loop / second process
    return 0.4 + start + EVENT_WORK[ev] * epoch + after


# ---------------------------------------------------------------- the all-pairs sample

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=2, max_size=4), st.data())
def test_all_pairs_covers_every_possible_pair(sizes, data):
    dims = {f"d{i}": list(range(n)) for i, n in enumerate(sizes)}
    product = [dict(zip(dims, v)) for v in itertools.product(*dims.values())]
    banned = data.draw(st.sets(st.sampled_from(range(len(product)))))
    possible = lambda c: product.index(c) not in banned  # noqa: E731
    prices = data.draw(st.lists(st.floats(0, 20), min_size=len(product), max_size=len(product)))
    price = lambda c: prices[product.index(c)]  # noqa: E731
    sample = all_pairs(dims, possible, price)
    wanted = set().union(*(cell_pairs(c, list(dims)) for c in product if possible(c))) if product else set()
    got = set().union(*(cell_pairs(c, list(dims)) for c in sample)) if sample else set()
    assert wanted <= got
    assert all(possible(c) for c in sample)
    assert len({tuple(c.values()) for c in sample}) == len(sample)  # no cell twice
    assert sample == all_pairs(dims, possible, price)  # deterministic
    # the local search leaves no cell that could simply be dropped
    for c in sample:
        rest = [x for x in sample if x is not c]
        assert not wanted <= (set().union(*(cell_pairs(x, list(dims)) for x in rest)) if rest else set())


def test_the_default_sample_covers_every_pair_of_the_matrix_at_less_cost_than_the_greedy():
    possible = lambda c: impossible(c) is None  # noqa: E731
    sample = matrix_cells("pairs")
    names = list(DIMS)
    wanted = set().union(*(cell_pairs(c, names) for c in matrix_cells("full")))
    assert set().union(*(cell_pairs(c, names) for c in sample)) == wanted
    greedy_only: list[dict[str, str]] = []  # the plain greedy by count, the sample before the local search
    cells = matrix_cells("full")
    left = set(wanted)
    while left:
        best = max(cells, key=lambda c: (len(cell_pairs(c, names) & left), -cost(c)))
        greedy_only.append(best)
        left -= cell_pairs(best, names)
    assert all(possible(c) for c in sample)
    assert sum(map(cost, sample)) < 0.8 * sum(map(cost, greedy_only))


def matrix_cells(mode: str) -> list[dict[str, str]]:
    possible = lambda c: impossible(c) is None  # noqa: E731
    if mode == "wide":  # --full: every cell without spawned workers, and all pairs of the spawn cells
        return wide(matrix_cells("full"), list(DIMS), lambda c: c["workers"] == "spawn2", cost)
    if mode == "full":
        return [dict(zip(DIMS, v)) for v in itertools.product(*DIMS.values()) if possible(dict(zip(DIMS, v)))]
    return all_pairs(DIMS, possible, cost)


def cell_id(c: dict[str, str]) -> str:
    return "-".join(c[k] for k in DIMS)


def test_every_combination_is_run_or_mapped_with_a_reason():
    full = {cell_id(c) for c in matrix_cells("full")}
    for vals in itertools.product(*DIMS.values()):
        c = dict(zip(DIMS, vals))
        assert (cell_id(c) in full) != bool(impossible(c)), cell_id(c)
    sample = matrix_cells("pairs")
    names = list(DIMS)
    assert set().union(*(cell_pairs(c, names) for c in matrix_cells("full"))) == \
        set().union(*(cell_pairs(c, names) for c in sample))
    assert len(full) == 344 and len(sample) < 45
    broad, product = matrix_cells("wide"), matrix_cells("full")
    assert {cell_id(c) for c in product if c["workers"] != "spawn2"} <= {cell_id(c) for c in broad}
    spawned = [c for c in product if c["workers"] == "spawn2"]
    assert set().union(*(cell_pairs(c, names) for c in spawned)) == \
        set().union(*(cell_pairs(c, names) for c in broad if c["workers"] == "spawn2"))
    assert len(broad) < len(full)


# ---------------------------------------------------------------- running cells

def write_source(root: str) -> int:
    """FILES files under train/class<k>/ of MIN_SIZE..MAX_SIZE bytes, each starting with its relative
    path (the child checks every delivered item against it). Returns the total size."""
    rng = random.Random(23)
    total = 0
    for i in range(FILES):
        rel = f"train/class{i % 4}/img{i:04d}.bin"
        size = rng.randint(MIN_SIZE, MAX_SIZE)
        head = (rel + "\n").encode()
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(head + rng.randbytes(size - len(head)))
        total += size
    return total


def limit_of(budget: str, data_bytes: int) -> int | None:
    return {"none": None, "large": 4 * data_bytes, "window": 1 * MiB, "tiny": 12 * KiB}[budget]


class Runner:
    """Runs the requested cells, GROUP per child process, on first demand; a hang or crash restarts."""

    def __init__(self, root: str, cells: list[dict[str, str]]) -> None:
        self.root = root
        self.src = os.path.join(root, "src")
        self.data_bytes = write_source(self.src)
        # sigint cells end their child (the process must exit after the interrupt)
        order = [c for c in cells if c["event"] != "sigint"]
        self.groups: list[list[dict[str, str]]] = []
        for c in [c for c in cells if c["event"] == "sigint"]:
            take, order = order[:GROUP - 1], order[GROUP - 1:]
            self.groups.append(take + [c])
        self.groups += [order[i:i + GROUP] for i in range(0, len(order), GROUP)]
        self.results: dict[str, dict[str, Any]] = {}
        self.orphans: dict[str, str] = {}
        self.runs = 0

    def result(self, cid: str) -> dict[str, Any]:
        if cid not in self.results:
            group = next(g for g in self.groups if any(cell_id(c) == cid for c in g))
            self._run(group)
        res = self.results[cid]
        if cid in self.orphans:
            res["orphans"] = self.orphans[cid]
        return res

    def _spec(self, cells: list[dict[str, str]]) -> dict[str, Any]:
        self.runs += 1
        work = os.path.join(self.root, f"run{self.runs}")
        os.makedirs(work)
        return {"workdir": work, "src": self.src, "files": FILES, "batch": BATCH, "trigger_at": FILES // 3,
                "event_deadline": EVENT_DEADLINE, "tmpfs_bytes": 4 * MiB,
                "disk_leave": 48 * KiB,
                "cells": [{**c, "id": cell_id(c), "limit": limit_of(c["budget"], self.data_bytes),
                           "timeout": cell_timeout(c)} for c in cells]}

    def _run(self, group: list[dict[str, str]]) -> None:
        todo = list(group)
        while todo:
            spec = self._spec(todo)
            path = os.path.join(spec["workdir"], "spec.json")
            with open(path, "w") as f:
                json.dump(spec, f)
            home, tmp = os.path.join(spec["workdir"], "home"), os.path.join(spec["workdir"], "tmp")
            os.makedirs(home)
            os.makedirs(tmp)
            env = {k: v for k, v in os.environ.items() if not k.startswith("UCMAGIC_CACHE")}
            env.update(HOME=home, TMPDIR=tmp, PYTHONPATH=os.path.dirname(HERE), UCMAGIC_PROGRESS="off")
            budget_s = sum(2 * cell_timeout(c) for c in todo) + 30  # a backstop: the child's deadlines fire first
            out_path, err_path = os.path.join(spec["workdir"], "stdout"), os.path.join(spec["workdir"], "stderr")
            with open(out_path, "w") as fo, open(err_path, "w") as fe:
                # a session of its own: worker processes it leaves behind are found (and killed) by it
                proc = subprocess.Popen([sys.executable, CELL_SCRIPT, path], stdout=fo, stderr=fe, env=env,
                                        start_new_session=True)
                try:
                    rc: int | None = proc.wait(timeout=budget_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    rc = None
            orphans = kill_session(proc.pid)
            unmount_under(spec["workdir"])  # a tmpfs of a cell whose child died before unmounting it
            with open(out_path) as f:
                out = f.read()
            with open(err_path) as f:
                err = f.read()
            started = None
            for line in out.splitlines():
                if line.startswith("START "):
                    started = line.split()[1]
                elif line.startswith("RESULT "):
                    res = json.loads(line[len("RESULT "):])
                    self.results[res["id"]] = res
                    todo = [c for c in todo if cell_id(c) != res["id"]]
                    started = None
            finished = "DONE" in out.splitlines()
            exit_problem = None
            if finished and rc != 0:
                exit_problem = f"the child did not exit cleanly after its cells (rc {rc}): {err[-3000:]}"
            elif finished and any("ucmagic" in chunk[:1500] for chunk in err.split("Exception ignored")[1:]):
                exit_problem = "the child printed 'Exception ignored' in ucmagic code: " + err[-2000:]
            if orphans:
                blame = [started] if started is not None else [cell_id(c) for c in group]
                for cid in blame:
                    self.orphans[cid] = (f"processes outlived the child that started them (killed now): {orphans}"
                                         + ("" if started is not None else "  (shared child)"))
            if exit_problem:
                for c in group:
                    self.results[cell_id(c)].setdefault("exit_problem", exit_problem + "  (shared child)")
            if started is not None:
                if "Timeout (" in err:
                    cell = next(c for c in group if cell_id(c) == started)
                    limit = (f"{EVENT_DEADLINE:g} s after its event" if f"EVENT {started}" in out
                             else f"{cell_timeout(cell):g} s")
                    why = f"hang: no outcome within {limit}; the loop's stack: {main_stack(err)}\nall threads: "
                else:
                    why = f"child died (rc {rc}): "
                self.results[started] = {"id": started, "crash": why + err[-6000:]}
                todo = [c for c in todo if cell_id(c) != started]
            elif todo and not finished:
                for c in todo:
                    self.results[cell_id(c)] = {"id": cell_id(c), "crash": f"child failed (rc {rc}): {err[-4000:]}"}
                todo = []


def kill_session(sid: int) -> list[str]:
    """Kill what is left of session ``sid`` (a child's DataLoader workers that outlived it); describe them."""
    import psutil

    left = []
    for p in psutil.process_iter(["pid", "cmdline", "ppid"]):
        try:
            if p.pid != sid and os.getsid(p.pid) == sid:
                left.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    # exiting on their own (multiprocessing's resource tracker; a worker sees its parent gone within torch's 5 s
    # status check): a wait that ends when they are gone, long enough for a loaded machine
    _, left = psutil.wait_procs(left, timeout=30)
    harness = ("resource_tracker", CELL_SCRIPT + " --second")  # it ends with the workers; our second process
    desc = [f"pid {p.pid} (ppid {p.info['ppid']}): {' '.join(p.info['cmdline'] or [])[-80:]}" for p in left
            if not any(h in " ".join(p.info["cmdline"] or []) for h in harness)]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=5)
    return desc


def unmount_under(root: str) -> None:
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f]
    for mp in points:
        if mp.startswith(root.rstrip("/") + "/"):
            subprocess.run(["umount", "-l", mp], capture_output=True, check=False)


def main_stack(dump: str) -> str:
    """The main thread's stack from a faulthandler dump (the block that runs matrix_cell's main)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    for b in blocks:
        if "in main" in b and "matrix_cell.py" in b:
            return " | ".join(ln.strip() for ln in b.splitlines()[1:8])
    return "(not found)"


def pytest_generate_tests(metafunc):
    if "matrix_cell" in metafunc.fixturenames:
        cells = matrix_cells(metafunc.config.getoption("--matrix"))
        metafunc.parametrize("matrix_cell", cells, ids=[cell_id(c) for c in cells])


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
    wanted = [item.callspec.params["matrix_cell"] for item in request.session.items
              if getattr(item, "callspec", None) is not None and "matrix_cell" in item.callspec.params
              and item.module is request.module]
    return Runner(str(tmp_path_factory.mktemp("matrix")), wanted)


# ---------------------------------------------------------------- the expected outcome of a cell

def named(outcome: dict[str, Any]) -> bool:
    return outcome.get("kind") == "error" and "UCMagicError" in outcome.get("mro", [])


def describe(outcome: dict[str, Any]) -> str:
    if outcome.get("kind") != "error":
        return outcome.get("kind", "?")
    msg = outcome["msg"]
    out = f"{outcome['type']}: {msg if len(msg) < 400 else msg[:150] + ' ... ' + msg[-250:]}"
    if not named(outcome) and outcome.get("tb"):  # a raw error: where it came from
        out += "\n" + outcome["tb"][-2000:]
    return out


def delivery_problems(what: str, s: dict[str, Any], *, whole: bool, changed_ok: Sequence[str | None] = ()) -> list[str]:
    out = []
    if whole and (s["n"] != FILES or s["distinct"] != FILES or s["missing"]):
        out.append(f"{what}: {s['n']} items, {s['distinct']} distinct, {s['missing']} missing of {FILES} "
                   f"(duplicates e.g. {s['dups']})")
    elif not whole and s["dups"]:
        out.append(f"{what}: duplicates {s['dups']}")
    if s["bad_n"] or s["unknown"]:
        out.append(f"{what}: wrong bytes for {s['bad_n']} items (e.g. {s['bad']}, unknown {s['unknown']})")
    if s["changed_tag"] not in (None, *changed_ok):
        out.append(f"{what}: the rewritten file came as {s['changed_tag']!r} bytes (allowed {list(changed_ok)})")
    if s["path_bad_n"]:
        out.append(f"{what}: {s['path_bad_n']} yielded paths do not end with the source-relative path "
                   f"(item 3), e.g. {s['path_bad']}")
    return out


def judge(cell: dict[str, str], r: dict[str, Any]) -> list[str]:
    """Every expectation the cell's result breaks (empty: the cell passes)."""
    if "crash" in r:
        return [r["crash"]] + ([r["orphans"]] if "orphans" in r else [])
    ev, budget, consumer = cell["event"], cell["budget"], cell["consumer"]
    out: list[str] = []
    oc = r["outcome"]
    complete = oc["kind"] == "complete"
    epochs = r["epochs"]

    def need(cond: bool, msg: str) -> None:
        if not cond:
            out.append(msg)

    def completed_correctly(changed_ok: Sequence[str | None] = ("ok",)) -> None:
        for i, e in enumerate(epochs):
            out.extend(delivery_problems(f"epoch {i + 1}", e["sum"], whole=not e["partial"], changed_ok=changed_ok))

    # a budget of at least the largest file works (issue 40 item 4): ``tiny`` holds 1.5 files, less than a
    # batch; fills beyond it wait for room. Where the loop reports what it consumed (ucmagic.DataLoader,
    # also through a wrapper) it is never refused. Where nothing reports it (a plain loop, torch's loader),
    # a stream protects the last items it handed out (README, docs/cache.md): a budget that cannot hold
    # that window is refused at the first item by BudgetTooSmallError naming the size needed, never a hang
    # and never an evicted file the loop still opens.
    tiny_refused = budget == "tiny" and named(oc) and not r["event_fired"]
    reports = cell["consumer"] in ("uc", "wrap_uc")
    if tiny_refused and reports:
        out.append(f"a budget of {r.get('limit')} B holds the largest file ({MAX_SIZE} B): it must work, "
                   f"got {describe(oc)}")
    elif tiny_refused:
        need("BudgetTooSmallError" in oc.get("mro", []) and "cache_limit" in oc.get("msg", ""),
             f"without consumption reports a too-small window is BudgetTooSmallError naming cache_limit, "
             f"got {describe(oc)}")
    elif ev in ("complete", "break", "second"):
        need(complete, f"expected the epoch to complete, got {describe(oc)}")
    elif ev == "sigint":
        need(oc["kind"] == "interrupt", f"expected KeyboardInterrupt in the loop, got {describe(oc)}")
    elif ev == "kill":
        need(r.get("killed"), "no worker process was found to kill")
        died = oc["kind"] == "error" and oc["type"] == "RuntimeError" and "DataLoader worker" in oc["msg"]
        need(died or named(oc), f"expected torch's worker-died error or a UCMagicError, got {describe(oc)}")
    elif ev == "change":
        need(complete or "SourceChangedError" in oc.get("mro", []),
             f"expected completion or SourceChangedError, got {describe(oc)}")
    elif ev == "diskfull":
        need(complete or named(oc), f"expected completion or a UCMagicError, got {describe(oc)}")
        if named(oc):
            need("cache_limit" in oc["msg"], f"the disk-full error does not name cache_limit: {oc['msg']}")
    if ev not in ("complete", "break", "second") and not tiny_refused:
        need(r["event_fired"], "the event never fired (the loop ended or failed first)")
    # what was delivered is right, whether or not the epoch completed
    if complete:
        completed_correctly(("ok", "new") if ev == "change" else ("ok",))
    else:
        for i, e in enumerate(epochs):
            out.extend(delivery_problems(f"epoch {i + 1} (stopped)", e["sum"], whole=False,
                                         changed_ok=("ok", "new")))
    if ev == "second":
        s2 = r.get("second", {})
        o2 = s2.get("outcome", {})
        if o2.get("kind") == "complete":
            out.extend(delivery_problems("second process", s2["sum"], whole=True))
        elif budget == "tiny" and "BudgetTooSmallError" in o2.get("mro", []) and "cache_limit" in o2.get("msg", ""):
            pass  # the second process is a plain loop (no reports) under the first one's budget, the smallest holds
        else:
            out.append(f"second process: expected completion, got {describe(o2)}")
    if "recovery" in r:
        rec = r["recovery"]
        if rec["kind"] == "complete":
            out.extend(delivery_problems("fresh loop after the event", rec["sum"], whole=True,
                                         changed_ok=("new",)))
        else:
            out.append(f"fresh loop after the event failed: {describe(rec)}")
    limit = r.get("limit")
    if limit is not None:
        # reported consumption keeps up to a batch per stream protected beyond the budget (docs/cache.md)
        per_stream = 2 * MAX_SIZE + (BATCH * MAX_SIZE if consumer in ("uc", "wrap_uc") else 0)
        slack = SLACK_FIXED + per_stream * (r["streams"] + (ev == "second"))
        bound = limit + r.get("meta0", 0) + slack
        need(r["peak"] <= bound, f"cache directory peaked at {r['peak']:,} B > budget {limit:,} + metadata "
                                 f"{r.get('meta0', 0):,} + slack {slack:,} ({r['samples']} samples)")
    left = r["left"]
    need(not left["threads"], f"threads left after the loop: {left['threads']}")
    need(not left["procs"], f"processes left after the loop: {left['procs']}")
    need(left["idle_cpu"] < 0.15, f"{left['idle_cpu']:.2f} CPU-s burnt in a 0.3 s idle window after the loop")
    need(not r["stray"], f"changes outside the cache directory: {r['stray']}")
    if "exit_problem" in r:
        out.append(r["exit_problem"])
    if "orphans" in r:
        out.append(r["orphans"])
    return out


# Known failures of the engine, still open in issue 23 (each is reported as xfail with its reason
# when it fails, and passes silently once fixed; none hides a hang: a hang still fails its cell
# unless listed here).
KNOWN_FAILURES: list[tuple[Callable[[dict[str, str]], bool], str, str]] = [
    # (matches the cell, a symptom every problem shows, why): open engine failures, run and xfailed.
    # Empty: the last one (a fresh unbudgeted loop refused with the budget of a dataset just
    # interrupted, still alive for a moment) is fixed: BudgetKeeper.settled (collecting at each look).
]


def known_failure(cell: dict[str, str], problems: Sequence[str]) -> str | None:
    """The reason a cell's problems are a known, open engine failure (every problem must match)."""
    for matches, symptom, reason in KNOWN_FAILURES:
        if matches(cell) and problems and all(symptom in p for p in problems):
            return reason
    return None


@pytest.mark.scaled
@pytest.mark.timeout(SPAWN_CELL_TIMEOUT * 2 * GROUP + 120)
def test_scenario_cell(matrix_cell, runner):
    r = runner.result(cell_id(matrix_cell))
    if "skip" in r:
        pytest.skip(r["skip"])
    problems = judge(matrix_cell, r)
    reason = known_failure(matrix_cell, problems)
    if reason:
        pytest.xfail(f"known (issue 23): {reason}")
    assert not problems, f"{cell_id(matrix_cell)}:\n- " + "\n- ".join(problems)


# ---------------------------------------------------------------- the judge itself (pure, no child)

def _summary(**kw: Any) -> dict[str, Any]:
    s = {"n": FILES, "distinct": FILES, "dups": [], "missing": 0, "unknown": [], "bad": [], "bad_n": 0,
         "changed_tag": None, "path_bad_n": 0, "path_bad": []}
    return {**s, **kw}


def _result(**kw: Any) -> dict[str, Any]:
    r = {"id": "x", "limit": 1 * MiB, "meta0": 10_000, "outcome": {"kind": "complete"}, "event_fired": True,
         "epochs": [{"partial": False, "sum": _summary()}], "peak": 900_000, "samples": 50, "streams": 1,
         "left": {"threads": [], "procs": [], "idle_cpu": 0.01}, "stray": []}
    return {**r, **kw}


def _error(name: str, *mro: str, msg: str = "set cache_limit= larger") -> dict[str, Any]:
    return {"kind": "error", "type": name, "mro": [name, *mro, "Exception"], "msg": msg, "tb": ""}


def test_judge_passes_a_correct_epoch_and_names_each_broken_expectation():
    cell = {"consumer": "uc", "budget": "window", "workers": "w0", "event": "complete"}
    assert judge(cell, _result()) == []
    broken = _result(epochs=[{"partial": False, "sum": _summary(n=FILES + 1, dups=["a"], bad_n=1, bad=["b"])}],
                     peak=5 * MiB, left={"threads": [{"name": "t"}], "procs": [], "idle_cpu": 0.4},
                     stray=["home:.cache (appeared: a folder)"])
    problems = " ".join(judge(cell, broken))
    for words in ("duplicates", "wrong bytes", "peaked", "threads left", "CPU-s", "outside the cache"):
        assert words in problems


def test_judge_wants_a_budget_above_the_largest_file_to_work_and_named_errors_elsewhere():
    tiny = {"consumer": "uc", "budget": "tiny", "workers": "fork2", "event": "complete"}
    refused = _result(outcome=_error("BudgetTooSmallError", "CacheFullError", "UCMagicError",
                                     msg="cache_limit=12.3 kB cannot hold 64 files"), limit=12 * KiB,
                      peak=0, event_fired=False)
    assert "must work" in " ".join(judge(tiny, refused))  # 12 KiB holds the largest file (8 KiB)
    unreported = {**tiny, "consumer": "torch"}  # torch's queue is not reported: the window must fit, or a named refusal
    assert judge(unreported, refused) == []
    assert judge(unreported, {**refused, "outcome": _error("CacheFullError", "UCMagicError", msg="no room")})
    assert judge(tiny, _result(limit=12 * KiB, peak=0)) == []  # less than a batch, and it completes
    assert judge(tiny, {**refused, "outcome": _error("FileNotFoundError", "OSError")})
    plain_tiny = {**tiny, "consumer": "plain", "workers": "w0"}
    assert judge(plain_tiny, _result(limit=12 * KiB, peak=0)) == []
    full = {"consumer": "uc", "budget": "none", "workers": "w0", "event": "diskfull"}
    ok = {"kind": "complete", "sum": _summary()}
    assert judge(full, _result(outcome=_error("CacheFullError", "UCMagicError"), limit=None, recovery=ok)) == []
    assert judge(full, _result(outcome=_error("OSError"), limit=None, recovery=ok))
    kill = {"consumer": "torch", "budget": "none", "workers": "fork2", "event": "kill"}
    died = _error("RuntimeError", msg="DataLoader worker (pid(s) 1) exited unexpectedly")
    assert judge(kill, _result(outcome=died, limit=None, killed=[1], recovery=ok)) == []
    assert judge(kill, _result(outcome=died, limit=None, killed=[1], recovery=_error("FetchError", "UCMagicError")))


def test_judge_accepts_either_version_of_a_changed_file_but_never_other_bytes():
    cell = {"consumer": "plain", "budget": "none", "workers": "w0", "event": "change"}
    fresh = {"kind": "complete", "sum": _summary(changed_tag="new")}
    for tag in ("ok", "new"):
        assert judge(cell, _result(limit=None, recovery=fresh,
                                   epochs=[{"partial": False, "sum": _summary(changed_tag=tag)}])) == []
    mixed = [{"partial": False, "sum": _summary(changed_tag="bad")}]
    assert judge(cell, _result(limit=None, recovery=fresh, epochs=mixed))
    stale = {"kind": "complete", "sum": _summary(changed_tag="ok")}
    assert judge(cell, _result(limit=None, recovery=stale))  # a fresh dataset must serve the new version
    assert judge(cell, _result(limit=None, recovery=fresh, outcome=_error("SourceChangedError", "FetchError",
                                                                          "UCMagicError"))) == []
