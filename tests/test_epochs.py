"""The planned-dataset contract (ucmagic.files.epochs) and the one rank/world helper (ucmagic.dist)."""
import json
import os
from unittest import mock

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import IterableDataset

from ucmagic.files.dataset import UCVolumeDataset
from ucmagic.dist import DistInfo, all_gather_ints, dist_info
from ucmagic.errors import ListingChangedError
from ucmagic.files.epochs import EpochTracking
from ucmagic.files.planned import LoaderNeeds, PlannedDataset, StateSchema, check_state_kind
from ucmagic.loading.loader import DataLoader


class Epochs(EpochTracking):
    """EpochTracking alone: the epoch half of the contract, no data."""

    shuffle = False

    def __init__(self):
        self._init_epochs()


# ---------------------------------------------------------------- rank and world

@given(st.integers(1, 64).flatmap(lambda w: st.tuples(st.integers(0, w - 1), st.just(w), st.integers(1, w))))
def test_dist_info_reads_torchrun_variables_without_a_process_group(args):
    rank, world, lws = args
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(lws)}
    with mock.patch.dict(os.environ, env):
        os.environ.pop("LOCAL_RANK", None)
        info = dist_info()
        assert info == DistInfo(rank, world, rank % lws, lws, 0, 1)
        assert dist_info(from_env=False)[:2] == (0, 1)  # what collectives see: no group, one process


def test_dist_info_is_rank_zero_of_one_in_a_plain_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert dist_info() == DistInfo(0, 1, 0, 1, 0, 1)


def test_gathering_progress_of_several_ranks_needs_a_process_group():
    assert all_gather_ints([3, 4], 1) == [3, 4]
    with pytest.raises(RuntimeError, match="init_process_group"):
        all_gather_ints([3, 4], 2)


# ---------------------------------------------------------------- epochs, in the loader's call order

def test_epochs_count_up_per_iteration_unless_set_or_handed_over():
    ds = Epochs()
    assert ds.upcoming_epoch() == 0 and ds.begin_epoch() == 0
    assert ds.upcoming_epoch() == 1 and ds.begin_epoch() == 1
    assert ds.begin_epoch(hand_over=True) == 2
    assert ds.begin_epoch() == 2  # the dataset's own __iter__ after a hand-over: the same epoch
    ds.set_epoch(7)
    assert ds.upcoming_epoch() == 7 and ds.begin_epoch() == 7 and ds.begin_epoch() == 7  # set_epoch wins
    ds.finish_epoch(9)
    assert ds.upcoming_epoch() == 10 and ds.epoch == 10


def test_configure_sets_the_quantum_and_leases():
    ds = Epochs()
    ds.configure(batch_quantum=8, lease_items=56)
    assert (ds.batch_quantum, ds.lease_items) == (8, 56)


# ---------------------------------------------------------------- states carry a kind

def test_a_state_of_another_kind_is_refused_and_one_without_kind_is_accepted():
    check_state_kind({"version": 1}, "UCVolumeDataset")  # saved before states carried a kind
    check_state_kind({"kind": "parquet"}, "ParquetDataset", "parquet")
    with pytest.raises(ValueError, match="UCVolumeDataset"):
        check_state_kind({"kind": "UCVolumeDataset"}, "ParquetDataset", "parquet")


def test_both_planned_datasets_speak_the_protocol_and_a_plain_one_does_not(tree, tmp_path):
    from ucmagic.tables import ParquetDataset

    class Plain(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    root, _ = tree
    pd.DataFrame({"id": np.arange(50)}).to_parquet(tmp_path / "t.parquet")
    files = UCVolumeDataset(root)
    rows = ParquetDataset(str(tmp_path / "t.parquet"), batch_size=10)
    assert isinstance(files, PlannedDataset) and isinstance(rows, PlannedDataset)
    assert not isinstance(Plain(), PlannedDataset)
    assert files.make_state(0, [0], world=1, num_workers=1)["kind"] == "UCVolumeDataset"
    assert rows.make_state(0, [0], world=1, num_workers=1)["kind"] == "ParquetDataset"
    with pytest.raises(ValueError):
        rows.load_state_dict(files.make_state(0, [0], world=1, num_workers=1))
    with pytest.raises(ValueError):
        files.load_state_dict(rows.make_state(0, [0], world=1, num_workers=1))


def test_a_files_state_saved_before_states_carried_a_kind_still_resumes(tree):
    # unshuffled: its order is the listing's in every version, so the array-free order (issue 16) resumes it too
    root, _ = tree
    ds = UCVolumeDataset(root)
    everything = list(ds)
    n = len(everything)
    old = {  # the exact format UCVolumeDataset.state_dict() wrote before "kind" was added
        "version": 1, "epoch": 0, "seed": 0, "shuffle": False, "partition": "pad", "files": n,
        "fingerprint": ds.fingerprint, "order_world": 1, "order_local_world": 1, "reshuffle_every": None,
        "pool": [[30, n]], "remaining": n - 30,
    }
    fresh = UCVolumeDataset(root)
    fresh.load_state_dict(old)
    assert list(fresh) == everything[30:]
    loader = DataLoader(UCVolumeDataset(root), batch_size=10, num_workers=0)
    loader.load_state_dict({"version": 1, "kind": "UCVolumeDataset", "dataset": old, "batches": 3, "step": 3})
    assert [p for b in loader for p in b] == everything[30:]


def test_a_parquet_state_with_the_old_kind_still_resumes(tmp_path):
    from ucmagic.tables import ParquetDataset

    pd.DataFrame({"id": np.arange(50)}).to_parquet(tmp_path / "t.parquet")
    ds = ParquetDataset(str(tmp_path / "t.parquet"), batch_size=10)
    state = ds.make_state(0, [20], world=1, num_workers=1)
    state["kind"] = "parquet"  # how ParquetDataset states were spelled before the kinds were unified
    ds.load_state_dict(state)
    assert np.concatenate([b["id"].numpy() for b in ds]).tolist() == list(range(20, 50))


# ---------------------------------------------------------------- what a kind declares, and its state schema

def test_the_loader_follows_what_each_kind_declares_not_its_name(tree, tmp_path):
    from ucmagic.loading.loader import default_num_workers
    from ucmagic.tables import ParquetDataset

    class OwnProcess(UCVolumeDataset):  # a new kind: files decoded in the loop's own process
        kind = "OwnProcess"
        loader_needs = LoaderNeeds(num_workers=0)

    root, _ = tree
    pd.DataFrame({"id": np.arange(50)}).to_parquet(tmp_path / "t.parquet")
    rows = ParquetDataset(str(tmp_path / "t.parquet"), batch_size=10)
    files, own = UCVolumeDataset(root), OwnProcess(root)
    assert rows.loader_needs.yields_batches and not files.loader_needs.yields_batches
    for ds, batch_size, workers in ((rows, None, 0), (files, 1, default_num_workers()), (own, 1, 0)):
        loader = DataLoader(ds)
        assert (loader.batch_size, loader.num_workers) == (batch_size, workers)
        assert loader.state_dict()["kind"] == ds.kind  # the kinds saved states carry keep their names
    assert DataLoader(rows).state_dict()["dataset"]["kind"] == "ParquetDataset"
    with pytest.raises(ValueError, match="ParquetDataset yields whole batches"):
        DataLoader(rows, batch_size=4)


SCHEMA = StateSchema("Things", 3, "things", older=(2,), legacy_kinds=("things",))


@given(st.integers(0, 9), st.lists(st.tuples(st.integers(0, 50), st.integers(1, 50)), max_size=4),
       st.integers(0, 2**31), st.sampled_from(["pad", "drop"]))
def test_a_state_built_by_the_schema_carries_the_common_keys_and_checks_back(epoch, spans, seed, partition):
    left = [(a, a + n) for a, n in spans]
    state = SCHEMA.build(epoch, left, seed=seed, partition=partition, fingerprint="f1", count=77, extra="x")
    assert state == {"version": 3, "kind": "Things", "epoch": epoch, "seed": seed, "partition": partition,
                     "fingerprint": "f1", "things": 77, "extra": "x", "pool": [list(r) for r in left],
                     "remaining": sum(n for _, n in spans)}
    assert json.loads(json.dumps(state)) == state
    SCHEMA.check(state, fingerprint="f1", count=77, what="the things")


def test_the_schema_refuses_other_kinds_versions_and_changed_files_and_takes_old_spellings():
    state = SCHEMA.build(1, [(0, 5)], seed=0, partition="pad", fingerprint="f1", count=5)
    kindless = {k: v for k, v in state.items() if k != "kind"}  # saved before states carried a kind
    for old in ({**state, "version": 2}, {**state, "kind": "things"}, kindless):  # older version, old spelling
        SCHEMA.check(old, fingerprint="f1", count=5, what="the things")
    with pytest.raises(ValueError, match="saved by a Other dataset, not a Things"):
        SCHEMA.check({**state, "kind": "Other"}, fingerprint="f1", count=5, what="the things")
    with pytest.raises(ValueError, match="unsupported Things state version 4"):
        SCHEMA.check({**state, "version": 4}, fingerprint="f1", count=5, what="the things")
    with pytest.raises(ListingChangedError, match=r"the things changed since this state was saved \(5 things then, 6"):
        SCHEMA.check(state, fingerprint="f1", count=6, what="the things")
    with pytest.raises(ListingChangedError):
        SCHEMA.check(state, fingerprint="f2", count=5, what="the things")
    strict = StateSchema("Things", 3, "things", kind_required=True)
    with pytest.raises(ValueError, match="not a Things state"):
        strict.check(kindless, fingerprint="f1", count=5, what="the things")


def test_a_parquet_state_from_before_node_shuffling_still_resumes_in_its_order(tmp_path):
    from ucmagic.tables import ParquetDataset

    pd.DataFrame({"id": np.arange(200)}).to_parquet(tmp_path / "t.parquet", row_group_size=20)
    make = lambda: ParquetDataset(str(tmp_path / "t.parquet"), batch_size=10, shuffle="global", seed=4)  # noqa: E731
    whole = np.concatenate([b["id"].numpy() for b in make()]).tolist()
    state = make().make_state(0, [60], world=1, num_workers=1)
    for key in ("order_world", "order_local_world", "shuffle_option", "reshuffle_every"):
        del state[key]  # what a state saved before node shuffling lacks
    state["shuffle"], state["kind"] = True, "parquet"
    ds = make()
    ds.load_state_dict(state)
    assert np.concatenate([b["id"].numpy() for b in ds]).tolist() == whole[60:]


# ---------------------------------------------------------------- a loaded state: armed, taken once, spent

class Planned(Epochs):
    """EpochTracking with the epoch plan of ``n`` items and its states (StateSchema), no data."""

    kind, partition, batch_quantum, seed, reshuffle_every = "Planned", "pad", 1, 0, None
    state_schema = StateSchema("Planned", 1, "items")

    def __init__(self, n=10):
        super().__init__()
        self.n = n

    def epoch_items(self, epoch):
        return self.n

    def epoch_plan(self, epoch):
        return self._resumed_pool(epoch, self.n), None

    def make_state(self, epoch, delivered, *, world, num_workers):
        return self._planned_state(epoch, self.epoch_plan(epoch)[0], delivered, world=world, num_workers=num_workers,
                                   fingerprint="f", count=self.n)

    def load_state_dict(self, state):
        self._resume_from(state)


def test_a_loaded_state_applies_to_the_next_iteration_only():
    """torchdata's rule: the state loaded applies once, to the next iteration; the one after is the next epoch."""
    saved = Planned().make_state(3, [4], world=1, num_workers=1)
    ds = Planned()
    ds.load_state_dict(saved)
    assert ds.upcoming_epoch() == 3 and ds.begin_epoch() == 3 and ds.epoch_plan(3)[0] == [(4, 10)]
    assert ds.begin_epoch() == 4 and ds.epoch_plan(4)[0] == [(0, 10)]
    ds.set_epoch(3)  # epoch 3 again, on purpose: whole (the state was spent)
    assert ds.begin_epoch() == 3 and ds.epoch_plan(3)[0] == [(0, 10)]


def test_a_loaded_state_another_iteration_took_is_spent_at_the_next_iteration():
    """Issue 49, 2: another loader's workers (Accelerate's SkipDataLoader, torch's loader) took the loaded state (a
    token in shared memory); this copy's next iteration is the next epoch, whole (before: the old rest again)."""
    ds = Planned()
    ds.load_state_dict(Planned().make_state(1, [4], world=1, num_workers=1))
    worker = Planned.__new__(Planned)  # a worker's copy: the same shared memory, its own attributes
    worker.__dict__.update(ds.__dict__, _resume=dict(ds._resume))
    worker._take_resume(1)  # a worker of another loader's iteration starts epoch 1 with the rest
    assert worker.epoch_plan(1)[0] == [(4, 10)]
    assert ds.upcoming_epoch() == 2 and ds.begin_epoch() == 2 and ds.epoch_plan(2)[0] == [(0, 10)]
    assert ds.epoch_plan(1)[0] == [(0, 10)]


@pytest.mark.parametrize("ended", [False, True])
def test_a_state_saved_at_the_last_item_resumes_into_an_empty_rest_unless_the_loop_had_ended(ended):
    saved = {**Planned().make_state(2, [10], world=1, num_workers=1), "ended": ended}
    ds = Planned()
    ds.load_state_dict(saved)
    if ended:  # the loop had seen the end: the next iteration is the next epoch
        assert ds.begin_epoch() == 3 and ds.epoch_plan(3)[0] == [(0, 10)]
    else:  # at the last item, the loop still running: the empty rest of epoch 2, then epoch 3
        assert ds.begin_epoch() == 2 and ds.epoch_plan(2)[0] == []
        assert ds.begin_epoch() == 3 and ds.epoch_plan(3)[0] == [(0, 10)]


def test_a_streams_own_state_resumes_that_stream_only_on_its_layout(monkeypatch):
    """A rank's plain loop (or a StatefulDataLoader worker) saves its own stream's position; the same stream
    resumes it, another layout is refused by name."""
    from ucmagic.errors import ResumeLayoutError

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = Planned(11)
    ds._open_progress(ds.begin_epoch()).count = 3
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["stream"] == {"world": 2, "rank": 1, "num_workers": 1, "worker": 0, "partition": "pad",
                               "quantum": 1, "delivered": 3}
    fresh = Planned(11)
    fresh.load_state_dict(state)
    assert fresh.begin_epoch() == 0 and fresh._stream_ranges(0, 1, 2, 0, 1) == [(9, 11), (0, 1)]  # 6..11 + pad
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ResumeLayoutError, match="same num_workers and world size"):
        Planned(11).load_state_dict(state)
