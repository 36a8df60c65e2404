"""Checkpoint save/load on a slow volume: torch.save, torch DCP FileSystemWriter, databricks-sdk-air, ucmagic.

    python bench/checkpoint.py [--mb 200] [--rounds 3] [--profile p20|p100] [--keep-mount]

Builds a ~``--mb`` MB model plus Adam state (about 3x that in all), mounts a slow FUSE volume
(``ucmagic.testing.mount_slow_volume``) under ``/Volumes/...`` (databricks-sdk-air only accepts such
paths) and, in interleaved rounds, times for each method: how long the training loop is blocked,
how long until the checkpoint is durable on the volume, and how long a load takes. Prints medians
and the target ratios (SPEC section 4): our async save blocks <= 1/5 of a sync save; our durable
save and our load >= 2x faster than databricks-sdk-air's UCVolumeWriter/UCVolumeReader.
Without FUSE it falls back to a plain local directory and says so (the ratios then mean little).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

warnings.simplefilter("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from ucmagic import testing  # noqa: E402
from ucmagic.checkpoints.api import UCVolumeReader, UCVolumeWriter  # noqa: E402
from ucmagic.checkpoints.torch_state import dcp_state  # noqa: E402

PROFILES = {"p20": dict(open_ms=20, mbps=200), "p100": dict(open_ms=100, mbps=100)}
DBAIR_PATH = "/tmp/dbair/x"


def build(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of 2048x2048 linear layers with ~mb MB of float32 weights, after one Adam step."""
    torch.manual_seed(0)
    per = 2048 * 2048 * 4
    layers = [torch.nn.Linear(2048, 2048) for _ in range(max(1, round(mb * 1e6 / per)))]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 2048)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def fingerprint(state: dict) -> float:
    return float(sum(float(v.double().sum()) for v in state["model"].values()))


def fresh_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The target of a load: the model's and optimizer's own tensors, zeroed (so a bad load shows)."""
    state = dcp_state(model, opt)
    tensors = list(state["model"].values()) + [t for s in state["optim"]["state"].values() for t in s.values()]
    with torch.no_grad():
        for t in tensors:
            if torch.is_tensor(t) and t.is_floating_point():
                t.zero_()
    return state


def fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# ---------------------------------------------------------------- methods: (save -> (blocked, durable), load -> s)

def m_torch_save(model, opt, path, async_):
    os.makedirs(path, exist_ok=True)
    t0 = time.perf_counter()
    f = os.path.join(path, "ckpt.pt")
    with open(f, "wb") as fh:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    t = time.perf_counter() - t0
    return t, t


def l_torch_save(model, opt, path):
    t0 = time.perf_counter()
    sd = torch.load(os.path.join(path, "ckpt.pt"), map_location="cpu", weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    return time.perf_counter() - t0, fingerprint({"model": model.state_dict()})


def _dcp_save(writer, model, opt, async_):
    state = dcp_state(model, opt)
    t0 = time.perf_counter()
    if async_:
        fut = dcp.async_save(state, storage_writer=writer)
        blocked = time.perf_counter() - t0
        fut.result()
    else:
        dcp.save(state, storage_writer=writer)
        blocked = time.perf_counter() - t0
    return blocked, time.perf_counter() - t0


def _dcp_load(reader_factory, model, opt, path):
    state = fresh_state(model, opt)
    gc.collect()
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=reader_factory(path))
    return time.perf_counter() - t0, fingerprint(state)


def methods(dbair):
    out = {
        "torch.save": (lambda m, o, p, a: m_torch_save(m, o, p, a), l_torch_save, False),
        "torch FileSystemWriter": (lambda m, o, p, a: _dcp_save(dcp.FileSystemWriter(p), m, o, a),
                                   lambda m, o, p: _dcp_load(dcp.FileSystemReader, m, o, p), False),
    }
    if dbair is not None:
        w, r = dbair
        out["dbair sync"] = (lambda m, o, p, a: _dcp_save(w(p), m, o, a), lambda m, o, p: _dcp_load(r, m, o, p), False)
        out["dbair async"] = (lambda m, o, p, a: _dcp_save(w(p), m, o, a), None, True)
    out["ucmagic sync"] = (lambda m, o, p, a: _dcp_save(UCVolumeWriter(p), m, o, a),
                           lambda m, o, p: _dcp_load(UCVolumeReader, m, o, p), False)
    out["ucmagic async"] = (lambda m, o, p, a: _dcp_save(UCVolumeWriter(p), m, o, a), None, True)
    return out


def import_dbair():
    sys.path.insert(0, DBAIR_PATH)
    try:
        from databricks.air.data.dcp_storage import UCVolumeReader as AirReader
        from databricks.air.data.dcp_storage import UCVolumeWriter as AirWriter
    except Exception as e:  # noqa: BLE001
        print(f"databricks-sdk-air not importable from {DBAIR_PATH}: {e}; skipping it")
        return None
    return AirWriter, AirReader


@contextlib.contextmanager
def volume(profile: str, keep: bool):
    backing = tempfile.mkdtemp(prefix="ucm-ckpt-backing-", dir=os.environ.get("BENCH_BACKING_DIR"))
    if testing.fuse_available():
        mnt = f"/Volumes/ucmagic_bench/ckpt/vol{os.getpid()}"
        with testing.mount_slow_volume(backing, mnt, list_ms=20, **PROFILES[profile]):
            print(f"volume: FUSE mount {mnt} -> {backing}, profile {profile} {PROFILES[profile]}")
            try:
                yield mnt
            finally:
                if not keep:
                    shutil.rmtree(backing, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)
    else:
        mnt = "/Volumes/ucmagic_bench/ckpt/local"
        os.makedirs(mnt, exist_ok=True)
        print("volume: FUSE NOT AVAILABLE - falling back to a plain local directory (no latency, no bandwidth "
              f"limit): {mnt}. Ratios are not meaningful.")
        yield mnt
        shutil.rmtree(mnt, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=200, help="model size in MB (Adam adds 2x)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="p20")
    ap.add_argument("--only", default="", help="comma-separated method names to run")
    ap.add_argument("--keep-mount", action="store_true")
    a = ap.parse_args()

    model, opt = build(a.mb)
    truth = fingerprint({"model": model.state_dict()})
    nbytes = sum(v.numel() * v.element_size() for v in dcp_state(model, opt)["model"].values()) * 3
    print(f"model: {len(model)} x Linear(2048, 2048), state with Adam ~{nbytes / 1e6:.0f} MB; "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}")
    ms = methods(import_dbair())
    if a.only:
        ms = {k: v for k, v in ms.items() if k in a.only.split(",")}
    res: dict[str, dict[str, list[float]]] = {k: {"blocked": [], "durable": [], "load": []} for k in ms}
    with volume(a.profile, a.keep_mount) as mnt:
        for r in range(a.rounds):
            for name, (save, load, is_async) in ms.items():
                path = os.path.join(mnt, f"{name.replace(' ', '_').replace('.', '_')}_{r}")
                gc.collect()
                blocked, durable = save(model, opt, path, is_async)
                res[name]["blocked"].append(blocked)
                res[name]["durable"].append(durable)
                line = f"round {r} {name:24s} blocked {blocked:6.2f}s durable {durable:6.2f}s"
                if load is not None:
                    lt, fp = load(model, opt, path)  # loads back into the same (zeroed) tensors
                    ok = abs(fp - truth) <= 1e-6 * max(1.0, abs(truth))
                    res[name]["load"].append(lt)
                    line += f" load {lt:6.2f}s{'' if ok else '  (LOADED VALUES DIFFER!)'}"
                print(line, flush=True)
                shutil.rmtree(path, ignore_errors=True)

    med = {k: {m: (statistics.median(v) if v else float("nan")) for m, v in d.items()} for k, d in res.items()}
    print(f"\nmedians over {a.rounds} rounds ({a.profile}):")
    print(f"{'method':24s} {'blocked':>8s} {'durable':>8s} {'load':>8s}")
    for k, d in med.items():
        print(f"{k:24s} {d['blocked']:8.2f} {d['durable']:8.2f} {d['load']:8.2f}")

    def ratio(x: float, y: float) -> str:
        return f"{x / y:.2f}" if y and y == y and x == x else "n/a"

    print("\nratios:")
    if "ucmagic async" in med and "ucmagic sync" in med:
        print(f"  ucmagic async blocked / ucmagic sync save  = "
              f"{ratio(med['ucmagic async']['blocked'], med['ucmagic sync']['durable'])}  (target <= 0.20)")
    if "ucmagic async" in med and "torch FileSystemWriter" in med:
        print(f"  ucmagic async blocked / torch FileSystemWriter sync save = "
              f"{ratio(med['ucmagic async']['blocked'], med['torch FileSystemWriter']['durable'])}")
    if "dbair sync" in med and "ucmagic sync" in med:
        print(f"  dbair sync durable / ucmagic sync durable  = "
              f"{ratio(med['dbair sync']['durable'], med['ucmagic sync']['durable'])}  (target >= 2)")
        print(f"  dbair async durable / ucmagic async durable= "
              f"{ratio(med['dbair async']['durable'], med['ucmagic async']['durable'])}")
        print(f"  dbair load / ucmagic load                  = "
              f"{ratio(med['dbair sync']['load'], med['ucmagic sync']['load'])}  (target >= 2)")
    for other in ("torch.save", "torch FileSystemWriter"):
        if other in med and "ucmagic sync" in med:
            print(f"  {other} durable / ucmagic sync durable = "
                  f"{ratio(med[other]['durable'], med['ucmagic sync']['durable'])}"
                  f"; load ratio = {ratio(med[other]['load'], med['ucmagic sync']['load'])}")


if __name__ == "__main__":
    main()
