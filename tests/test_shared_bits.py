"""The one per-file bitset (ucmagic._shared.SharedBits): exact bits, one memory with workers, copies of their own."""
import multiprocessing as mp
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucmagic._shared import SharedBits


@given(st.integers(1, 2000).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1)),
                                                          st.sets(st.integers(0, n - 1)))))
def test_bits_hold_exactly_what_was_set_one_by_one_or_many_at_once(case):
    n, one, many = case
    bits = SharedBits(n)
    for i in one:
        bits.add(i)
    bits.add_many(np.array(sorted(many), dtype=np.int64))
    want = one | many
    assert {i for i in range(n) if i in bits} == want
    assert set(np.flatnonzero(bits.known(np.arange(n)))) == want
    order = sorted(want)[:7] + list(range(n))[::-89]
    assert bits.prefix(order) == next((k for k, i in enumerate(order) if i not in want), len(order))
    bits.clear()
    assert not bits.known(np.arange(n)).any() and bits.prefix([]) == 0


def test_a_plain_pickle_is_a_copy_with_its_own_memory():
    bits = SharedBits(100)
    bits.add(42)
    copy = pickle.loads(pickle.dumps(bits))
    assert copy.n == 100 and 42 in copy
    copy.add(7)
    assert 7 not in bits  # fresh memory: the original does not see the copy's bits


def _set_bit(bits: SharedBits, i: int) -> None:
    bits.add(i)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_process_shares_the_bits_with_its_parent(method):
    bits = SharedBits(64)
    bits.add(1)
    p = mp.get_context(method).Process(target=_set_bit, args=(bits, 63))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert 63 in bits and 1 in bits and bits.prefix([1, 63, 2]) == 2
