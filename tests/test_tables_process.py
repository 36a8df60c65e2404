"""Every handle of the tables layer belongs to its process (issue 51 item 4): DataLoader workers forked or
spawned after the parent used ``ds.rows`` and iterated a dataset read their own files (a forked worker sharing
its parent's open files read torn pages: ``OSError: Unexpected end of stream``, ``Corrupt snappy compressed
data``), and a process that stops iterating a filtered ``ParquetDataset`` mid-epoch and exits ends with exit 0
(a decode still running on a read-ahead thread while Arrow's static objects were destroyed ended in
``terminate called without an active exception``, exit 134, or a hang in Arrow's thread pool shutdown).

Default suite: fork and spawn workers, 3 fresh interpreters that exit mid-epoch (on 8ec44d0 such exits ended
with exit 134 or hung in Arrow's thread-pool shutdown in 7 of 24 runs), and 5 forked children of one interpreter
that imported everything once (each iterates part of an epoch and exits normally: a child destroying its
parent's DuckDB database crashed at exit). ``--full``: 20 of each. (A child's normal exit costs about 3 s of
CPU here, its finalization touching the parent's pages, so 20 of them are a long run.)"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from run_size import pick
from ucmagic.tables import ParquetDataset

ROWS = 12_000


def _write(root, rows: int, group: int) -> str:
    """Snappy-compressed files of many row groups (torn reads show as decoding errors)."""
    root.mkdir()
    rng = np.random.default_rng(0)
    for k in range(3):
        ids = np.arange(k * rows // 3, (k + 1) * rows // 3, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": rng.random(len(ids)),
                                 "s": pa.array([f"row-{i}" for i in ids])}), root / f"f{k}.parquet",
                       row_group_size=group, compression="snappy")
    return str(root)


@pytest.fixture
def table(tmp_path):
    return _write(tmp_path / "t", ROWS, 500)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_read_their_own_files_after_the_parent_used_rows_and_the_dataset(table, context):
    ds = ParquetDataset(table, batch_size=1000, filter="id % 3 <> 1")
    want = [i for i in range(ROWS) if i % 3 != 1]
    rows = ds.rows
    assert int(rows[5]["id"]) == want[5] and int(rows[len(rows) - 1]["id"]) == want[-1]  # files open here
    it = iter(ds)
    assert len(next(it)["id"]) == 1000  # a stream of the parent's reading ahead
    loader = torch.utils.data.DataLoader(rows, batch_size=997, num_workers=2, multiprocessing_context=context,
                                         shuffle=True, generator=torch.Generator().manual_seed(0))
    got = sorted(int(v) for b in loader for v in b["id"])
    assert got == want
    del it
    if context == "fork":  # the dataset itself in forked workers, after the parent read rows of it
        plain = ParquetDataset(table, batch_size=1000, columns=["id", "s"])
        plain.rows[100]
        workers = torch.utils.data.DataLoader(plain, batch_size=None, num_workers=2, multiprocessing_context="fork")
        assert sorted(int(v) for b in workers for v in b["id"]) == list(range(ROWS))


def _big(root) -> str:
    """Row groups of 100,000 rows: a decode takes long enough that an exit lands in the middle of one."""
    root.mkdir()
    for k in range(2):
        ids = np.arange(k * 400_000, (k + 1) * 400_000, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": ids * 0.5, "s": pa.array([f"row-{i}" for i in ids])}),
                       root / f"f{k}.parquet", row_group_size=100_000)
    return str(root)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return _big(tmp_path_factory.mktemp("exit") / "t")


# iterate one batch of a dataset that decodes 4 row groups ahead, read one row, and exit
_EXIT = """
from ucmagic.tables import ParquetDataset
ds = ParquetDataset({root!r}, batch_size=4096, filter={where!r}, prefetch=4)
next(iter(ds))
ds.rows[12_345]
print("iterated")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit (a hang at exit): {e.stderr!r}")


@pytest.mark.scaled
def test_a_process_that_stops_iterating_mid_epoch_exits_cleanly(big):
    for k in range(pick(3, 20)):
        got = _run(_EXIT.format(root=big, where="id % 7 = 1" if k % 2 else None))
        assert (got.returncode, got.stdout.strip()) == (0, "iterated"), got.stderr[-2000:]
        assert "terminate called" not in got.stderr


@pytest.mark.scaled
def test_forked_children_that_stop_mid_epoch_exit_with_0(table):
    """One interpreter imports everything; 5 (``--full``: 20) forked children each stop an epoch after its first
    batch and exit normally (atexit handlers, then Arrow's and DuckDB's static objects), all at once; a child that
    has not ended after two minutes counts as hung (-999)."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        from ucmagic.tables import ParquetDataset
        ParquetDataset({root!r}, filter="id < 5")  # warm imports (and a DuckDB of this process)
        pids = []
        for k in range({runs}):
            pid = os.fork()
            if pid == 0:
                ds = ParquetDataset({root!r}, batch_size=256, filter="id % 7 <> " + str(k % 7), prefetch=4)
                next(iter(ds))
                break  # the child leaves the loop and the script: a normal interpreter exit
            pids.append(pid)
        else:
            codes, deadline = {{}}, time.monotonic() + 120
            while len(codes) < len(pids) and time.monotonic() < deadline:
                for pid in pids:
                    if pid not in codes:
                        done, status = os.waitpid(pid, os.WNOHANG)
                        if done:
                            codes[pid] = os.waitstatus_to_exitcode(status)
                time.sleep(0.05)
            for pid in pids:
                if pid not in codes:  # hung at exit
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid] = -999
            print([codes[p] for p in pids])
    """).format(root=table, runs=pick(5, 20))
    got = _run(code)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == str([0] * pick(5, 20)), (got.stdout, got.stderr[-2000:])
    assert "terminate called" not in got.stderr
