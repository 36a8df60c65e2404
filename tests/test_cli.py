"""python -m ucmagic: help for every command, real runs, and exit codes (0 ok, 1 failure, 2 usage)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ucmagic.checkpoints.format import format_checkpoints
from ucmagic.testing import make_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("UCMAGIC_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "ucmagic", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("cmd", [[], ["demo"], ["load"], ["stage"], ["export"], ["ckpt"], ["ckpt", "list"], ["bench"]])
def test_help_for_every_command(cmd):
    r = cli(*cmd, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: python -m ucmagic" in r.stdout


def test_no_command_prints_help_and_exits_2():
    r = cli()
    assert r.returncode == 2 and "COMMAND" in r.stdout
    assert cli("frobnicate").returncode == 2


def test_stage_copies_and_reports(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    make_files(str(src), 30, 1000)
    r = cli("stage", str(src), str(dest), "-j", "8")
    assert r.returncode == 0, r.stderr
    assert "staged 30 files" in r.stdout
    assert "stage:" in r.stderr  # progress on stderr
    assert sum(len(f) for _, _, f in os.walk(dest)) == 30
    r = cli("stage", str(src), str(dest), "--no-progress")
    assert r.returncode == 0 and "30 unchanged skipped" in r.stdout and r.stderr == ""


def test_stage_exit_code_1_when_a_file_fails(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    rels = make_files(str(src), 5, 100)
    os.makedirs(dest / rels[0])  # a folder where a file must land: that file cannot be staged
    r = cli("stage", str(src), str(dest), "--no-progress", "--retries", "0")
    assert r.returncode == 1
    assert "1 failed" in r.stdout and rels[0] in r.stdout


@pytest.mark.parametrize("args, message", [
    (["stage", "/does/not/exist", "{tmp}/x"], "does not exist"),
    (["ckpt", "list", "/does/not/exist"], ""),
    (["export", "/does/not/exist.csv", "{tmp}/out"], "does not exist"),
])
def test_errors_exit_1_with_one_line(args, message, tmp_path):
    r = cli(*[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 1, (r.stdout, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ucmagic: error:") and message in last
    assert "Traceback" not in r.stderr


def test_stage_refuses_destination_inside_source(tmp_path):
    src = tmp_path / "src"
    make_files(str(src), 3, 10)
    r = cli("stage", str(src), str(src / "inner"))
    assert r.returncode == 1 and "inside the source" in r.stderr


def test_export_writes_parquet(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n" + "".join(f"{i},{i * 2}\n" for i in range(100)))
    out = tmp_path / "out"
    r = cli("export", str(csv), str(out), "--file-size", "1MB")
    assert r.returncode == 0, r.stderr
    assert any(f.endswith(".parquet") for _, _, fs in os.walk(out) for f in fs)


def test_ckpt_list_on_a_root_without_checkpoints_says_so_and_exits_0(tmp_path):
    r = cli("ckpt", "list", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"no committed checkpoints under {tmp_path}" and r.stderr == ""


def test_ckpt_list_on_a_missing_root_stays_an_error(tmp_path):
    r = cli("ckpt", "list", str(tmp_path / "nope"))
    assert r.returncode == 1 and r.stderr.strip().startswith("ucmagic: error:")


@pytest.mark.parametrize("cmd, usage", [(["stage", "--bogus", "a", "b"], "usage: python -m ucmagic stage"),
                                        (["ckpt", "list", "--bogus", "x"], "usage: python -m ucmagic ckpt list"),
                                        (["export", "--bogus", "a", "b"], "usage: python -m ucmagic export")])
def test_unknown_option_shows_the_subcommands_usage(cmd, usage):
    r = cli(*cmd)
    assert r.returncode == 2 and r.stderr.startswith(usage) and "--bogus" in r.stderr


def test_every_fixed_choice_is_declared_with_choices():
    import argparse

    from ucmagic.__main__ import build_parser

    def parsers(p):
        yield p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sp in a.choices.values():
                    yield from parsers(sp)

    by_dest = {(p.prog, a.dest): a for p in parsers(build_parser()) for a in p._actions}
    assert by_dest[("python -m ucmagic export", "mode")].choices == ["overwrite", "append", "error"]
    assert by_dest[("python -m ucmagic stage", "verify")].choices == ["size", "none"]
    r = cli("export", "a.csv", "out", "--mode", "merge")
    assert r.returncode == 2 and "invalid choice: 'merge'" in r.stderr


def test_export_append_adds_new_files_beside_the_old(tmp_path):
    import pyarrow.parquet as pq

    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n" + "".join(f"{i},{i * 2}\n" for i in range(100)))
    out = tmp_path / "out"
    assert cli("export", str(csv), str(out)).returncode == 0
    first = sorted(os.listdir(out))
    r = cli("export", str(csv), str(out), "--mode", "append")
    assert r.returncode == 0, r.stderr
    after = sorted(os.listdir(out))
    assert set(first) < set(after) and len(after) == 2 * len(first)
    assert pq.read_table(str(out)).num_rows == 200
    assert not [p for p in os.listdir(tmp_path) if "staging" in p]  # nothing left beside dest


def test_stage_summary_printed_once_on_a_terminal(tmp_path):
    """On a TTY the progress line ends with the summary, so stdout does not repeat it."""
    pty = pytest.importorskip("pty")
    src, dest = tmp_path / "src", tmp_path / "dest"
    make_files(str(src), 12, 100)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = bytearray()

    def read(fd):
        data = os.read(fd, 65536)
        out.extend(data)
        return data

    pid, fd = pty.fork()
    if pid == 0:  # child: stdin/stdout/stderr are the terminal
        os.execve(sys.executable, [sys.executable, "-m", "ucmagic", "stage", str(src), str(dest)], env)
    try:
        while True:
            try:
                if not read(fd):
                    break
            except OSError:
                break
    finally:
        _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert text.count("staged 12 files") == 1, text


def test_format_checkpoints_table():
    from ucmagic.checkpoints.format import CheckpointInfo

    text = format_checkpoints([CheckpointInfo(100, "/ck/step_100", 0.0, 2_500_000),
                               {"step": 200, "path": "/ck/step_200", "time": 86400.0, "size": 10}])
    lines = text.splitlines()
    assert lines[0].split() == ["STEP", "COMMITTED", "(UTC)", "SIZE", "PATH"]
    assert "100" in lines[1] and "1970-01-01 00:00:00" in lines[1] and "2.5 MB" in lines[1]
    assert "1970-01-02" in lines[2] and "/ck/step_200" in lines[2]


def test_bench_lists_scripts_and_rejects_unknown_names():
    r = cli("bench")
    assert r.returncode == 0 and "stage" in r.stdout
    r = cli("bench", "no-such-bench")
    assert r.returncode == 2 and "available" in r.stderr
    r = cli("bench", "stage", "--", "--help")
    assert r.returncode == 0 and "--files" in r.stdout


def test_temporary_files_of_the_session_stay_in_its_private_dir(_private_tmp, tmp_path):
    """Tests, CLI subprocesses and notebook kernels write temp files under one session directory that
    conftest removes at the end, and checkpoint staging goes to the test's tmp_path."""
    import tempfile

    from ucmagic.checkpoints.transfer import default_staging_root

    assert tempfile.gettempdir() == _private_tmp
    r = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == _private_tmp
    assert default_staging_root().startswith(str(tmp_path))


def test_load_prints_what_it_would_build_without_loading(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    make_files(str(tmp_path / "imgs"), 7, 1000)
    r = cli("load", str(tmp_path / "imgs"))
    assert r.returncode == 0, r.stderr
    assert "kind: files" in r.stdout and "files: 7" in r.stdout and "7.0 KB" in r.stdout
    (tmp_path / "pq").mkdir()
    for i, n in enumerate((100, 50)):
        pq.write_table(pa.table({"x": list(range(n))}), str(tmp_path / "pq" / f"part{i}.parquet"))
    r = cli("load", str(tmp_path / "pq"), "--stream")
    assert r.returncode == 0, r.stderr
    assert "kind: stream" in r.stdout and "files: 2" in r.stdout and "rows: 150" in r.stdout
    r = cli("load", str(tmp_path / "imgs"), "--stream")
    assert r.returncode == 1 and "--stream applies to tables" in r.stderr


def test_stage_jobs_is_an_alias_of_concurrency(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    make_files(str(src), 5, 100)
    r = cli("stage", str(src), str(dest), "--jobs", "2", "--no-progress")
    assert r.returncode == 0 and "staged 5 files" in r.stdout, r.stderr


# ------------------------------------------------------------------ help, version, usage errors (issue 24)

def _commands(parser=None, path=()):
    """Every command path of the CLI (``()``, ``("stage",)``, ``("ckpt", "list")`` ...), new ones included."""
    import argparse

    from ucmagic.__main__ import build_parser

    parser = parser or build_parser()
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                yield from _commands(sp, (*path, name))


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_and_subcommand_answers_help(flag, capsys):
    from ucmagic.__main__ import main

    paths = list(_commands())
    assert {("stage",), ("export",), ("ckpt", "list"), ("cache", "prune")} <= set(paths)
    for path in paths:
        with pytest.raises(SystemExit) as ei:
            main([*path, flag])
        out = capsys.readouterr().out
        assert ei.value.code == 0, path
        assert out.startswith("usage: python -m ucmagic" + "".join(f" {p}" for p in path)), (path, out[:200])


def test_version_prints_the_package_version():
    import ucmagic

    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ucmagic {ucmagic.__version__}"


@pytest.mark.parametrize("args, message", [
    (["-j", "0"], "argument -j/--concurrency/--jobs: must be an integer >= 1, got 0"),
    (["-j", "-5"], "argument -j/--concurrency/--jobs: must be an integer >= 1, got -5"),
    (["--jobs", "many"], "argument -j/--concurrency/--jobs: expected an integer >= 1, got 'many'"),
    (["--processes", "0"], "argument --processes: must be an integer >= 1, got 0"),
    (["--retries", "-1"], "argument --retries: must be an integer >= 0, got -1"),
])
def test_stage_rejects_bad_counts_as_usage_errors(args, message, tmp_path):
    src = tmp_path / "src"
    make_files(str(src), 2, 10)
    r = cli("stage", str(src), str(tmp_path / "dest"), *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines()[-1] == f"python -m ucmagic stage: error: {message}"
    assert not (tmp_path / "dest").exists()


def test_export_unknown_partition_column_is_one_clean_line(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n1,2\n")
    r = cli("export", str(csv), str(tmp_path / "out"), "--partition-by", "nosuchcol")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ucmagic: error: partition_by column 'nosuchcol' is not in "), last
    assert last.endswith("columns: a, b"), last  # no quotes around the whole message (a KeyError's str())
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(300)
def test_ctrl_c_during_export_exits_130_and_leaves_nothing(tmp_path):
    import glob
    import signal
    import time

    dest = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("UCMAGIC_DEBUG", None)
    query = "SELECT range AS id, md5(range::VARCHAR) AS s FROM range(400000000)"
    p = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
                          "signal.default_int_handler); from ucmagic.__main__ import main; sys.exit(main())",
                          "export", query, str(dest), "--file-size", "16MB"],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not glob.glob(str(tmp_path / ".out.ucmagic-staging-*" / "*.parquet")):  # writing
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and "Traceback" not in err, (out, err)
    # no destination, no staging (the cache directory holds DuckDB's private spill folder)
    assert [n for n in os.listdir(tmp_path) if n != "ucmagic-cache"] == []


@pytest.mark.parametrize("action", ["info", "prune", "clear"])
def test_cache_commands_on_a_mistyped_cache_dir_say_so_and_create_nothing(tmp_path, action):
    typo = tmp_path / "cahce"
    p = cli("cache", action, "--cache-dir", str(typo))
    assert p.returncode == 0 and "no cache directory here" in p.stdout
    assert not typo.exists()


@pytest.mark.parametrize("content,says", [
    ("", "is empty: expected a JSON object written by loader.stats.save()"),
    ("not json", "is not JSON (Expecting value at line 1, column 1): expected a JSON object written by"),
    ('{"a": 1}', "is not a LoaderStats file: expected a JSON object written by loader.stats.save() (keys version, "
                 "fetch_s, compute_s, ...), found keys a"),
    ("[1, 2]", "is not a LoaderStats file: expected a JSON object written by loader.stats.save(), found a JSON list"),
    ('{"version": 1, "fetch_s": [0.1], "compute_s": []}', "expected compute_s to have one value per batch (1)"),
    ('{"version": 1, "fetch_s": ["x"]}', "expected fetch_s to hold only numbers"),
])
def test_advise_names_the_file_and_what_it_expected(tmp_path, content, says):
    """Issue 52: a non-stats or empty JSON file said `unsupported LoaderStats file version None` or
    `Expecting value: line 1 column 1`."""
    path = tmp_path / "stats.json"
    path.write_text(content)
    r = cli("advise", str(path))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"ucmagic: error: {path} ") and says in r.stderr
