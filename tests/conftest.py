import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Generated tests judge behaviour, not speed: on a 2-core machine running subprocess-heavy tests beside
# them, an example may take seconds to draw or run. No deadline and no "too slow" health check, for every
# test (a test's own @settings still sets its example count).
settings.register_profile("ucmagic", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ucmagic")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=os.environ.get("UCMAGIC_FULL") == "1",
                     help="the long runs too (also UCMAGIC_FULL=1): tests marked 'full' (whole products, "
                          "the whole trainers table, large fuzz runs, soak, timed checks) and the larger sizes "
                          "tests read from run_size.FULL; .ci/run runs them after the default suite")
    parser.addoption("--matrix", default=os.environ.get("UCMAGIC_MATRIX"), choices=("pairs", "wide", "full"),
                     help="tests/test_matrix.py and test_delivery_matrix.py: the all-pairs sample (default), "
                          "'wide' (what --full runs: every cell without spawned workers, and all pairs of the "
                          "spawn cells among themselves; tests/run_size.wide) or the whole product (also "
                          "UCMAGIC_MATRIX=full: the delivery matrix's 2,020 cells take ~50 min on 2 cores)")


def pytest_configure(config):
    """``--full`` is seen by test modules as ``run_size.FULL`` (read at import, after this hook); it runs the
    matrices' ``wide`` sample unless ``--matrix`` says otherwise. A session started with SIGINT ignored (a
    background job of a shell without job control, ``nohup cmd &`` in a script) takes Python's own handler
    back: the processes the tests start would inherit the ignore and never see the Ctrl-C they test."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if config.getoption("--full"):
        os.environ["UCMAGIC_FULL"] = "1"
    if config.getoption("--matrix") is None:
        config.option.matrix = "wide" if config.getoption("--full") else "pairs"
    if config.getoption("--full") and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # the long runs go first (pytest_collection_modifyitems)


# The long runs' biggest parts under --full (minutes on a quiet 2-core machine, measured roughly). They are
# handed out first, longest first, so the two xdist workers end together: left in xdist's own order (scopes
# with more tests first), the differential, a single test of ~8 minutes, started last and ran alone.
LONG_RUN_MINUTES = {"tests/test_matrix.py": 10, "tests/test_stateful_reference.py": 8,
                    "tests/test_delivery_matrix.py": 7, "tests/test_trainer_table.py": 6,
                    "tests/test_tables_filter_oracle.py": 4}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Tests that share a module-scoped fixture (a matrix's verdicts, a trainer table, a Spark session, a
    JupyterLab, an MLflow store) run on one pytest-xdist worker: an ``xdist_group`` per module (the README's
    command runs ``--dist loadgroup``). Tests marked ``full`` run only with ``--full``."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d.scope in ("module", "class", "package") for ds in defs.values() for d in ds):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    if config.getoption("--full"):
        items.sort(key=lambda item: -LONG_RUN_MINUTES.get(item.nodeid.split("::", 1)[0], 0))  # stable
        return
    skip = pytest.mark.skip(reason="a long run: pytest --full (or UCMAGIC_FULL=1) runs it; .ci/run does")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _private_tmp():
    """The whole session's temporary files (DuckDB spill directories, export staging, notebook and
    kernel temp dirs) go to one directory that is removed at the end: a run leaves no ``ucmagic-*``
    directory in the system temp dir."""
    import multiprocessing.util

    multiprocessing.util.get_temp_dir()  # multiprocessing's own dir stays outside: it removes it at exit
    old_env, old_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    root = tempfile.mkdtemp(prefix="ucmagic-pytest-")
    os.environ["TMPDIR"] = tempfile.tempdir = root
    try:
        yield root
    finally:
        tempfile.tempdir = old_dir
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_temp_leftovers(_private_tmp):
    """A test leaves no ``ucmagic-*`` entry in the temp dir: it works in tmp_path, and what the library
    puts in the temp dir (staging, spill directories) is gone when the call returns."""
    def ours() -> set:
        return {n for n in os.listdir(_private_tmp) if n.startswith("ucmagic-")}

    before = ours()
    yield
    left = ours() - before
    if left:
        pytest.fail(f"the test left {sorted(left)} in the temp dir {_private_tmp}", pytrace=False)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test gets its own cache directory (nothing touches ~/.cache), magics raise real
    exceptions, no live display. Set per test, so the notebooks (run by nbval in the same
    session) see the environment a user has."""
    monkeypatch.setenv("UCMAGIC_CACHE_DIR", str(tmp_path / "ucmagic-cache"))
    monkeypatch.setenv("UCMAGIC_STAGING_DIR", str(tmp_path / "ucmagic-ckpt-staging"))  # not <tmp>/ucmagic-ckpt-*
    monkeypatch.setenv("UCMAGIC_RAISE", os.environ.get("UCMAGIC_RAISE", "1"))
    monkeypatch.setenv("UCMAGIC_PROGRESS", os.environ.get("UCMAGIC_PROGRESS", "off"))
    monkeypatch.setenv("MPLBACKEND", "Agg")


@pytest.fixture(scope="session")
def s3_endpoint():
    """One moto S3 server on loopback for the whole session (its URL); skipped where s3fs or moto are not
    installed. Buckets persist across tests: each test names its own."""
    import socket
    import subprocess
    import sys
    import time

    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("moto server did not start")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """Credentials and the endpoint of :func:`s3_endpoint` in the environment (where s3fs, deltalake and
    torch's FsspecReader read them); returns s3fs storage options for the endpoint."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint,
                 "AWS_ALLOW_HTTP": "true"}.items():
        monkeypatch.setenv(k, v)
    return {"client_kwargs": {"endpoint_url": s3_endpoint}, "key": "testing", "secret": "testing"}


@pytest.fixture
def tree(tmp_path):
    """A nested tree of 120 files of 3000 bytes; returns (root, relative paths)."""
    from ucmagic.testing import make_files

    root = tmp_path / "volume"
    rels = make_files(str(root), 120, 3000, per_dir=25)
    return str(root), rels


@pytest.fixture
def magic_shell(tmp_path, monkeypatch):
    """A real IPython shell with ``%load_ext ucmagic``, a local catalog in tmp, and whatever the test
    binds removed afterwards. Tests choose UCMAGIC_RAISE themselves (UsageError lines or exceptions)."""
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("UCMAGIC_CATALOG_ROOT", str(tmp_path / "catalog"))
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ucmagic")
    before = set(shell.user_ns)
    yield shell
    for name in set(shell.user_ns) - before:
        shell.user_ns.pop(name, None)
    shell.run_line_magic("unload_ext", "ucmagic")
