"""SPEC 4's client CPU and memory, judged by the shared script: ucmagic, the raw copy and databricks-sdk-air.

    python bench/shared_coldwarm.py [--rounds 5] [--profiles P20,P100] [--systems limit,ucmagic,dbx]
    python bench/shared_coldwarm.py --baseline main --systems ucmagic,baseline --rounds 9   # before/after

Runs ``coldwarm.py`` of the shared tools (``--tools``, ``$UCMAGIC_SHARED_TOOLS``, or ``shared/tools`` one
or two folders above the checkout) as is, once per system, profile and round, each in a fresh process:

- ``limit``: ``coldwarm.py limit VOL --procs 4 --threads 64`` (the raw copy, no caching logic);
- ``ucmagic``: ``coldwarm.py ucmagic VOL`` with this checkout on ``PYTHONPATH`` and a fresh
  ``UCMAGIC_CACHE_DIR``;
- ``dbx``: ``coldwarm.py dbx VOL`` under ``$DBAIR_PYTHON`` (default /tmp/venv-dbair/bin/python:
  ``databricks-sdk-air[data]==0.1.1`` with this environment's torch and numpy);
- ``baseline`` (with ``--baseline REF``): ``ucmagic`` imported from a ``git worktree`` of REF.

Each profile is one FUSE mount by the shared ``slowvol.py`` (P20: 20 ms per open, 200 MB/s per
stream; P100: 100 ms, 100 MB/s) of 2,000 files of 150 KiB, under ``/Volumes/bench/<tag>/`` (the
peer accepts only ``/Volumes`` paths). Systems run in a rotated order each round. The script
prints each run's line, then per profile the medians (cold epoch, warm epoch, first batch, client
CPU per cold epoch, peak summed USS of the process tree) and the SPEC's ratios, as the ratio of
medians and as the median of the per-round ratios (a round's systems ran within a minute of each
other, so their ratio is less exposed to the machine's drift than the medians are).

Caches and copies stay until the whole run ends (``RemovedAtExit``: on this VM's ext4 without a
journal, a creation right after a mass deletion pays for every inode freed in the last minutes).
The raw copy removes its own copy as it ends and databricks-sdk-air its temporary cache, which the
next run pays for. With the three systems ucmagic and the raw copy each follow such a removal in
every round; with ``--systems limit,ucmagic`` over both profiles ucmagic follows the raw copy's
removal in 3 runs of 4 and the raw copy follows ucmagic (which removes nothing) in 3 of 4, so
compare those two with ``--settle 65``; with ``--systems limit,ucmagic --baseline REF`` the raw copy
never follows a removal (compare ``ucmagic,baseline`` alone, which remove nothing, as above). Run it
alone: CPU seconds taken beside other work are inflated unevenly (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _child import RemovedAtExit  # bench/ is on sys.path when a benchmark runs as a script
from coldwarm import PROFILES, baseline_worktree

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SYSTEMS = ("limit", "ucmagic", "dbx", "baseline")


def tools_dir(given: str | None) -> str:
    """The shared tools folder: ``given``, ``$UCMAGIC_SHARED_TOOLS``, or ``shared/tools`` one or two levels
    above the checkout (``../shared/tools`` from a clone beside it, as the issues name it)."""
    found = [given or os.environ.get("UCMAGIC_SHARED_TOOLS") or ""]
    if not found[0]:
        found = [os.path.join(os.path.dirname(REPO), "shared", "tools"),
                 os.path.join(os.path.dirname(os.path.dirname(REPO)), "shared", "tools")]
    for d in found:
        if os.path.exists(os.path.join(d, "coldwarm.py")):
            return d
    raise SystemExit(f"no coldwarm.py in {' or '.join(found)}: pass --tools DIR (the shared tools folder)")


def make_source(path: str, files: int, size: int) -> None:
    """``files`` files of ``size`` bytes in one folder (databricks-sdk-air lists one level only)."""
    if os.path.isdir(path) and len(os.listdir(path)) == files:
        return
    shutil.rmtree(path, ignore_errors=True)
    sys.path.insert(0, REPO)
    from ucmagic.testing import make_files

    make_files(path, files, size, depth=0)


class Mount:
    """The shared ``slowvol.py`` serving ``source`` at ``mountpoint`` (unmounted at exit)."""

    def __init__(self, slowvol: str, source: str, mountpoint: str, open_ms: float, mbps: float) -> None:
        self.mountpoint = mountpoint
        if os.path.ismount(mountpoint):
            subprocess.run(["fusermount3", "-uz", mountpoint], check=False, capture_output=True)
        os.makedirs(mountpoint, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, slowvol, source, mountpoint, "--open-ms", str(open_ms),
                                      "--mbps", str(mbps)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not os.path.ismount(mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"slowvol.py did not mount {mountpoint}: needs fuse3 and mfusepy")
            time.sleep(0.05)

    def close(self) -> None:
        if subprocess.run(["fusermount3", "-u", self.mountpoint], check=False,
                          capture_output=True).returncode != 0:
            subprocess.run(["fusermount3", "-uz", self.mountpoint], check=False, capture_output=True)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_one(system: str, vol: str, tools: str, workdir: str, kept: RemovedAtExit, *, dbx_python: str,
            base: str | None, timeout: float) -> dict:
    """One run of the shared script: its JSON line, or ``{"error": ...}``."""
    script = os.path.join(tools, "coldwarm.py")
    scratch = kept.add(tempfile.mkdtemp(prefix=f"{system}-", dir=workdir))
    env = dict(os.environ, TMPDIR=scratch, UCMAGIC_CACHE_DIR=os.path.join(scratch, "cache"),
               UCMAGIC_PROGRESS="off")
    env.pop("PYTHONPATH", None)
    python = sys.executable
    if system == "limit":
        cmd = [python, script, "limit", vol, "--procs", "4", "--threads", "64"]
    elif system == "dbx":
        cmd = [dbx_python, script, "dbx", vol]
    else:
        env["PYTHONPATH"] = base if system == "baseline" and base else REPO
        cmd = [python, script, "ucmagic", vol]
    os.sync()  # an earlier run's writes reach the disk before this one starts
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def cold(r: dict, key: str = "epochs") -> float:
    return r[key][0] if r.get(key) else float("nan")


def report(profile: str, runs: dict[str, list[dict]]) -> None:
    """Medians per system and the SPEC's ratios, over the rounds every system of the ratio completed."""
    ok = {s: [r for r in rs if "error" not in r] for s, rs in runs.items()}
    print(f"\n== {profile}: {PROFILES[profile]['open_ms']} ms per open, {PROFILES[profile]['mbps']} MB/s per "
          f"stream; medians of {max(len(v) for v in runs.values())} rounds ==")
    print(f"  {'system':9s} {'cold s':>7s} {'warm s':>7s} {'1st batch s':>11s} {'cold CPU-s':>10s} {'peak USS MB':>11s}"
          "  failed")
    for s, rs in ok.items():
        warm = [r["epochs"][1] for r in rs if len(r["epochs"]) > 1]
        first = [r["first_batch_s"] for r in rs if r.get("first_batch_s") is not None]
        print(f"  {s:9s} {median([cold(r) for r in rs]):7.2f} {median(warm):7.2f} {median(first):11.2f} "
              f"{median([cold(r, 'epoch_cpu_s') for r in rs]):10.2f} {median([r['peak_rss_mb'] for r in rs]):11.0f}"
              f"  {len(runs[s]) - len(rs)}")

    def pair(a: str, b: str, key: str, idx: bool = True) -> tuple[float, float, list[float]]:
        """(ratio of medians, median of per-round ratios, per-round ratios) of ``a``'s ``key`` over ``b``'s."""
        if a not in runs or b not in runs:
            return float("nan"), float("nan"), []
        per = []
        for x, y in zip(runs[a], runs[b]):
            if "error" in x or "error" in y:
                continue
            vx, vy = (cold(x, key), cold(y, key)) if idx else (x[key], y[key])
            per.append(vx / vy)
        va = [cold(r, key) if idx else r[key] for r in ok.get(a, [])]
        vb = [cold(r, key) if idx else r[key] for r in ok.get(b, [])]
        return median(va) / median(vb), median(per), per

    print("  ratios: of medians / median of per-round ratios [SPEC 4]; per round")
    rows = [("ucmagic cold CPU / raw copy's", "ucmagic", "limit", "epoch_cpu_s", True, "<= 1.25"),
            ("ucmagic cold epoch / raw copy's", "ucmagic", "limit", "epochs", True, "<= 1.1"),
            ("databricks-sdk-air cold / ucmagic's", "dbx", "ucmagic", "epochs", True,
             ">= 1.2" if profile == "P20" else ">= 2"),
            ("ucmagic peak USS / databricks-sdk-air's", "ucmagic", "dbx", "peak_rss_mb", False, "<= 0.5"),
            ("after / before: cold CPU", "ucmagic", "baseline", "epoch_cpu_s", True, "< 1"),
            ("after / before: cold epoch", "ucmagic", "baseline", "epochs", True, "not slower"),
            ("after / before: peak USS", "ucmagic", "baseline", "peak_rss_mb", False, "")]
    for name, a, b, key, idx, target in rows:
        of_medians, med, per = pair(a, b, key, idx)
        if per:
            print(f"  {name:42s} {of_medians:5.2f} / {med:5.2f} [{target}]  " + " ".join(f"{x:.2f}" for x in per))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profiles", default="P20,P100")
    ap.add_argument("--systems", default="limit,ucmagic,dbx")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", type=int, default=150 * 1024)
    ap.add_argument("--tools", default=None, help="the shared tools folder (coldwarm.py, slowvol.py)")
    ap.add_argument("--workdir", default="/tmp/ucmagic-shared-bench")
    ap.add_argument("--baseline", default=None, metavar="REF", help="also run ucmagic from a git worktree of REF")
    ap.add_argument("--dbx-python", default=os.environ.get("DBAIR_PYTHON", "/tmp/venv-dbair/bin/python"))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--settle", type=float, default=0,
                    help="seconds to wait after each run, once its writes are synced (65: past ext4's "
                         "60-second memory of freed inodes, so no run pays for the one before)")
    ap.add_argument("--json", default=None, help="also write every run's result here")
    a = ap.parse_args()
    tools = tools_dir(a.tools)
    systems = [s for s in a.systems.split(",") if s]
    if a.baseline and "baseline" not in systems:
        systems.append("baseline")
    unknown = set(systems) - set(SYSTEMS)
    if unknown or ("baseline" in systems and not a.baseline):
        raise SystemExit(f"--systems: choose from {', '.join(SYSTEMS)} (baseline needs --baseline REF)")
    if "dbx" in systems and not os.path.exists(a.dbx_python):
        print(f"skipping dbx: no interpreter at {a.dbx_python}", file=sys.stderr)
        systems.remove("dbx")
    profiles = [p for p in a.profiles.split(",") if p]
    os.makedirs(a.workdir, exist_ok=True)
    src = os.path.join(a.workdir, f"src-{a.files}x{a.size}")
    make_source(src, a.files, a.size)
    tag = f"shared-{os.getpid()}"
    results: dict[str, dict[str, list[dict]]] = {p: {s: [] for s in systems} for p in profiles}
    mounts: list[Mount] = []
    with baseline_worktree(a.baseline, a.workdir) as base, RemovedAtExit() as kept:
        try:
            vols = {}
            for p in profiles:
                m = Mount(os.path.join(tools, "slowvol.py"), src, f"/Volumes/bench/{tag}/{p.lower()}",
                          **{"open_ms": PROFILES[p]["open_ms"], "mbps": PROFILES[p]["mbps"]})
                mounts.append(m)
                vols[p] = m.mountpoint
            for rnd in range(a.rounds):
                order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
                for p in profiles:
                    for s in order:
                        r = run_one(s, vols[p], tools, a.workdir, kept, dbx_python=a.dbx_python, base=base,
                                    timeout=a.timeout)
                        results[p][s].append(r)
                        if a.settle:
                            os.sync()
                            time.sleep(a.settle)
                        line = r.get("error") or (f"cold {cold(r):.2f} s, {cold(r, 'epoch_cpu_s'):.2f} CPU-s, "
                                                  f"peak USS {r['peak_rss_mb']} MB")
                        print(f"[round {rnd + 1}] {p} {s:9s} {line}", flush=True)
        finally:
            for m in mounts:
                m.close()
            shutil.rmtree(f"/Volumes/bench/{tag}", ignore_errors=True)
    for p in profiles:
        report(p, results[p])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
