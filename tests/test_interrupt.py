"""Issue 23 item 2: Ctrl-C returns control in every state of an epoch, a loop that breaks off or
fails leaves no thread waiting on, and the interpreter always exits (a read stuck in a hung mount is
abandoned, not joined). Each case runs in a subprocess that gets SIGINT; a hang fails the test at
the subprocess timeout instead of stalling the suite (no wall-clock asserts beyond that)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from run_size import FULL
from waits import PATIENCE, wait_until
from ucmagic import UCVolumeDataset
from ucmagic.testing import make_files

EXIT_S = 120  # generous on two loaded cores: a hang, not slowness, is what fails


def _run_until_ready(script: str, tmp_path, *, signal_after: float = 0.5) -> subprocess.CompletedProcess:
    """Run ``script`` (it prints READY when it reached the state to interrupt), SIGINT it then, and
    return its result; fails if it has not exited EXIT_S seconds later."""
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=str(tmp_path))
    try:
        assert p.stdout is not None
        line = p.stdout.readline()  # blocks until READY (or the child died)
        assert line.strip() == "READY", (line, p.stderr.read() if p.poll() is not None else "")
        time.sleep(signal_after)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=EXIT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"the process did not exit within {EXIT_S} s of SIGINT:\n{err[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _tree(tmp_path, n=40, size=4096, extra=None):
    root = tmp_path / "vol"
    make_files(str(root), n, size, depth=0)
    for name, data in (extra or {}).items():
        (root / name).write_bytes(data)
    return str(root)


CASES = {
    # the loop waits on a fill future (every open takes 300 ms)
    "waiting on a fill": ("""
        ds = UCVolumeDataset("slow://" + ROOT, cache_dir=CACHE, storage_options={"open_ms": 300, "mbps": 0,
                             "list_ms": 0}, prefetch=2)
        it = iter(ds)
        next(it)
        print("READY")
        for p in it:
            pass
    """, {}),
    # the first file's open never returns (a hung mount): its fetch thread is abandoned at exit
    "a read stuck in a hung mount": ("""
        ds = UCVolumeDataset("slow://" + ROOT, cache_dir=CACHE, storage_options={"open_ms": 0, "mbps": 0,
                             "list_ms": 0, "slow_files": {"a_hang": 600000}})
        print("READY")
        for p in ds:
            pass
    """, {"a_hang.bin": b"x" * 100}),
    # a slow loop under a tight budget: read-ahead fills wait for room while the body runs
    "waiting for room": ("""
        import time
        ds = UCVolumeDataset(ROOT, cache_dir=CACHE, cache_limit=64 * 4096 * 3)
        for i, p in enumerate(ds):
            if i == 2:
                print("READY")
            time.sleep(0.2)
    """, {}),
    # listing a volume whose directory listing never returns
    "listing": ("""
        print("READY")
        ds = UCVolumeDataset("slow://" + ROOT, cache_dir=CACHE, storage_options={"list_ms": 600000})
    """, {}),
}


@pytest.mark.timeout(EXIT_S * 3)
@pytest.mark.parametrize("state", list(CASES))
def test_ctrl_c_returns_control_and_the_interpreter_exits(tmp_path, state):
    body, extra = CASES[state]
    root = _tree(tmp_path, extra=extra)
    script = (f"import sys\nfrom ucmagic import UCVolumeDataset\nROOT = {root!r}\nCACHE = {str(tmp_path / 'c')!r}\n"
              + textwrap.dedent(body))
    res = _run_until_ready(script, tmp_path)
    assert res.returncode != 0 and "KeyboardInterrupt" in res.stderr, res.stderr[-3000:]
    assert "Exception ignored" not in res.stderr, res.stderr[-3000:]


def _engine_threads_busy() -> list[str]:
    """Names of ucmagic threads running ucmagic code (an idle pool thread waits in the queue)."""
    busy = []
    frames = sys._current_frames()
    for th in threading.enumerate():
        f = frames.get(th.ident) if th.name.startswith("ucmagic-") else None
        while f is not None:
            if f.f_code.co_name in ("_reserve_budget", "_ensure_disk", "fill"):
                busy.append(th.name)
                break
            f = f.f_back
    return busy


def _waiting_for_room() -> bool:
    """Whether a ucmagic thread waits in the budget for room."""
    frames = sys._current_frames()
    for th in threading.enumerate():
        f = frames.get(th.ident) if th.name.startswith("ucmagic-") else None
        while f is not None:
            if f.f_code.co_name == "_reserve_budget":
                return True
            f = f.f_back
    return False


def _quiet_within(seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        busy = _engine_threads_busy()
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.1)


def _room_or_rest() -> bool:
    """Wait until a fill waits in the budget for room (True) or no fill has run for 0.5 s (False: the read-ahead
    went as far as it will without one; its width and items per call follow its timing)."""
    seen: dict[str, float | bool | None] = {"rest_since": None, "room": False}

    def settled() -> bool:
        if _waiting_for_room():
            seen["room"] = True
            return True
        since = seen["rest_since"]
        if _engine_threads_busy():
            seen["rest_since"] = None
        elif since is None:
            seen["rest_since"] = time.monotonic()
        else:
            return time.monotonic() - float(since) > 0.5
        return False

    wait_until(settled, "a read-ahead fill waiting for room, or the read-ahead at rest")
    return bool(seen["room"])


@pytest.mark.parametrize("how", ["break", "exception"])
def test_leaving_a_budgeted_loop_leaves_no_fill_waiting_for_room(tmp_path, how, monkeypatch):
    """The loop is left while a fill waits for room. The read-ahead starts at its full width (128 calls, not
    the 32 it starts with on a volume it has not timed), so its fills outgrow the budget before the loop's
    tenth item in nearly every try; where the read-ahead came to rest without one waiting (its width and items
    per call follow its timing: 1-2% of tries beside three busy processes, 1-4% at the default start width),
    the try is made again on a fresh cache."""
    from ucmagic.files import fetch

    monkeypatch.setattr(fetch, "START_WINDOW", 128)
    root = _tree(tmp_path, n=400, size=4096)
    reached = False
    for attempt in range(5):
        ds = UCVolumeDataset(root, cache_dir=str(tmp_path / f"c{attempt}"), cache_limit=64 * 4096 * 3)

        def consume():
            nonlocal reached
            for i, _ in enumerate(ds):
                if i == 10:
                    reached = _room_or_rest()
                    if reached and how == "exception":
                        raise RuntimeError("the training step failed")
                    break

        try:
            consume()
        except RuntimeError:
            assert how == "exception" and reached
        else:
            assert how == "break" or not reached
        assert _quiet_within(PATIENCE) == []
        if reached:
            break
    else:
        pytest.fail("in no try did a read-ahead fill wait for room when the loop was left")
    assert len(list(ds)) == 400  # and the next epoch runs


TMPFS_SCRIPT = """
import sys
from ucmagic import UCVolumeDataset, CacheFullError
ds = UCVolumeDataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=sys.argv[3], on_error=sys.argv[4])
n = 0
try:
    for p in ds:
        n += 1
except CacheFullError as e:
    print(type(e).__name__, n, e)
    sys.exit(3)
print("completed", n)
"""


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 50 MB tmpfs for the cache (root only; skipped elsewhere), unmounted afterwards."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=50m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}): needs root")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.timeout(EXIT_S * 4)
@pytest.mark.parametrize("limit,on_error", [("80MB", "raise"), ("80MB", "skip"), ("30MB", "raise")])
def test_a_full_cache_disk_fails_once_with_a_named_error_and_the_interpreter_exits(tmp_path, small_tmpfs,
                                                                                    limit, on_error):
    root = tmp_path / "vol"
    # 200 MiB through a 50 MB disk. At 80 MB the 64-file window of a plain loop (64 MiB of 1 MiB files)
    # fits the budget, never the disk; at 30 MB the window of 512 KiB files (33.6 MB) fits neither
    n, size = (400, 512 * 1024) if limit == "30MB" else (200, 1 << 20)
    make_files(str(root), n, size, depth=0)
    script = tmp_path / "full.py"
    script.write_text(TMPFS_SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(root), os.path.join(small_tmpfs, "c"), limit, on_error],
                         capture_output=True, text=True, timeout=EXIT_S * 3)
    assert res.returncode == 3, (res.stdout, res.stderr[-3000:])
    name, n, msg = res.stdout.split(" ", 2)
    if limit == "30MB":  # the 64-file window of a plain loop (33.6 MB) cannot fit: at the first item
        assert name == "BudgetTooSmallError" and n == "0" and "at least 33.6 MB" in msg, res.stdout
    else:  # over what the disk holds: one error naming the budget and the free space, even with skip
        assert name == "CacheFullFetchError" and "cache_limit=80.0 MB" in msg and "free" in msg, res.stdout
        assert "skipped" not in res.stderr


LEAVE_LOADER = """
    import multiprocessing.process, sys, time
    from ucmagic import DataLoader, UCVolumeDataset

    join = multiprocessing.process.BaseProcess.join

    def logged_join(self, timeout=None):  # torch joins each worker with a timeout, then terminates it
        join(self, timeout)
        if timeout is not None and self.is_alive():
            print("JOIN TIMED OUT", self.name, file=sys.stderr, flush=True)

    multiprocessing.process.BaseProcess.join = logged_join
    ds = UCVolumeDataset(ROOT, cache_dir=CACHE, cache_limit=10 * 16384)  # 5 files per worker stream
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list)  # persistent workers
    for i, batch in enumerate(loader):
        if i == 1:
            time.sleep(1.0)  # the workers fill the budget: their next fills wait for room
            print("READY", flush=True)
            if MODE == "break":
                break
            time.sleep(60)  # Ctrl-C lands in the loop's body
    print("LEFT", time.time(), flush=True)
"""


@pytest.mark.scaled
@pytest.mark.timeout(EXIT_S * 3)
@pytest.mark.parametrize("mode", ["break", "sigint"])
def test_a_loader_left_under_a_full_budget_exits_without_waiting_out_torchs_join_timeout(tmp_path, mode):
    """Persistent workers whose fills wait for room when the loop stops consuming (a break, Ctrl-C
    in its body) used to keep waiting: at exit torch joined each of them for its full timeout (5 s a
    worker; 1 exit in 4 took 10.5 s under Ctrl-C). The loop leaving retires its streams, so they go on."""
    from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL as JOIN_S

    root = _tree(tmp_path, n=80, size=16384)
    script = (f"ROOT = {root!r}\nCACHE = {str(tmp_path / 'c')!r}\nMODE = {mode!r}\n" + textwrap.dedent(LEAVE_LOADER))
    path = tmp_path / "child.py"
    path.write_text(script)
    p = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=str(tmp_path))
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "READY"
    if mode == "sigint":
        p.send_signal(signal.SIGINT)
        left = time.time()
    else:  # read here: communicate() does not see what this file object has buffered
        left = float(p.stdout.readline().split()[-1])
    try:
        _, err = p.communicate(timeout=EXIT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"the process did not exit within {EXIT_S} s: {p.communicate()[1][-3000:]}")
    if mode == "break":
        assert p.returncode == 0, err[-3000:]
    else:
        assert p.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
    assert "JOIN TIMED OUT" not in err, f"torch waited out a worker's join timeout ({JOIN_S:g} s):\n{err[-3000:]}"
    if FULL:  # timed on a quiet machine only
        took = time.time() - left
        assert took < JOIN_S, f"exit took {took:.1f} s: torch waited out a worker's join timeout ({JOIN_S:g} s)"


HUNG = """
    import os, sys, threading, time
    import ucmagic
    from ucmagic.testing import SlowFileSystem

    opened = SlowFileSystem._open

    def logged_open(self, path, mode="rb", **kw):  # every open the volume is sent, from any process
        with open(LOG, "a") as f:
            f.write(f"open {os.getpid()} {time.time()!r}\\n")
        return opened(self, path, mode=mode, **kw)

    SlowFileSystem._open = logged_open

    def ready():  # once opens hang in the mount
        while not os.path.exists(LOG):
            time.sleep(0.01)
        print("READY", flush=True)

    ds = ucmagic.UCVolumeDataset("slow://" + ROOT, cache_dir=CACHE,
                                 storage_options={"open_ms": 600000, "mbps": 0, "list_ms": 0})
    threading.Thread(target=ready, daemon=True).start()
    try:
        if WORKERS is None:
            for p in ds:
                pass
        else:
            for batch in ucmagic.DataLoader(ds, batch_size=4, num_workers=WORKERS, collate_fn=list):
                pass
    except KeyboardInterrupt:
        with open(LOG, "a") as f:
            f.write(f"interrupted {os.getpid()} {time.time()!r}\\n")
        time.sleep(1.0)  # an open that would still start (a retry, a queued call, a worker) starts now
        raise
"""


@pytest.mark.scaled
@pytest.mark.timeout(EXIT_S * 3)
@pytest.mark.parametrize("workers,target", [(None, "process"), (2, "process"), (2, "group")])
def test_ctrl_c_on_a_hung_mount_starts_no_open_and_exits_without_waiting_for_the_hung_ones(tmp_path, workers, target):
    """Every open hangs for 10 minutes (a hung mount): SIGINT raises KeyboardInterrupt in the loop, no
    open starts after it in any process, and the process exits long before the hung opens would
    end: the I/O threads stuck in them are abandoned, and DataLoader workers waiting on them go
    (torch waited out its 5 s join timeout per worker). ``group``: a terminal's Ctrl-C, which the
    workers get too; ``process``: the main process alone (a notebook's interrupt)."""
    from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL as JOIN_S

    root = _tree(tmp_path, n=200, size=512)
    log = tmp_path / "opens.log"
    script = (f"ROOT = {root!r}\nCACHE = {str(tmp_path / 'c')!r}\nLOG = {str(log)!r}\nWORKERS = {workers!r}\n"
              + textwrap.dedent(HUNG))
    path = tmp_path / "child.py"
    path.write_text(script)
    p = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=str(tmp_path), start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY", p.communicate(timeout=EXIT_S)[1]
        time.sleep(0.5)  # the read-ahead's opens are all in flight
        sent = time.time()
        if target == "group":
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=EXIT_S)  # the hung opens would end 600 s from now
        exited = time.time()
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"the process did not exit within {EXIT_S} s of SIGINT: {p.communicate()[1][-3000:]}")
    assert p.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
    lines = [line.split() for line in log.read_text().splitlines()]
    interrupted = [float(t) for kind, _, t in lines if kind == "interrupted"]
    opens = [float(t) for kind, _, t in lines if kind == "open"]
    assert len(interrupted) == 1 and opens, lines
    late = [t - interrupted[0] for t in opens if t > interrupted[0]]
    assert late == [], f"{len(late)} open(s) started after the KeyboardInterrupt ({len(opens)} in all)"
    if workers and FULL:  # torch's join timeout, waited out for each worker still waiting on a hung open
        # (timed on a quiet machine only: the default suite's bound is EXIT_S, far below the hung opens' 600 s)
        assert exited - sent < workers * JOIN_S, f"exit took {exited - sent:.1f} s after SIGINT"
