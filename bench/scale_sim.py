"""Simulate ucmagic's partitioning from 1 to 1,000 nodes: cache hit rate, volume reads, balance.

    python bench/scale_sim.py [--files 100_000_000] [--ranks-per-node 8] [--workers 4] [--epochs 4]

Pure computation over the real plan functions (``ucmagic.files.plan``), no I/O:

- *balance* (items per rank and per worker stream) comes from ``plan.stream_spans`` at full scale —
  O(ranks x workers), never O(files);
- *hit rate* per epoch for ``shuffle="node"`` and ``"global"`` comes from an exact LRU simulation of
  node 0's cache over the real epoch orders (``plan.epoch_order``/``node_blocks``/
  ``stream_positions``) with the real number of nodes, at a reduced number of files per node
  (``--sim-share``) that keeps the ratios that decide hit rates: the node's share of the data and
  the cache size relative to that share.

Bytes read from the volume per node and epoch = share x (1 - hit rate) x file size.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucmagic.files import plan


def simulate_node_hits(nodes: int, share: int, cache_files: int, epochs: int, mode: str, local: int = 8,
                       seed: int = 0) -> list[float]:
    """Exact LRU simulation of node 0's cache over ``epochs`` epochs; returns its hit rate per epoch."""
    world = nodes * local
    n = nodes * share
    blocks = plan.node_blocks(n, world, local, "pad")
    lru: OrderedDict[int, None] = OrderedDict()
    rates = []
    for epoch in range(epochs):
        order = plan.epoch_order(n, seed=seed, epoch=epoch, shuffle=mode, blocks=blocks)
        files = []
        for r in range(local):  # node 0's ranks
            files.append(order[plan.positions(plan.stream_positions([(0, n)], world, r, 1, 0, "pad"))])
        hits = total = 0
        # ranks of a node read concurrently: interleave their streams
        for i in range(max(len(f) for f in files)):
            for f in files:
                if i < len(f):
                    x = int(f[i])
                    total += 1
                    if x in lru:
                        hits += 1
                        lru.move_to_end(x)
                    else:
                        lru[x] = None
                        if len(lru) > cache_files:
                            lru.popitem(last=False)
        rates.append(hits / total if total else 0.0)
    return rates


def balance(files: int, world: int, workers: int, batch: int) -> tuple[int, int, int, int]:
    spans = plan.stream_spans(files, world, workers, "pad", batch)
    per_rank = [sum(b - a for a, b in spans[r * workers:(r + 1) * workers]) for r in range(world)]
    per_stream = [b - a for a, b in spans]
    return min(per_rank), max(per_rank), min(per_stream), max(per_stream)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=100_000_000)
    ap.add_argument("--file-kib", type=int, default=150)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--nodes", default="1,8,64,1000")
    ap.add_argument("--cache-ratios", default="0.5,2.0", help="node cache size / node's share of the data")
    ap.add_argument("--sim-share", type=int, default=2000, help="files per node in the reduced-scale simulation")
    a = ap.parse_args()
    t0 = time.perf_counter()
    print(f"{a.files:,} files of {a.file_kib} KiB, {a.ranks_per_node} ranks/node x {a.workers} workers, "
          f"batch {a.batch}, {a.epochs} epochs\n")
    hdr = (f"{'nodes':>5s} {'cache/share':>11s} {'mode':>6s} "
           + " ".join(f"{'hit e' + str(e + 1):>7s}" for e in range(a.epochs))
           + f" {'GB read/node e2+':>16s} {'items/rank min..max':>21s} {'stream min..max':>17s}")
    print(hdr)
    print("-" * len(hdr))
    for nodes in [int(x) for x in a.nodes.split(",")]:
        world = nodes * a.ranks_per_node
        share = a.files // nodes
        rmin, rmax, smin, smax = balance(a.files, world, a.workers, a.batch)
        for ratio in [float(x) for x in a.cache_ratios.split(",")]:
            cache_sim = int(a.sim_share * ratio)
            for mode in ("node", "global"):
                rates = simulate_node_hits(nodes, a.sim_share, cache_sim, a.epochs, mode, a.ranks_per_node)
                later = sum(rates[1:]) / max(1, len(rates) - 1)
                gb = share * (1 - later) * a.file_kib * 1024 / 1e9
                label = "both" if nodes == 1 else mode
                print(f"{nodes:5d} {ratio:11.1f} {label:>6s} " + " ".join(f"{r:7.1%}" for r in rates)
                      + f" {gb:16.1f} {rmin:>10,d}..{rmax:<10,d} {smin:>8,d}..{smax:<8,d}")
                if nodes == 1:
                    break  # one node: both modes are the same global permutation
    state_pool = plan.remaining_pool([(0, a.files)], 1000 * a.ranks_per_node, a.workers, "pad", a.batch,
                                     [a.batch] * (1000 * a.ranks_per_node * a.workers))
    print(f"resume state at 1,000 nodes: {len(state_pool):,} ranges "
          f"({len(state_pool) * 2 * 8 / 1e6:.2f} MB as int64 pairs)"
          f" — one range per stream, independent of the number of files")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
