"""Real trainers over ucmagic.DataLoader on two CPU ranks (gloo): HF Accelerate splitting a ucmagic dataset again
is refused by name. Each trainer's resume recipes, with the data passed every way, are the trainers table
(tests/test_trainer_table.py).

Behind the ``trainers`` marker; each trainer's tests are skipped where it is not installed (the
``trainers`` extra). Each run is a subprocess under a timeout (tests/scripts/trainer_*.py).
"""
import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(600)]

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
N = {"files": 200}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def data(tmp_path):
    from ucmagic.testing import make_files

    root = str(tmp_path / "vol")
    make_files(root, N["files"], 64, per_dir=50)
    return root


def _run(args, tmp_path, timeout=240, torchrun=True):
    env = {**os.environ, "PYTHONPATH": SCRIPTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MASTER_PORT": str(_port()), "OMP_NUM_THREADS": "1"}
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            env["MASTER_PORT"]] if torchrun else [sys.executable]) + args
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _exact(ids, kind):
    assert len(ids) == len(set(ids)) == N[kind] and sorted(ids) == list(range(N[kind]))


def test_accelerate_splitting_a_ucmagic_dataset_again_raises_with_the_fix(data, tmp_path):
    """torch's DataLoader over the files wrapper under ``accelerator.prepare`` (HF Trainer's own loader
    too): Accelerate would split the per-rank data again (200 of 400 files per epoch, silently); the
    first batch raises SplitTwiceError naming the fix, in both of Accelerate's modes; with the fix
    (ucmagic.DataLoader) the epoch is exact."""
    pytest.importorskip("accelerate")
    out = str(tmp_path / "out")
    _run([os.path.join(SCRIPTS, "trainer_split_twice.py"), data, out], tmp_path)
    ranks = [json.load(open(os.path.join(out, f"split-twice-rank{r}.json"))) for r in (0, 1)]
    for r, got in enumerate(ranks):
        for mode in ("dispatch=True", "dispatch=False"):
            if mode == "dispatch=True" and r == 1:
                continue
            assert "splits this UCVolumeDataset over the ranks again" in got[mode], (r, mode, got[mode])
            assert "ucmagic.DataLoader(dataset, ...) to accelerator.prepare" in got[mode]
    _exact(ranks[0]["fixed"] + ranks[1]["fixed"], "files")


def _split_kinds(root):
    """One dataset of each ucmagic iterable kind that reads only this rank's share."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import ucmagic
    from ucmagic.testing import make_files

    make_files(os.path.join(root, "files"), 16, 64, per_dir=8)
    os.makedirs(os.path.join(root, "pq"))
    pq.write_table(pa.table({"x": list(range(32))}), os.path.join(root, "pq", "a.parquet"))
    ucmagic.pack(os.path.join(root, "files"), os.path.join(root, "shards"), "16KB")
    os.makedirs(os.path.join(root, "tok"))
    np.arange(4096, dtype=np.uint16).tofile(os.path.join(root, "tok", "a.bin"))
    cache = os.path.join(root, "cache")
    tars = ucmagic.TarShards(os.path.join(root, "shards"), cache_dir=cache)
    return {
        "UCVolumeDataset": ucmagic.UCVolumeDataset(os.path.join(root, "files"), cache_dir=cache),
        "ParquetDataset": ucmagic.ParquetDataset(os.path.join(root, "pq"), batch_size=4, cache_dir=cache),
        "SampleStream": tars.stream(),
        "Mix": ucmagic.mix([tars.stream(), tars.stream(seed=1)]),
        "TokenWindows": ucmagic.TokenWindows(os.path.join(root, "tok"), block_size=8, cache_dir=cache).stream(),
    }


def test_accelerate_splitting_any_ucmagic_kind_again_raises_with_the_fix(tmp_path, monkeypatch):
    """Accelerate's IterableDatasetShard (what prepare() wraps torch's loader's iterable in) over a rank's
    share of any ucmagic kind: SplitTwiceError at the first item, naming the kind and the fix (in process:
    RANK/WORLD_SIZE as torchrun sets them)."""
    accelerate_data_loader = pytest.importorskip("accelerate.data_loader")
    import ucmagic

    kinds = _split_kinds(str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for kind, ds in kinds.items():
        shard = accelerate_data_loader.IterableDatasetShard(ds, batch_size=2, num_processes=2, process_index=0)
        with pytest.raises(ucmagic.SplitTwiceError, match="accelerator.prepare") as e:
            next(iter(shard))
        assert "splits this" in str(e.value), (kind, str(e.value))
    monkeypatch.setenv("WORLD_SIZE", "1")  # one rank: nothing is split twice, the shard reads on
    shard = accelerate_data_loader.IterableDatasetShard(kinds["ParquetDataset"], batch_size=1, num_processes=1)
    assert next(iter(shard))["x"].numel() == 4
