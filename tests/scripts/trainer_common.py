"""What the trainer scripts share: the two dataset kinds (the seeds' files wrapper and a user
map-style dataset), items that carry their identity, and writing what each rank received."""
from __future__ import annotations

import json
import os
import re

import torch
from torch.utils.data import Dataset, IterableDataset

import ucmagic

N_MAP = 240  # items of the map-style dataset


def file_id(path: str) -> int:
    """The index make_files gave a file (its name is f<index>.bin; the first line is its own path)."""
    with open(path, "rb") as f:
        rel = f.readline().decode().strip()
    return int(re.search(r"f(\d+)", os.path.basename(rel)).group(1))


class Files(IterableDataset):
    """The seeds' pattern: wraps a UCVolumeDataset and decodes each cached path (here: its index)."""

    def __init__(self, path_dataset: ucmagic.UCVolumeDataset) -> None:
        self._path_dataset = path_dataset

    def __iter__(self):
        for p in self._path_dataset:
            i = file_id(p)
            yield {"id": i, "x": torch.tensor([float(i % 7)])}


class Items(Dataset):
    """A user map-style dataset: item i is i."""

    def __len__(self) -> int:
        return N_MAP

    def __getitem__(self, i: int):
        return {"id": int(i), "x": torch.tensor([float(i % 7)])}


def make_dataset(kind: str, data: str):
    if kind == "files":
        return Files(ucmagic.UCVolumeDataset(data, shuffle=True, seed=3))
    return Items()


def ids_of(batch) -> list[int]:
    return [int(i) for i in batch["id"]]


def write(out: str, name: str, rank: int, record: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as f:
        json.dump(record, f)
