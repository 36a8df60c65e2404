"""A real two-node run on one machine: two torchrun agents (--nnodes=2) rendezvous on 127.0.0.1,
each "node" with its own cache directory, reading the same volume."""
import json
import os
import socket
import subprocess
import sys

import pytest

from ucmagic.testing import make_files

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(src: str, out: str, shuffle: str, tmp) -> list[dict]:
    port = _free_port()
    agents = []
    for node in range(2):
        env = dict(os.environ, UCMAGIC_CACHE_DIR=str(tmp / f"node{node}-cache-{shuffle}"), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
               os.path.join(HERE, "scripts", "two_node_worker.py"), src, out, shuffle]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for a in agents:
        try:
            logs.append(a.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for b in agents:
                b.kill()
            pytest.fail("two-node run timed out")
    for a, log in zip(agents, logs):
        assert a.returncode == 0, log[-3000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]


@pytest.mark.parametrize("shuffle", ["node", "global"])
def test_two_nodes_deliver_each_file_once_and_node_shuffle_stays_in_cache(tmp_path, shuffle):
    src = str(tmp_path / "volume")
    rels = make_files(src, 96, 1000)
    out = tmp_path / f"out-{shuffle}"
    out.mkdir()
    reports = run_two_nodes(src, str(out), shuffle, tmp_path)
    assert all(r["local_world"] == 2 for r in reports)
    assert reports[0]["cache"] == reports[1]["cache"] != reports[2]["cache"] == reports[3]["cache"]
    for epoch in range(2):
        delivered = [f for r in reports for f in r["epochs"][epoch]["files"]]
        assert sorted(delivered) == sorted(rels)  # exactly once per epoch across 2 nodes x 2 ranks
        assert len({len(r["epochs"][epoch]["files"]) for r in reports}) == 1
    first = [set(r["epochs"][0]["files"]) for r in reports]
    second = [set(r["epochs"][1]["files"]) for r in reports]
    misses_second = sum(r["epochs"][1]["misses"] for r in reports)
    if shuffle == "node":
        assert first[0] | first[1] == second[0] | second[1]  # node 0 keeps its slice
        assert misses_second == 0  # second epoch served entirely from each node's own cache
    else:
        assert misses_second > 0  # a global reshuffle sends each node files it has never seen
