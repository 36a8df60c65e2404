"""TarShards hands out exactly the samples `webdataset` reads from the same tar: one property over generated
member names (dots in folders and extensions, upper case, long and non-ASCII names), empty members and
members across chunk edges. Where webdataset refuses (an extension repeated within a sample), a pure model of
the documented rule (a repeated extension starts a new sample) is the oracle."""
from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucmagic.shards import TarShards

wds = pytest.importorskip("webdataset")

EXAMPLES = 300 if os.environ.get("UCMAGIC_MATRIX") == "full" else 40
CHUNK = 1024
KEYS = ["000001", "a/000002", "d.v1/000003", "x.y/z.w/000004", "é/000005", "L" * 120 + "/000006"]
EXTS = ["jpg", "JPG", "json", "seg.png", "tar.gz", "Cls", "cls"]
SIZES = [0, 1, 511, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK]


def model(members: list[tuple[str, bytes]]) -> list[dict]:
    """The documented grouping over (name, data) in tar order: key = path up to the first dot of the base
    name, extension lower-cased, a new sample when the key changes or an extension repeats."""
    out: list[dict] = []
    for name, data in members:
        base = name.rsplit("/", 1)[-1]
        key = name[:len(name) - len(base)] + base.split(".", 1)[0]
        ext = base.split(".", 1)[1].lower()
        if not out or out[-1]["__key__"] != key or ext in out[-1]:
            out.append({"__key__": key})
        out[-1][ext] = data
    return out


@pytest.mark.timeout(300)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.one_of(st.just(0), st.integers(0, len(KEYS) - 1)),  # runs of one key are common
                          st.sampled_from(EXTS), st.sampled_from(SIZES), st.integers(0, 255)), min_size=1, max_size=12))
def test_tarshards_samples_equal_webdatasets_or_the_model_where_it_refuses(spec):
    members = [(f"{KEYS[k]}.{ext}", bytes([fill]) * size) for k, ext, size, fill in spec]
    root = tempfile.mkdtemp(prefix="ucm-wds-")
    try:
        os.makedirs(os.path.join(root, "s"))
        path = os.path.join(root, "s", "shard-000000.tar")
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
            for name, data in members:
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
        ds = TarShards(os.path.join(root, "s"), cache_dir=os.path.join(root, "c"), chunk_size=CHUNK)
        got = [{k: v for k, v in ds[i].items() if k != "__url__"} for i in range(len(ds))]
        want = model(members)
        assert got == want
        try:
            ref = [{k: v for k, v in s.items() if k != "__url__" and not k.startswith("__local")}
                   for s in wds.WebDataset(path, shardshuffle=False)]
        except ValueError as exc:  # webdataset refuses an extension repeated within a sample
            assert "duplicate" in str(exc)
            return
        assert got == ref
    finally:
        shutil.rmtree(root, ignore_errors=True)
