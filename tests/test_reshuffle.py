"""Issue 13 item 5: a UCVolumeDataset wrapped in the user's IterableDataset reshuffles every iteration."""
from __future__ import annotations

import pytest
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import IterableDataset

from ucmagic import DataLoader, UCVolumeDataset
from ucmagic.testing import make_files


class Wrapped(IterableDataset):
    """The seed's ImageDataset pattern: decode each cached path (here: read its first line)."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        for p in self.inner:
            with open(p, "rb") as f:
                yield f.readline().decode().strip()


class Passthrough(IterableDataset):
    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        yield from self.inner


def epoch_orders(tmp_path, make_loader, epochs=2):
    root = str(tmp_path / "vol")
    make_files(root, 24, 200, depth=0)
    ds = UCVolumeDataset(root, shuffle=True, seed=4, cache_dir=str(tmp_path / "c"))
    loader = make_loader(Wrapped(Passthrough(ds)))  # any wrapper depth
    orders = [[x for b in loader for x in b] for _ in range(epochs)]
    refs = []
    for e in range(epochs):
        ref = UCVolumeDataset(root, shuffle=True, seed=4, cache_dir=str(tmp_path / "c"))
        ref.set_epoch(e)
        refs.append([x for b in TorchLoader(Wrapped(ref), batch_size=4, num_workers=2, multiprocessing_context="fork",
                                            collate_fn=list) for x in b])
    return orders, refs


@pytest.mark.parametrize("kind,persistent,method", [("torch", True, "spawn"), ("torch", False, "spawn"),
                                                    ("ucmagic", True, "forkserver"), ("ucmagic", False, "fork")])
def test_wrapped_dataset_follows_the_next_epoch_each_iteration(tmp_path, kind, persistent, method):
    cls = TorchLoader if kind == "torch" else DataLoader
    orders, refs = epoch_orders(tmp_path, lambda w: cls(w, batch_size=4, num_workers=2, persistent_workers=persistent,
                                                        multiprocessing_context=method, collate_fn=list))
    assert orders == refs  # epoch e's order, identical to what any rank computes for (seed, e)
    assert orders[0] != orders[1]


def test_explicit_set_epoch_still_wins_for_a_wrapped_dataset(tmp_path):
    root = str(tmp_path / "vol")
    make_files(root, 16, 200, depth=0)
    ds = UCVolumeDataset(root, shuffle=True, seed=1, cache_dir=str(tmp_path / "c"))
    loader = TorchLoader(Wrapped(ds), batch_size=4, num_workers=2, persistent_workers=True, collate_fn=list)
    ds.set_epoch(5)
    first = [x for b in loader for x in b]
    second = [x for b in loader for x in b]
    assert first == second and ds.epoch == 5
