"""Child-process runner of the scenario matrix (tests/test_matrix.py, issue 23 item 5).

    python matrix_cell.py SPEC.json      # run SPEC["cells"] in order

For each cell it prints ``START <id>`` (flushed), runs it, then ``RESULT <json>``, and ``DONE`` after
the last one. A cell that overruns its deadline (the whole cell, or the time allowed after its event)
dumps every thread's stack through :mod:`faulthandler` and exits: the parent records the hang with
that dump and starts a fresh child for the remaining cells. This script reports facts (what was
delivered, what was raised, how big the cache directory got, what was left running); the expected
outcome of each cell is judged by tests/test_matrix.py.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
if sys.argv[1:2] == ["--second"] and os.environ.get("TMPDIR"):
    # The second process starts while its child's first cell runs, and Python's first look for the temp
    # directory (importing torch makes it) writes and removes a probe file there: a change to $TMPDIR the
    # cell's check would blame on the cell (it did once). Named here, the directory is not probed.
    tempfile.tempdir = os.environ["TMPDIR"]

import torch.utils.data as tud  # noqa: E402 - after the path: spawn workers import this module too

GRACE_S = 60.0  # after a loop, threads and worker processes it started end within this (a wait, not a pause:
# it ends as soon as they are gone; a loaded machine may take seconds to reap workers)
IDLE_S = 0.3  # window in which the process's CPU time is measured once the loop is over


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:20]


def header(data: bytes) -> str:
    """The source-relative path a test file starts with (tests/test_matrix.py writes it)."""
    return data.split(b"\n", 1)[0].decode("utf-8", "replace")


def tree_bytes(root: str) -> int:
    """Apparent size (st_size) of every regular file under ``root``."""
    total = 0
    try:
        with os.scandir(root) as it:
            entries = list(it)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for de in entries:
        with contextlib.suppress(FileNotFoundError):
            if de.is_dir(follow_symlinks=False):
                total += tree_bytes(de.path)
            elif de.is_file(follow_symlinks=False):
                total += de.stat(follow_symlinks=False).st_size
    return total


def tree_state(root: str, skip: tuple[str, ...] = ()) -> dict[str, tuple[str, int, int]]:
    """``{relative path: (kind, size, mtime_ns)}`` of every entry under ``root`` except the ``skip``
    subtrees; a folder is ``("folder", 0, 0)`` (what it holds is listed on its own)."""
    out: dict[str, tuple[str, int, int]] = {}
    if not os.path.isdir(root):
        return out
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if os.path.join(d, x) not in skip]
        for f in dirs + files:
            p = os.path.join(d, f)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(p)
                out[os.path.relpath(p, root)] = ("file", st.st_size, st.st_mtime_ns) if f in files else ("folder", 0, 0)
    return out


def tree_change(before: tuple[str, int, int] | None, after: tuple[str, int, int] | None) -> str:
    """How one entry changed between two :func:`tree_state` looks, in words."""
    def what(state: tuple[str, int, int]) -> str:
        return f"a file of {state[1]} bytes" if state[0] == "file" else "a folder"
    if before is None:
        assert after is not None, "an entry in neither look"
        return f"appeared: {what(after)}"
    if after is None:
        return f"vanished: was {what(before)}"
    return f"rewritten: {what(before)}, now {what(after)}"


class Sampler:
    """Peak size of a cache directory, sampled every ~10 ms on a thread while a cell runs."""

    def __init__(self, root: str) -> None:
        self.root, self.peak, self.samples = root, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="matrix-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, tree_bytes(self.root))
            self.samples += 1

    def __enter__(self) -> "Sampler":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, tree_bytes(self.root))


class PathsWrapper(tud.IterableDataset):
    """The seed's pattern (seeds/003, "Charger des données non structurées avec UCVolumeDataset"): a
    user IterableDataset that consumes UCVolumeDataset's path stream and "decodes" each file where
    it gets it (here: its header and content hash instead of a PIL image)."""

    def __init__(self, path_dataset: Any) -> None:
        self._path_dataset = path_dataset

    def __iter__(self) -> Iterator[dict[str, str]]:
        for local_path in self._path_dataset:
            with open(local_path, "rb") as f:
                data = f.read()
            yield {"path": local_path, "rel": header(data), "sha": digest(data)}


# ---------------------------------------------------------------- consumers

def make_loader(consumer: str, ds: Any, workers: str, batch: int) -> Any:
    """What a user iterates: the dataset itself, or one of four loader set-ups over it."""
    if consumer == "plain":
        return ds
    import ucmagic

    kw: dict[str, Any] = {"batch_size": batch, "num_workers": 0 if workers == "w0" else 2}
    if workers == "fork2":
        kw.update(multiprocessing_context="fork", persistent_workers=True)
    elif workers == "spawn2":
        kw.update(multiprocessing_context="spawn")  # persistent_workers: the loader's own default
    inner = PathsWrapper(ds) if consumer.startswith("wrap") else ds
    cls = ucmagic.DataLoader if consumer in ("uc", "wrap_uc") else tud.DataLoader
    return cls(inner, **kw)


def records(consumer: str, batch: Any) -> list[tuple[str, str, str]]:
    """``(path, rel from the content's header, content hash)`` of each item of what the loop got."""
    if consumer.startswith("wrap"):
        return list(zip(batch["path"], batch["rel"], batch["sha"]))
    paths = [batch] if consumer == "plain" else list(batch)
    out = []
    for p in paths:  # the loop reads each path it is handed, as a training loop does
        with open(p, "rb") as f:
            data = f.read()
        out.append((p, header(data), digest(data)))
    return out


class Probe:
    """Tells the event thread whether the main thread is inside the loader's ``next()``."""

    def __init__(self) -> None:
        self.in_next = False


def epoch(loader: Any, consumer: str, *, stop_at: int | None = None, trigger_at: int | None = None,
          trigger: Callable[[], None] | None = None, probe: Probe | None = None,
          got: list[tuple[str, str, str]] | None = None) -> list[tuple[str, str, str]]:
    """One pass of a training loop, appending what it gets to ``got``; ``trigger()`` once
    ``trigger_at`` items arrived; a ``break`` at ``stop_at``."""
    got = [] if got is None else got
    probe = probe or Probe()
    it = iter(loader)
    fired = False
    while True:
        probe.in_next = True
        try:
            batch = next(it)
        except StopIteration:
            break
        finally:
            probe.in_next = False
        got.extend(records(consumer, batch))
        if trigger is not None and not fired and trigger_at is not None and len(got) >= trigger_at:
            fired = True
            trigger()
        if stop_at is not None and len(got) >= stop_at:
            break  # the iterator is dropped as a `for ... break` drops it
    del it
    return got


def summarize(items: list[tuple[str, str, str]], source: dict[str, str], new: dict[str, str],
              changed: str | None) -> dict[str, Any]:
    """Delivery facts: counts, duplicates, wrong bytes, paths that lost the source's name."""
    counts: dict[str, int] = {}
    bad, path_bad = [], []
    changed_tag = None
    for path, rel, sha in items:
        counts[rel] = counts.get(rel, 0) + 1
        tag = "ok" if source.get(rel) == sha else "new" if new.get(rel) == sha else "bad"
        if rel == changed:
            changed_tag = tag
        elif tag != "ok":
            bad.append(rel)
        if not path.replace(os.sep, "/").endswith("/" + rel):
            path_bad.append(path)
    return {"n": len(items), "distinct": len(counts), "dups": sorted(r for r, c in counts.items() if c > 1)[:5],
            "missing": len(set(source) - set(counts)), "unknown": sorted(set(counts) - set(source))[:5],
            "bad": bad[:5], "bad_n": len(bad), "changed_tag": changed_tag,
            "path_bad_n": len(path_bad), "path_bad": path_bad[:2]}


def release(exc: BaseException) -> None:
    """Drop what the frames of ``exc``'s traceback hold (the loop's iterator among them), so the
    iterator goes when the loop lets go of it, as in a script that handles the error.

    torch's ``ExceptionWrapper.reraise`` keeps the exception it raises in a local: exception,
    traceback and the loader iterator's frames form a cycle that only the garbage collector frees,
    and it finalizes the iterator's index queues (stopping their feeder threads) before the
    iterator's ``__del__`` sends its workers the exit signal, so each worker is joined for its
    5 s timeout and terminated (torch 2.x, any dataset that raises in a worker; 10 s a cell)."""
    traceback.clear_frames(exc.__traceback__)


def error_facts(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
            "msg": str(exc)[-4000:], "tb": "".join(traceback.format_exception(exc))[-2500:]}


def source_hashes(src: str) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(src):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                data = fh.read()
            out[os.path.relpath(p, src).replace(os.sep, "/")] = digest(data)
    return out


# ---------------------------------------------------------------- what a cell leaves behind

POOL_LOOPS = ("_work", "_worker")  # a pool thread's own loop (ucmagic._util.DaemonPool, concurrent.futures)


def _ucmagic_stack(th: threading.Thread) -> str | None:
    """The stack of ``th`` when it is running ucmagic code (None: not in ucmagic, or an idle pool
    thread: its only ucmagic frame, if any, is the pool's own loop waiting for the next call)."""
    frame = sys._current_frames().get(th.ident or -1)
    stack = traceback.extract_stack(frame) if frame is not None else []
    ours = [fr for fr in stack if os.sep + "ucmagic" + os.sep in fr.filename]
    if not ours or (len(ours) == 1 and ours[0].name in POOL_LOOPS):
        return None
    return "".join(traceback.format_list(stack[-6:]))


def leftovers(baseline: set[int], exclude_pids: set[int]) -> dict[str, Any]:
    """Threads and processes the cell left (after ``GRACE_S``) and CPU burnt while idle.

    Idle workers of ucmagic's process-wide I/O pools (``fetch.shared_pool``: threads named
    ``ucmagic-*`` waiting in the pool's loop for work, kept for the next epoch) are not leftovers;
    such a thread still running a call after the grace period is one (it spins, waits for a loop
    that is gone, or blocks interpreter exit), daemon or not.
    """
    import psutil

    def threads() -> list[dict[str, Any]]:
        out = []
        for th in threading.enumerate():
            if th.ident in baseline or th is threading.current_thread() or not th.is_alive():
                continue
            busy = _ucmagic_stack(th)
            if th.name.startswith("ucmagic-") and busy is None:
                continue  # an idle pool worker (documented above)
            out.append({"name": th.name, "daemon": th.daemon, "stack": busy or ""})
        return out

    def procs() -> list[dict[str, Any]]:
        out = []
        for c in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                cmd = " ".join(c.cmdline())
                if c.pid in exclude_pids or "resource_tracker" in cmd or c.status() == psutil.STATUS_ZOMBIE:
                    continue
                out.append({"pid": c.pid, "cmd": cmd[-120:]})
        return out

    deadline = time.monotonic() + GRACE_S
    while True:
        gc.collect()
        th, pr = threads(), procs()
        if (not th and not pr) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    c0 = time.process_time()
    time.sleep(IDLE_S)
    return {"threads": th, "procs": pr, "idle_cpu": time.process_time() - c0}


def worker_pids(exclude: set[int]) -> list[int]:
    """DataLoader worker processes of this process (not the resource tracker, not a second process)."""
    import psutil

    out = []
    for c in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if c.pid not in exclude and "resource_tracker" not in " ".join(c.cmdline()):
                out.append(c.pid)
    return out


# ---------------------------------------------------------------- one cell

def mount_tmpfs(path: str, size: int) -> str | None:
    """Mount a tmpfs of ``size`` bytes at ``path``; the reason when it cannot be mounted."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True,
                       text=True, check=False)
    return None if r.returncode == 0 else f"cannot mount a tmpfs: {r.stderr.strip()}"


def fill_disk(root: str, leave: int) -> int:
    """Write a ballast file on ``root``'s filesystem so that about ``leave`` bytes stay free."""
    st = os.statvfs(root)
    size = max(0, st.f_bavail * st.f_frsize - leave)
    fd = os.open(os.path.join(root, "ballast"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return size


def rewrite(path: str, rel: str) -> str:
    """A new version of a source file (other size, later mtime); returns its content hash."""
    import random

    rng = random.Random(rel)
    data = (rel + "\n").encode() + b"VERSION2\n" + rng.randbytes(os.path.getsize(path) + 1024)
    with open(path + ".new", "wb") as f:
        f.write(data)
    st = os.stat(path)
    os.replace(path + ".new", path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    return digest(data)


def run_cell(cell: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    from ucmagic import UCVolumeDataset

    cid, consumer, workers, event = cell["id"], cell["consumer"], cell["workers"], cell["event"]
    limit, batch = cell["limit"], spec["batch"]
    work = os.path.join(spec["workdir"], cid)
    os.makedirs(work)
    src = spec["src"]
    res: dict[str, Any] = {"id": cid, "limit": limit}
    t_cell = time.monotonic()
    phases: dict[str, float] = {}
    t_mark = [t_cell]

    def mark(name: str) -> None:  # seconds each phase of the cell took (the harness's own cost)
        now = time.monotonic()
        phases[name] = round(now - t_mark[0], 3)
        t_mark[0] = now
    if event == "change":  # this cell rewrites a source file: its own copy
        src = os.path.join(work, "src")
        shutil.copytree(spec["src"], src)
    source = source_hashes(src)
    new: dict[str, str] = {}
    changed: list[str] = []
    cache = os.path.join(work, "cache")
    mnt = None
    if event == "diskfull":
        mnt = os.path.join(work, "mnt")
        why = mount_tmpfs(mnt, spec["tmpfs_bytes"])
        if why:
            shutil.rmtree(work, ignore_errors=True)
            return {"id": cid, "skip": why}
        cache = os.path.join(mnt, "cache")
    watched = {"src": (src, ()), "work": (work, tuple(x for x in (cache, mnt, src) if x)),
               "home": (os.environ["HOME"], ()), "tmpdir": (os.environ["TMPDIR"], ())}
    before = {k: tree_state(root, skip) for k, (root, skip) in watched.items()}
    baseline = {t.ident for t in threading.enumerate() if t.ident is not None}
    second = spec.get("_second")
    started_second = False
    second_out = os.path.join(work, "second.json")
    exclude: set[int] = {second.pid} if second is not None else set()
    probe = Probe()
    t_event: list[float] = []
    streams = 1 if workers == "w0" else 2

    def fire() -> None:
        t_event.append(time.monotonic())
        faulthandler.dump_traceback_later(spec["event_deadline"], exit=True)  # a hang after the event
        print("EVENT", cid, flush=True)
        if event == "sigint":
            def send() -> None:  # lands while the main thread waits inside the loader (or right after)
                end = time.monotonic() + 2
                while not probe.in_next and time.monotonic() < end:
                    time.sleep(0.0005)
                os.kill(os.getpid(), signal.SIGINT)

            threading.Thread(target=send, name="matrix-sigint", daemon=True).start()
        elif event == "kill":
            pids = worker_pids(exclude)
            res["killed"] = pids[:1]
            if pids:
                os.kill(pids[0], signal.SIGKILL)
        elif event == "change":
            done = {r for _, r, _ in got_so_far}
            rel = max(r for r in source if r not in done)
            new[rel] = rewrite(os.path.join(src, rel), rel)
            changed.append(rel)
        elif event == "diskfull":
            res["ballast"] = fill_disk(mnt or "", spec["disk_leave"])

    got_so_far: list[tuple[str, str, str]] = []
    epochs: list[dict[str, Any]] = []
    faulthandler.dump_traceback_later(cell["timeout"], exit=True)
    ds = loader = None
    mark("setup")
    with Sampler(cache) as sampler:  # not the tmpfs: its ballast is not the cache's
        try:
            ds = UCVolumeDataset(src, cache_dir=cache, cache_limit=limit)
            res["meta0"] = tree_bytes(cache)
            if event == "second":
                second.start(src, cache, second_out, cell["timeout"])
                started_second = True
            loader = make_loader(consumer, ds, workers, batch)
            k = spec["trigger_at"]
            stop = k if event == "break" else None
            trig = None if event in ("complete", "break", "second") else fire
            epochs.append({"partial": stop is not None, "_items": got_so_far})
            epoch(loader, consumer, stop_at=stop, trigger_at=k, trigger=trig, probe=probe, got=got_so_far)
            if event == "break":
                epochs.append({"partial": False, "_items": epoch(loader, consumer)})
            res["outcome"] = {"kind": "complete"}
        except KeyboardInterrupt as exc:
            res["outcome"] = {"kind": "interrupt"}
            release(exc)
        except BaseException as exc:  # noqa: BLE001 - every outcome is a fact for the judge
            res["outcome"] = {"kind": "error", **error_facts(exc)}
            release(exc)
        mark("loop")
        res["event_fired"] = bool(t_event)
        if t_event:
            res["after_event_s"] = round(time.monotonic() - t_event[0], 3)
        faulthandler.dump_traceback_later(cell["timeout"], exit=True)
        if started_second:
            res["second"] = second.wait(second_out, cell["timeout"])
            if res["second"]["outcome"]["kind"] == "hang":
                os.kill(second.pid, signal.SIGKILL)  # stuck: the next cell that needs one starts another
            if "items" in res["second"]:
                res["second"]["sum"] = summarize(res["second"].pop("items"), source, new, None)
    res["peak"] = sampler.peak
    res["samples"] = sampler.samples
    res["streams"] = streams
    res["changed"] = changed[0] if changed else None
    for e in epochs:
        e["sum"] = summarize(e.pop("_items"), source, new, res["changed"])
    res["epochs"] = epochs
    del loader, ds
    gc.collect()  # the cell's dataset is gone before the fresh one below is made
    if event in ("sigint", "kill", "change", "diskfull"):  # a fresh dataset on the same cache: correct bytes
        if mnt:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(mnt, "ballast"))
        try:
            items = epoch(UCVolumeDataset(src, cache_dir=cache), "plain")
            res["recovery"] = {"kind": "complete", "sum": summarize(items, source, new, res["changed"])}
        except BaseException as exc:  # noqa: BLE001
            res["recovery"] = {"kind": "error", **error_facts(exc)}
    mark("second+recovery")
    res["left"] = leftovers(baseline, exclude)
    mark("leftovers")
    after = {k: tree_state(root, skip) for k, (root, skip) in watched.items()}
    stray = []
    for k in watched:
        for rel in sorted(set(after[k]) | set(before[k])):
            if k == "src" and rel in changed:
                continue
            if after[k].get(rel) != before[k].get(rel) and not (k == "work" and rel in ("cache", "mnt", "src",
                                                                                    "second.json")):
                stray.append(f"{k}:{rel} ({tree_change(before[k].get(rel), after[k].get(rel))})")
    res["stray"] = stray[:10]
    mark("after")
    res["phases"] = phases
    res["secs"] = round(time.monotonic() - t_cell, 2)
    faulthandler.cancel_dump_traceback_later()
    if mnt:
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
    shutil.rmtree(work, ignore_errors=True)
    return res


class SecondProcess:
    """The second process of the ``second`` cells: started once per child, before its first cell, so
    its interpreter start-up overlaps the cells before; each job is a fresh plain loop (its own
    UCVolumeDataset, no budget) over a cell's source and cache, its facts written to a file."""

    def __init__(self, log: str) -> None:
        self._log = open(log, "a")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--second"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=self._log, text=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, src: str, cache: str, out: str, deadline: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"src": src, "cache": cache, "out": out, "deadline": deadline}) + "\n")
        self.proc.stdin.flush()

    def wait(self, out: str, deadline: float) -> dict[str, Any]:
        end = time.monotonic() + deadline
        while not os.path.exists(out):
            if self.proc.poll() is not None:
                return {"outcome": {"kind": "crash", "msg": f"the second process died (rc {self.proc.returncode})"}}
            if time.monotonic() > end:
                return {"outcome": {"kind": "hang", "msg": f"the second process did not finish in {deadline:g} s"}}
            time.sleep(0.02)
        with open(out) as f:
            return json.load(f)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def second_server() -> None:
    """``--second``: run the jobs of :class:`SecondProcess` read from stdin, one per line."""
    from ucmagic import UCVolumeDataset

    for line in sys.stdin:
        job = json.loads(line)
        faulthandler.dump_traceback_later(job["deadline"], exit=True)
        res: dict[str, Any] = {}
        try:
            res["items"] = epoch(UCVolumeDataset(job["src"], cache_dir=job["cache"]), "plain")
            res["outcome"] = {"kind": "complete"}
        except BaseException as exc:  # noqa: BLE001
            res["outcome"] = {"kind": "error", **error_facts(exc)}
        faulthandler.cancel_dump_traceback_later()
        with open(job["out"] + ".part", "w") as f:
            json.dump(res, f)
        os.replace(job["out"] + ".part", job["out"])


def main() -> None:
    if sys.argv[1] == "--second":
        second_server()
        return
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    import multiprocessing.util

    multiprocessing.util.get_temp_dir()  # its pymp-* dir exists before any cell (removed at exit)
    import ucmagic.files.dataset  # noqa: F401 - imported before the first cell's thread baseline

    gc.freeze()  # what the imports made is never garbage: each cell's gc.collect() scans only its own objects

    def second_ready() -> None:
        if spec.get("_second") is None or spec["_second"].proc.poll() is not None:
            spec["_second"] = SecondProcess(os.path.join(spec["workdir"], "second.log"))

    if any(c["event"] == "second" for c in spec["cells"]):
        second_ready()
    for cell in spec["cells"]:
        if cell["event"] == "second":
            second_ready()
        print("START", cell["id"], flush=True)
        res = run_cell(cell, spec)
        print("RESULT", json.dumps(res), flush=True)
    if spec.get("_second") is not None:
        spec["_second"].close()
    print("DONE", flush=True)
    faulthandler.dump_traceback_later(10, exit=True)  # a hang at interpreter exit: stacks, and out


if __name__ == "__main__":
    main()
