"""The ``.metadata`` unpickler admits the named DCP metadata classes only: no payload changes anything outside
the objects it builds, and real metadata from real DCP saves still loads."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import os
import pathlib
import pickle
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucmagic.checkpoints.api import UCVolumeReader, UCVolumeWriter
from ucmagic.checkpoints.unpickle import load_metadata
from ucmagic.errors import UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MD = "torch.distributed.checkpoint.metadata"
WATCHED_MODULES = (os, torch, dataclasses, enum, dcp_md, dcp_fs, pathlib, collections)
WATCHED_CLASSES = tuple(v for v in (*vars(dcp_md).values(), dcp_fs._StorageInfo, torch.Size, pathlib.PosixPath,
                                    collections.OrderedDict) if isinstance(v, type))


def _snapshot() -> dict[str, dict[str, int]]:
    """Every attribute of the modules and classes a payload could reach, by identity (and enum members' state)."""
    snap = {f"module {m.__name__}": {k: id(v) for k, v in vars(m).items()} for m in WATCHED_MODULES}
    for cls in WATCHED_CLASSES:
        snap[f"class {cls.__qualname__}"] = {k: id(v) for k, v in vars(cls).items()}
        if issubclass(cls, enum.Enum):
            for member in cls:
                snap[f"member {member!r}"] = {k: id(v) for k, v in vars(member).items()}
    return snap


def _refused(payload: bytes) -> None:
    before = _snapshot()
    with pytest.raises(UnsafeCheckpointError, match="not checkpoint metadata"):
        load_metadata(payload)
    assert _snapshot() == before


def test_the_issues_payload_that_set_os_sep_is_refused_and_os_is_unchanged():
    _refused(b"ctorch.distributed.checkpoint.metadata\nos\n(N(dVsep\nVX\nstb.")
    assert os.sep == "/"


@pytest.mark.parametrize("payload", [
    b"ctorch.distributed.checkpoint.metadata\ntorch\n(N(dVload\nVX\nstb.",  # replace torch.load
    b"ctorch.distributed.checkpoint.metadata\ndataclass\n(ctorch.distributed.checkpoint.metadata\nMetadata\ntR.",
    b"ctorch.distributed.checkpoint.metadata\nfield\n)R.",
    b"ctorch.distributed.checkpoint.metadata\nEnum\n.",
    b"cos\nsystem\n(Vtrue\ntR.",
    b"cbuiltins\neval\n(V1\ntR.",
    b"ctorch\nload\n.",
    b"ctorch\n_dynamo\n.",  # a torch submodule, even one that loads lazily
    b"ctorch.distributed.checkpoint.metadata\nMetadata.__init__\n.",  # a dotted name reaches into a class
    b"(ios\nsystem\nVtrue\n.",  # INST
])
def test_payloads_naming_anything_but_a_metadata_class_are_refused(payload):
    _refused(payload)


@pytest.mark.parametrize("payload", [
    # BUILD on a metadata class itself (not an instance): would set a class attribute for every later load
    b"ctorch.distributed.checkpoint.metadata\nMetadata\n(N(dV__init__\nI1\nstb.",
    b"ctorch.distributed.checkpoint.metadata\nMetadata\n(N(dVstate_dict_metadata\nI1\nstb.",
    # BUILD on an enum member (a process-wide singleton)
    b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n(I0\ntR(N(dVx\nI1\nstb.",
    # BUILD on a dtype
    b"ctorch\nfloat32\n(dVx\nI1\nsb.",
    # special attributes of a fresh instance through the slot state
    b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\n)\x81(N(dV__class__\nctorch.distributed.checkpoint."
    b"metadata\nMetadata\nstb.",
])
def test_build_only_fills_in_fresh_metadata_instances(payload):
    _refused(payload)


def _real_metadata(tmp_path, writer_cls) -> bytes:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"epoch": 3, "names": ["a"]}, "step": 7,
             "ints": torch.arange(5), "half": torch.zeros(3, dtype=torch.bfloat16)}
    path = tmp_path / writer_cls.__name__
    dcp.save(state, storage_writer=writer_cls(path))
    return (path / ".metadata").read_bytes()


@pytest.mark.parametrize("writer_cls", [dcp.FileSystemWriter, UCVolumeWriter])
def test_real_metadata_from_a_real_dcp_save_loads_as_pickle_reads_it(tmp_path, writer_cls):
    raw = _real_metadata(tmp_path, writer_cls)
    assert load_metadata(raw) == pickle.loads(raw)
    reader = UCVolumeReader(tmp_path / writer_cls.__name__)
    assert set(reader.read_metadata().state_dict_metadata) == set(pickle.loads(raw).state_dict_metadata)


# ---------------------------------------------------------------- fuzz: generated pickles

_ALLOWED = [(MD, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
                               "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")] + [
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch", "float32"),
    ("torch", "strided"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"), ("builtins", "set")]
#: The namespace of the module whose every name the old unpickler allowed (os, torch, dataclass, field, Enum ...),
#: then a few names from the modules around it.
_MODULE_NAMES = [(MD, n) for n in sorted(vars(dcp_md)) if not n.startswith("__")]
_OTHER_NAMES = [(m.__name__, n) for m in (dcp_fs, os, dataclasses, enum) for n in sorted(vars(m))
                if not n.startswith("__")] + [("torch", n) for n in ("load", "save", "Tensor", "nn", "_dynamo")]


def _text(s: str) -> bytes:
    data = s.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


_GLOBAL = st.one_of(st.sampled_from(_ALLOWED), st.sampled_from(_MODULE_NAMES), st.sampled_from(_OTHER_NAMES))
_KEYS = st.sampled_from(["sep", "load", "x", "__init__", "__class__", "__dict__", "state_dict_metadata", "fqn",
                         "dtype", "field", ""])
_LEAF = st.one_of(
    _GLOBAL.map(lambda g: b"c" + f"{g[0]}\n{g[1]}\n".encode()),  # GLOBAL
    _GLOBAL.map(lambda g: _text(g[0]) + _text(g[1]) + b"\x93"),  # STACK_GLOBAL
    _KEYS.map(_text),
    st.integers(-2, 3).map(lambda i: b"J" + struct.pack("<i", i)),  # BININT
    st.just(b"N"),
)


def _compound(inner: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Snippets that push exactly one object built from others: containers, calls and state updates."""
    pairs = st.lists(st.tuples(_KEYS.map(_text), inner), max_size=3).map(lambda kv: b"".join(k + v for k, v in kv))
    mapping = pairs.map(lambda p: b"}(" + p + b"u")  # EMPTY_DICT MARK ... SETITEMS
    args = st.lists(inner, max_size=3).map(lambda xs: b"(" + b"".join(xs) + b"t")  # MARK ... TUPLE
    state = st.one_of(mapping, mapping.map(lambda m: b"N" + m + b"\x86"), inner)  # dict, (None, slots), anything
    return st.one_of(
        mapping, args,
        st.tuples(inner, args).map(lambda t: t[0] + t[1] + b"R"),  # REDUCE
        st.tuples(inner, args).map(lambda t: t[0] + t[1] + b"\x81"),  # NEWOBJ
        st.tuples(inner, state).map(lambda t: t[0] + t[1] + b"b"),  # BUILD
        st.tuples(_LEAF, state).map(lambda t: t[0] + t[1] + b"b"),  # BUILD on a global (a class, a module ...)
        st.tuples(inner, st.lists(inner, max_size=2)).map(lambda t: b"(" + t[0] + b"".join(t[1]) + b"o"),  # OBJ
        st.tuples(_GLOBAL, st.lists(inner, max_size=2)).map(  # INST
            lambda t: b"(" + b"".join(t[1]) + b"i" + f"{t[0][0]}\n{t[0][1]}\n".encode()),
        inner.map(lambda x: x + b"\x94h\x00"),  # MEMOIZE, then BINGET of the first memo entry
    )


_OBJECT = st.recursive(_LEAF, _compound, max_leaves=8)
_RAW = st.sampled_from([b"R", b"b", b"o", b"\x81", b"(", b")", b"}", b"]", b"N", b"t", b"\x85", b"\x86", b"s", b"u",
                        b"a", b"e", b"\x94", b"2", b"0"])


@settings(max_examples=int(os.environ.get("UCMAGIC_UNPICKLE_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_OBJECT, st.lists(st.one_of(_RAW, _LEAF), max_size=3))
def test_no_generated_pickle_changes_anything_outside_what_it_builds(obj, noise):
    payload = b"\x80\x04" + obj + b"".join(noise) + b"."
    before = _snapshot()
    with contextlib.suppress(Exception):  # refusing or failing is fine; changing things is not
        load_metadata(payload)
    assert _snapshot() == before
    assert os.sep == "/" and torch.load.__module__ == "torch.serialization"
