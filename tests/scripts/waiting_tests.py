"""The tests that wait or bound time: the set issue 53 asks to pass three times in a row beside busy processes.

    python tests/scripts/waiting_tests.py            # one pytest node id per line (tests/FILE.py::NAME)
    python -m pytest -p no:cacheprovider $(python tests/scripts/waiting_tests.py)
    python tests/scripts/waiting_tests.py --count    # how many functions, per module

Chosen by reading the source (``ast``), not by running it: a test function waits or bounds time when its own
body, or a module-level helper, fixture or class of its module that it names (followed through the names those
name in turn), mentions a name below: sleeps, waits, joins, events and conditions, timeouts and deadlines,
clocks, signals and kills, threads, and child processes (subprocesses, DataLoader workers, ranks). A fixture of
the module is followed through the test's parameters; conftest.py's fixtures are not followed. Wide on purpose:
a test that only might wait is in the set.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from collections import Counter

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WAITING = {
    # sleeps, waits, joins and what one waits on
    "sleep", "wait", "wait_for", "join", "Event", "Condition", "Barrier", "Semaphore", "barrier", "result",
    # time bounds and clocks
    "timeout", "timeout_s", "deadline", "monotonic", "perf_counter", "time", "clock", "JumpClock", "alarm",
    # signals and kills
    "signal", "kill", "send_signal", "terminate", "SIGINT", "SIGKILL", "SIGTERM", "KeyboardInterrupt",
    # threads and child processes
    "Thread", "ThreadPoolExecutor", "Popen", "subprocess", "run", "check_output", "spawn", "fork",
    "get_context", "multiprocessing", "Process", "num_workers", "run_ranks", "executable", "persistent_workers",
}


def _names(node: ast.AST) -> set[str]:
    """Every name, attribute, keyword argument and parameter mentioned under ``node``."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, (ast.keyword, ast.arg)) and n.arg:
            out.add(n.arg)
    return out


def waiting_tests(path: str) -> list[str]:
    """Node ids (``tests/FILE.py::NAME`` or ``::CLASS::NAME``) of the tests in ``path`` that wait or bound time."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    defs: dict[str, ast.AST] = {}  # module-level helpers, fixtures and classes, by name
    tests: list[tuple[str, ast.AST]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[node.name] = node
            if node.name.startswith("test"):
                tests.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            defs[node.name] = node
            if node.name.startswith("Test"):
                tests += [(f"{node.name}::{m.name}", m) for m in node.body
                          if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test")]
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    defs[t.id] = node
    waits: dict[str, bool] = {}

    def waits_by(name: str, seen: frozenset[str]) -> bool:
        if name in waits:
            return waits[name]
        names = _names(defs[name])
        got = bool(names & WAITING) or any(n in defs and n not in seen and waits_by(n, seen | {n})
                                            for n in names)
        waits[name] = got
        return got

    rel = os.path.relpath(path, os.path.dirname(TESTS))
    out = []
    for test_id, node in tests:
        names = _names(node)
        if names & WAITING or any(n in defs and waits_by(n, frozenset({n})) for n in names):
            out.append(f"{rel}::{test_id}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", action="store_true", help="print how many functions per module instead")
    a = ap.parse_args()
    ids = []
    for name in sorted(os.listdir(TESTS)):
        if name.startswith("test_") and name.endswith(".py"):
            ids += waiting_tests(os.path.join(TESTS, name))
    if a.count:
        per = Counter(i.split("::")[0] for i in ids)
        for mod, n in sorted(per.items()):
            print(f"{n:5d}  {mod}")
        print(f"{len(ids):5d}  functions in {len(per)} modules")
    else:
        print("\n".join(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
