"""Run one script as several gloo ranks (fresh processes) and collect what each printed.

The script reads ``RANK`` and ``PG_INIT`` (a fresh ``file://`` rendezvous next to the script) from
its environment and prints ``READY`` (flushed) once its process group is up. A rank that hangs
dumps every thread's stack (faulthandler) and exits, so a failure shows where it stopped instead
of a bare timeout. A run in which no rank got its process group up (the gloo rendezvous itself
stalled: the machine, not the code under test) is tried once more.
"""
from __future__ import annotations

import os
import subprocess
import sys

PRELUDE = """import faulthandler, os
faulthandler.dump_traceback_later(int(os.environ.get("RANK_HANG_S", "120")), exit=True)
"""


def run_ranks(script: str, *, world: int = 2, env: dict[str, str] | None = None, timeout: float = 180,
              hang_s: int = 120) -> list[str]:
    """Run ``script`` (a path) as ``world`` ranks; return each rank's output, failing on a non-zero exit."""
    for attempt in (1, 2):
        init = f"file://{os.path.dirname(os.path.abspath(script))}/pg-{attempt}"
        base = dict(os.environ if env is None else env, RANK_HANG_S=str(hang_s), WORLD_SIZE=str(world), PG_INIT=init)
        procs = [subprocess.Popen([sys.executable, script], env=dict(base, RANK=str(r)), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(world)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outs.append(p.communicate()[0] + f"\n[rank timed out after {timeout} s]")
        for p in procs:
            p.wait()
        if all(p.returncode == 0 for p in procs):
            return outs
        if attempt == 1 and not any("READY" in o for o in outs):
            continue  # nobody got past init_process_group: retry the rendezvous once
        raise AssertionError("a rank failed:\n" + "\n".join(f"--- rank {r} (exit {p.returncode}):\n{o[-4000:]}"
                                                            for r, (p, o) in enumerate(zip(procs, outs))))
    raise AssertionError("unreachable")
