"""UCVolumeDataset over the node's memory-mapped listing: small to pickle, listed once, streamed in chunks."""
import os
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader as TorchLoader

from test_listing import CountingVolume, SyntheticVolume, age
from ucmagic import ResumeOrderError, UCVolumeDataset
from ucmagic.files import plan
from ucmagic.files.cache_layout import entry_file
from ucmagic.files.dataset import StreamItems
from ucmagic.files.listing import open_listing
from ucmagic.testing import make_files


class _SpawnPopen:
    """Stands in for the Popen of a process being spawned, so shared memory pickles as a handle."""

    def __init__(self):
        self.fds = []

    def duplicate_for_child(self, fd):
        self.fds.append(fd)
        return fd

    def DupFd(self, fd):  # noqa: N802 - multiprocessing's name
        from multiprocessing.resource_sharer import DupFd

        return DupFd(fd)


def pickled_for_a_worker(obj) -> bytes:
    """``obj`` pickled as multiprocessing pickles it into a spawned DataLoader worker."""
    from multiprocessing import context, reduction

    context.set_spawning_popen(_SpawnPopen())
    try:
        return bytes(reduction.ForkingPickler.dumps(obj))
    finally:
        context.set_spawning_popen(None)


def test_pickled_dataset_stays_under_100kb_at_200k_files(tmp_path):
    ds = UCVolumeDataset(SyntheticVolume(200_000, per_dir=500), cache_dir=str(tmp_path / "c"), shuffle=True)
    small = UCVolumeDataset(SyntheticVolume(10), cache_dir=str(tmp_path / "c"), shuffle=True)
    blob = pickled_for_a_worker(ds)
    assert len(ds) == 200_000 and len(blob) < 100_000
    # a plain pickle copies the fixed-size shared counters but nothing that grows with the files
    assert abs(len(pickle.dumps(ds)) - len(pickle.dumps(small))) < 1000
    back = pickle.loads(blob)
    assert len(back) == 200_000 and back.fingerprint == ds.fingerprint
    assert back.describe_item(199_999) == ds.describe_item(199_999)
    assert ds.total_bytes == sum(e.size for e in ds.listing.iter_entries())


def test_spawned_workers_map_the_listing_instead_of_listing_again(tmp_path):
    root = str(tmp_path / "vol")
    rels = make_files(root, 40, 100, depth=1)
    age(root)
    tally = tmp_path / "tally"
    tally.mkdir()
    vol = CountingVolume(root, str(tally))
    ds = UCVolumeDataset(vol, cache_dir=str(tmp_path / "c"), shuffle=True)
    loader = TorchLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="spawn", collate_fn=list)
    got = [os.path.relpath(p, root) for batch in loader for p in batch]
    assert len(got) == len(rels)
    assert vol.scans() == 1  # the main process listed; the workers mapped its file
    again = UCVolumeDataset(vol, cache_dir=str(tmp_path / "c"))  # a restart on an unchanged tree
    assert vol.scans() == 1 and again.fingerprint == ds.fingerprint
    UCVolumeDataset(vol, cache_dir=str(tmp_path / "c"), relist=True)
    assert vol.scans() == 2


def test_a_state_saved_under_the_old_order_is_refused_with_a_clear_error(tmp_path):
    ds = UCVolumeDataset(SyntheticVolume(50), cache_dir=str(tmp_path / "c"), shuffle=True)
    state = ds.make_state(0, [10], world=1, num_workers=1)
    assert state["order_version"] == plan.ORDER_VERSION
    old = {k: v for k, v in state.items() if k != "order_version"}
    old["version"] = 1
    with pytest.raises(ResumeOrderError, match="epoch-order version 1"):
        ds.load_state_dict(old)
    ds.load_state_dict(state)  # the current one resumes: the rest of epoch 0
    assert ds.epoch_plan(0)[0] == [(10, 50)] and len(ds) == 50  # len(): a whole epoch's (torchdata's rule)


def test_listing_progress_goes_to_the_callback_and_by_default_to_stderr(tmp_path, capsys):
    seen = []
    UCVolumeDataset(SyntheticVolume(3000, delay=0.05), cache_dir=str(tmp_path / "a"), listing_progress=seen.append)
    assert seen and seen[-1] == 3000
    UCVolumeDataset(SyntheticVolume(3000, delay=0.05), cache_dir=str(tmp_path / "b"))
    err = capsys.readouterr().err
    assert "listing synthetic://" in err and "3,000" in err
    final = [line for line in err.splitlines() if "3,000" in line]
    assert len(final) == 1  # in a log, the finished listing is one line, not one per draw and close
    assert float(final[0].split()[-2]) >= 1.0  # the time since the listing began, not since the line appeared


@pytest.fixture(scope="module")
def listing(tmp_path_factory):
    return open_listing(SyntheticVolume(997, per_dir=50), None, str(tmp_path_factory.mktemp("c")))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 4), workers=st.integers(1, 3), chunk=st.integers(1, 64), seed=st.integers(0, 9),
       shuffle=st.sampled_from([False, True, "node"]), data=st.data())
def test_stream_items_match_the_epoch_order_in_any_access_order(listing, world, workers, chunk, seed, shuffle, data):
    n = len(listing)
    blocks = plan.node_blocks(n, world, 1) if shuffle == "node" else None

    def order(pos):
        return plan.order_at(n, pos, seed=seed, epoch=3, shuffle=shuffle, blocks=blocks)

    rank, worker = data.draw(st.integers(0, world - 1)), data.draw(st.integers(0, workers - 1))
    ranges = plan.stream_positions([(0, n)], world, rank, workers, worker)
    keys = lambda idx: [(k, ".x") for k in listing.keys(idx)]  # noqa: E731
    items = StreamItems(listing, ranges, order, keys, "v0", chunk=chunk)
    want = order(plan.positions(ranges)).tolist()
    assert len(items) == len(want)
    visit = data.draw(st.permutations(range(len(want))))
    assert [items.index(p) for p in visit] == [want[p] for p in visit]
    assert [items.entry(p) for p in visit[:50]] == listing.entries([want[p] for p in visit[:50]])
    lo = data.draw(st.integers(0, len(want)))
    hi = data.draw(st.integers(lo, len(want)))
    assert items.names(lo, hi) == [entry_file("", "", e.size, e.path, "v0")
                                   for e in listing.entries(np.array(want[lo:hi], dtype=np.int64))]
    assert [i for c in items.indices_chunks() for i in c.tolist()] == want


def test_a_stream_keeps_a_bounded_number_of_decoded_chunks(listing):
    from ucmagic.files.dataset import STREAM_CHUNKS_KEPT

    decoded = []

    class Counting:  # the listing, counting the chunks a stream decodes
        sizes = listing.sizes
        mtimes = listing.mtimes
        all_plain = listing.all_plain

        def paths(self, idx):
            decoded.append(len(idx))
            return listing.paths(idx)

    n = len(listing)
    items = StreamItems(Counting(), [(0, n)], lambda pos: pos, lambda idx: [(f"{i:040x}", "") for i in idx], "v0",
                        chunk=16)
    assert [items.entry(p).path for p in range(n)] == [e.path for e in listing.iter_entries()]
    assert len(decoded) == -(-n // 16)  # each chunk decoded once on a sequential pass
    items.entry(0)  # chunk 0 was dropped long ago: decoded again, not held for the whole stream
    assert len(decoded) == -(-n // 16) + 1
    last = (n - 1) // 16
    for c in range(last - STREAM_CHUNKS_KEPT + 2, last + 1):  # still held: the newest chunks
        items.entry(c * 16)
    assert len(decoded) == -(-n // 16) + 1
