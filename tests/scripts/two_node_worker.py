"""Run by torchrun in tests/test_multinode.py: each rank iterates a UCVolumeDataset for 2 epochs and
writes what it delivered and how many files it fetched from the volume, per epoch."""
import json
import os
import sys

import torch.distributed as dist

from ucmagic import UCVolumeDataset


def main() -> None:
    src, out, shuffle = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = UCVolumeDataset(src, shuffle=shuffle, seed=11)
    report = {"rank": rank, "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
              "cache": ds.cache.root, "epochs": []}
    for epoch in range(2):
        ds.set_epoch(epoch)
        before = ds.stats()["misses"]
        got = []
        for p in ds:
            with open(p, "rb") as f:
                got.append(f.readline().decode().strip())
        dist.barrier()  # the other local rank has finished filling the node's cache too
        report["epochs"].append({"files": got, "misses": ds.stats()["misses"] - before})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
