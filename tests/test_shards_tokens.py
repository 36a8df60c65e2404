"""TokenWindows hands out exactly the stored token values, or refuses with an error that names what it
found and what to pass: one property over generated dtypes, byte orders, file kinds and values."""
from __future__ import annotations

import os
import re
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucmagic.errors import InvalidArgumentError, ShardFormatError, UCMagicError
from ucmagic.shards import TokenWindows
from ucmagic.shards.tokens import check_npy_dtype, is_token_dtype, token_dtype

EXAMPLES = 400 if os.environ.get("UCMAGIC_MATRIX") == "full" else 50

INTS = [o + k for o in "<>" for k in ("u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8")]
OTHERS = ["<f2", "<f4", ">f4", "<f8", "?", "<c8", "<U3", "|S2", "<M8[s]", "<m8[s]"]
STORED = INTS + OTHERS


def values_of(dt: np.dtype, draw: st.DrawFn, n: int) -> np.ndarray:
    """``n`` values of ``dt``: integers over the whole range (uint64 beyond int64 included), floats with
    fractions, and the odd kinds as whatever fits."""
    if dt.kind in "iu":
        info = np.iinfo(dt)
        vals = draw(st.lists(st.one_of(st.integers(info.min, info.max), st.sampled_from([info.min, info.max, 0])),
                             min_size=n, max_size=n))
        return np.asarray(vals, dtype=dt)
    if dt.kind == "f":
        vals = draw(st.lists(st.floats(-1000, 1000, width=8 * dt.itemsize, allow_nan=False), min_size=n, max_size=n))
        return np.asarray(vals, dtype=dt)
    if dt.kind == "O":
        return np.asarray(draw(st.lists(st.integers(0, 10), min_size=n, max_size=n)) + [None], dtype=object)[:n]
    return np.asarray(draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)), dtype="<i8").astype(dt)


@st.composite
def token_dirs(draw: st.DrawFn) -> dict:
    """A passed dtype, files (each .bin written in the passed dtype, or .npy with its own stored type) and a block."""
    passed = draw(st.sampled_from(STORED))
    files = []
    for k in range(draw(st.integers(1, 3))):
        npy = draw(st.booleans())
        stored = (draw(st.sampled_from([passed, passed, *STORED, "|O"])) if npy else passed)
        n = draw(st.integers(1, 12))
        files.append((f"f{k}.{'npy' if npy else 'bin'}", np.dtype(stored), values_of(np.dtype(stored), draw, n)))
    return {"passed": passed, "files": files, "block": draw(st.integers(1, 4)), "target": draw(st.booleans())}


def write(root: str, files: list) -> None:
    for name, _, vals in files:
        path = os.path.join(root, name)
        if name.endswith(".npy"):
            np.save(path, vals, allow_pickle=True)
        else:
            with open(path, "wb") as f:
                f.write(vals.tobytes())


def exact_expected(case: dict) -> bool:
    """True where reading must succeed: every file holds the passed integer type exactly, every value fits
    int64, and there is at least one window."""
    dt = np.dtype(case["passed"])
    if not is_token_dtype(dt) or any(stored != dt for _, stored, _ in case["files"]):
        return False
    vals = [int(v) for _, _, a in case["files"] for v in a.tolist()]
    return max(vals) <= np.iinfo(np.int64).max and len(vals) - int(case["target"]) >= case["block"]


@pytest.mark.timeout(300)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=token_dirs())
def test_a_token_read_equals_the_token_stored_or_a_named_error(case):
    root = tempfile.mkdtemp(prefix="ucm-tok-")
    try:
        data, cache = os.path.join(root, "t"), os.path.join(root, "c")
        os.makedirs(data)
        write(data, case["files"])
        stored = [v for _, _, a in case["files"] for v in a.tolist()]
        block, target = case["block"], case["target"]
        try:
            ds = TokenWindows(data, block_size=block, dtype=case["passed"], target=target, cache_dir=cache)
            got = [ds[i].tolist() for i in range(len(ds))]
        except UCMagicError as exc:
            assert not exact_expected(case), f"refused a readable case: {exc}"
            msg = str(exc)
            advice = re.search(r"pass dtype=('[^']+')", msg)
            if advice and "not integer tokens" not in msg:  # the advice must not be what the user passed
                assert advice.group(1) != repr(case["passed"]) and np.dtype(eval(advice.group(1))) != np.dtype(  # noqa: S307 - a quoted dtype name from our own message
                    case["passed"]), msg
                assert is_token_dtype(np.dtype(eval(advice.group(1)))), msg  # noqa: S307 - as above
            return
        n = len(stored) - int(target)
        assert len(got) == n // block
        for i, w in enumerate(got):  # Python values: 2.5 != 2, 2**64 - 1 != -1
            assert w == stored[i * block: i * block + block + int(target)], (i, w)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("bad", ["float32", "float64", np.float16, "bool", "object", "U4", "complex64"])
def test_a_non_integer_dtype_is_refused_naming_it_and_the_integer_types(bad):
    with pytest.raises(InvalidArgumentError) as err:
        token_dtype(bad)
    msg = str(err.value)
    assert np.dtype(bad).name in msg and "'uint16'" in msg and "'uint32'" in msg


def test_an_unknown_dtype_name_is_refused_with_the_names_to_pass():
    with pytest.raises(InvalidArgumentError, match="not a numpy dtype.*'uint16'"):
        token_dtype("uint12")


def test_a_big_endian_npy_names_its_byte_order_and_the_dtype_that_reads_it(tmp_path):
    (tmp_path / "t").mkdir()
    np.save(tmp_path / "t" / "x.npy", np.arange(100, dtype=">u2"))
    with pytest.raises(ShardFormatError, match=r"big-endian uint16 \('>u2'\).*pass dtype='>u2'"):
        TokenWindows(tmp_path / "t", block_size=4, dtype="uint16", cache_dir=str(tmp_path / "c"))
    ds = TokenWindows(tmp_path / "t", block_size=4, dtype=">u2", cache_dir=str(tmp_path / "c"))
    assert ds[3].tolist() == list(range(12, 17))


def test_an_npy_of_objects_or_floats_says_to_save_integers():
    for dt in ("O", "<f4"):
        with pytest.raises(ShardFormatError, match="not integer tokens: save the token ids as integers"):
            check_npy_dtype(np.dtype(dt), np.dtype("uint16"), "x.npy")


def test_a_cut_short_npy_is_refused_not_read_past_its_end(tmp_path):
    (tmp_path / "t").mkdir()
    path = tmp_path / "t" / "x.npy"
    np.save(path, np.arange(1000, dtype=np.uint16))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(ShardFormatError, match="cut short: its header promises 1000 values"):
        TokenWindows(tmp_path / "t", block_size=4, cache_dir=str(tmp_path / "c"))


def test_a_uint64_token_beyond_int64_is_refused_where_it_is_read(tmp_path):
    (tmp_path / "t").mkdir()
    vals = np.arange(40, dtype=np.uint64)
    vals[25] = 2**64 - 1
    np.save(tmp_path / "t" / "x.npy", vals)
    ds = TokenWindows(tmp_path / "t", block_size=4, dtype="uint64", cache_dir=str(tmp_path / "c"))
    assert ds[0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ShardFormatError, match=r"x.npy holds token 18446744073709551615 \(token 25 of the file\)"):
        ds[6]
