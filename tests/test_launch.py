"""@distributed: two gloo ranks on CPU — results, errors, timeouts, dataset partitioning."""
from __future__ import annotations

import time

import pytest

from ucmagic import distributed
from ucmagic.launch import (DistributedRunError, DistributedTimeoutError, RemoteTraceback, choose_backend,
                            rank_env)

pytestmark = pytest.mark.timeout(300)


def test_two_ranks_return_rank0_result_with_torchrun_environment(capfd):
    # defined inside the test, as in a notebook cell: pickled by value with cloudpickle
    @distributed(num_processes=2, timeout=120)
    def work(scale, *, offset=0):
        import os

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # user code that initialises the group itself keeps working
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR", "MASTER_PORT")}
        print(f"hello from {dist.get_rank()}")
        return {"sum": t.item() * scale + offset, "backend": dist.get_backend(), "env": env}

    res = work.distributed(10, offset=1)
    assert res["sum"] == 31.0 and res["backend"] == "gloo"
    env = res["env"]
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    out = capfd.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert work.__name__ == "work"
    with pytest.raises(TypeError, match="distributed"):
        work.distributed(1, 2, 3)


@pytest.mark.timeout(600)
def test_exception_in_one_rank_surfaces_with_its_traceback_and_stops_the_others():
    @distributed(num_processes=2, timeout=900)
    def fails_on_rank1():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("bad batch on rank 1")
        dist.barrier()  # rank 0 would wait here forever
        return "unreachable"

    t = time.monotonic()
    with pytest.raises(ValueError, match="bad batch on rank 1") as info:
        fails_on_rank1.distributed()
    assert time.monotonic() - t < 500  # torn down, not hung until the timeout (900 s: far from any start-up)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "rank 1" in str(cause) and "fails_on_rank1" in str(cause) and "raise ValueError" in str(cause)


def test_timeout_stops_a_hung_run_with_a_clear_error():
    @distributed(num_processes=2, timeout=4)
    def hangs():
        import time as t

        t.sleep(600)

    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError, match="timeout=4"):
        hangs.distributed()
    assert time.monotonic() - start < 300  # stopped at the timeout, not at the sleep's 600 s


def test_a_rank_that_dies_without_an_exception_is_reported():
    @distributed(num_processes=2, timeout=120)
    def dies():
        import os

        import torch.distributed as dist

        if dist.get_rank() == 1:
            os._exit(3)
        dist.barrier()

    with pytest.raises(DistributedRunError, match="rank 1 .* exited with code 3"):
        dies.distributed()


def test_a_rank_whose_death_shows_after_its_peers_error_is_still_named_as_the_cause():
    """Beside two busy processes the peer's ``Connection reset by peer`` arrived before the dying rank's exit
    showed, and the run raised the peer's gloo error instead of naming the rank that died. Here the dying rank
    breaks the collective first and exits a moment later."""
    @distributed(num_processes=2, timeout=120)
    def dies_late():
        import os
        import time

        import torch.distributed as dist

        if dist.get_rank() == 1:
            dist.destroy_process_group()  # the peer's barrier fails now
            time.sleep(0.3)
            os._exit(3)
        dist.barrier()

    with pytest.raises(DistributedRunError, match="rank 1 .* exited with code 3"):
        dies_late.distributed()


def test_dataset_inside_the_function_splits_files_over_ranks(tmp_path):
    from ucmagic.testing import make_files

    root = str(tmp_path / "vol")
    rels = make_files(root, 10, 100)
    cache = str(tmp_path / "cache")

    @distributed(num_processes=2, timeout=120)
    def read_all(path, cache_dir):
        import torch.distributed as dist

        from ucmagic import UCVolumeDataset

        ds = UCVolumeDataset(path, cache_dir=cache_dir)
        mine = [open(p, "rb").read().split(b"\n", 1)[0].decode() for p in ds]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone

    per_rank = read_all.distributed(root, cache)
    assert len(per_rank) == 2 and len(per_rank[0]) == len(per_rank[1]) == 5
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(rels)


# ---------------------------------------------------------------- local behaviour, no processes

def test_direct_call_runs_locally_and_overrides():
    @distributed
    def add(a, b=1):
        return a + b

    assert add(2) == 3 and add(2, b=5) == 7
    other = add.with_overrides(num_processes=3, timeout=5)
    assert other.num_processes == 3 and other.timeout == 5 and other(1) == 2
    assert "num_processes=3" in repr(other)


@pytest.mark.parametrize("kw", [{"num_processes": 0}, {"num_processes": True}, {"timeout": -1},
                                {"timeout": "1h"}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        distributed(**kw)


def test_rank_env_and_backend_choice(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = rank_env(1, 4, "127.0.0.1", 29500)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_PORT"] == "29500" and env["OMP_NUM_THREADS"] == "1"
    assert choose_backend("nccl", 2) == "nccl"
    import torch

    if not torch.cuda.is_available():
        assert choose_backend(None, 2) == "gloo"


def test_the_seeds_serverless_form_runs_gpus_ranks_here_and_says_what_gpu_type_does():
    # the seeds' @distributed(gpus=8, gpu_type='H100'), scaled down: gpus is the number of ranks
    with pytest.warns(UserWarning, match=r"gpu_type='H100' selects Databricks serverless GPUs; here the 2 rank"):
        @distributed(gpus=2, gpu_type="H100", timeout=120)
        def world():
            import torch.distributed as dist

            return dist.get_world_size()

    assert world.num_processes == 2 and world.distributed() == 2
    assert distributed(gpus=3)(lambda: None).num_processes == 3  # no gpu_type: nothing to warn about
    from ucmagic.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="num_processes=2 and gpus=4 disagree"):
        distributed(num_processes=2, gpus=4)
    with pytest.raises(InvalidArgumentError, match="gpus must be a positive int"):
        distributed(gpus=0)
    with pytest.raises(InvalidArgumentError, match="gpu_type must be a string"):
        distributed(gpus=1, gpu_type=100)


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"  # the README's example at a script's top level, no __main__ guard
    script.write_text("from ucmagic import distributed\n\n@distributed(num_processes=2, timeout=60)\n"
                      "def train(lr):\n    return lr\n\nprint(train.distributed(1.0))\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode != 0
    assert "DistributedRunError" in p.stderr and 'if __name__ == "__main__":' in p.stderr.splitlines()[-1]
