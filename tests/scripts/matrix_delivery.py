"""Child-process runner of the exactly-once matrix (tests/test_delivery_matrix.py, issue 40 item 2).

    python matrix_delivery.py SPEC.json

SPEC: ``phase`` (``before``: the run up to the resume point, saving the state as JSON; ``after``: a new
process loads it and iterates the rest), ``data`` (the generated data's paths), ``cache``, ``out`` (where
states go), ``cells``. With ``WORLD_SIZE`` > 1 in the environment (and ``RANK``, ``PG_INIT``) the process
joins a gloo group first, as a torchrun rank does. For each cell it prints ``START <id>`` then
``RESULT <json>``; ``DONE`` at the end; a cell past its deadline dumps every stack and exits (the parent
records the hang and starts a fresh child for the cells left). Facts only: tests/oracle_delivery.py judges.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import random
import sys
import time
import traceback
from typing import Any, Iterator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.environ.get("UCMAGIC_UNDER_TEST"):  # the package under test (an old tree) comes first
    sys.path.insert(0, os.environ["UCMAGIC_UNDER_TEST"])
else:
    sys.path.insert(0, REPO)

import torch  # noqa: E402 - after the path: spawn workers import this module too
import torch.utils.data as tud  # noqa: E402

BATCH, SEED, BLOCK = 4, 3, 8
MAP_STYLE = {"tar_map", "tokens", "user_map"}


def header(path: str) -> str:
    """The id a generated file starts with (its source-relative path)."""
    with open(path, "rb") as f:
        return f.read().split(b"\n", 1)[0].decode()


class Wrapper(tud.IterableDataset):
    """The seeds' pattern: a user IterableDataset decoding UCVolumeDataset's paths where it gets them."""

    def __init__(self, path_dataset: Any) -> None:
        self._path_dataset = path_dataset

    def __iter__(self) -> Iterator[str]:
        for local_path in self._path_dataset:
            yield header(local_path)


class UserMap(tud.Dataset):
    """A user map-style dataset of its own."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        return f"u{i:03d}"


class UserIter(tud.IterableDataset):
    """A user IterableDataset of its own: splits its items over ranks (RANK/WORLD_SIZE) and workers
    itself; shuffled once with a fixed seed (it knows no epochs)."""

    def __init__(self, n: int, shuffle: bool) -> None:
        self.n, self.shuffle = n, shuffle

    def __iter__(self) -> Iterator[str]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(SEED).shuffle(order)
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        wi = tud.get_worker_info()
        wid, nw = (wi.id, wi.num_workers) if wi is not None else (0, 1)
        for i in order[rank * nw + wid::world * nw]:
            yield f"v{i:03d}"


def sample_key(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


def make_dataset(kind: str, shuffle: bool, data: dict[str, Any], cache: str) -> Any:
    import ucmagic

    if kind in ("files", "wrapper"):
        ds = ucmagic.UCVolumeDataset(data["files"], shuffle=shuffle, seed=SEED, cache_dir=cache)
        return ds if kind == "files" else Wrapper(ds)
    if kind == "table":  # labels from a Parquet table, files from the volume
        return ucmagic.files_from_table(data["table"], root=data["files"], shuffle=shuffle, seed=SEED, cache_dir=cache)
    if kind == "parquet":
        return ucmagic.ParquetDataset(data["parquet"], columns=["id"], batch_size=BATCH, shuffle=shuffle, seed=SEED)
    if kind in ("tar_map", "tar_stream"):
        tars = ucmagic.TarShards(data["tars"], transform=sample_key, cache_dir=cache)
        return tars if kind == "tar_map" else tars.stream(shuffle=shuffle, seed=SEED)
    if kind == "tokens":
        return ucmagic.TokenWindows(data["tokens"], block_size=BLOCK, dtype="uint16", target=False, cache_dir=cache)
    if kind == "mix":
        a = ucmagic.TarShards(data["tars"], transform=sample_key, cache_dir=cache).stream(shuffle=shuffle, seed=SEED)
        b = ucmagic.TarShards(data["tars_b"], transform=sample_key, cache_dir=cache).stream(shuffle=shuffle, seed=SEED)
        return ucmagic.mix([a, b], weights=[0.6, 0.4], seed=SEED)
    if kind == "user_map":
        return UserMap(data["count"])
    if kind == "user_iter":
        return UserIter(data["count"], shuffle)
    raise ValueError(kind)


def make_source(c: dict[str, Any], ds: Any, world: int, workers: int) -> Any:
    """What the loop iterates: the dataset (a plain loop) or a loader over it."""
    if c["consumer"] == "plain":
        return ds
    import ucmagic

    kw: dict[str, Any] = {"num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = c["start"]
    if c["kind"] != "parquet":
        kw["batch_size"] = BATCH
    elif c["consumer"] == "torch":
        kw["batch_size"] = None  # the dataset batches rows itself
    if c["kind"] in MAP_STYLE:
        if world > 1 and c["consumer"] != "uc":  # what a torch user writes for several ranks (ucmagic's
            kw["sampler"] = tud.DistributedSampler(ds, shuffle=c["shuffle"], seed=SEED)  # loader splits itself)
        else:
            kw["shuffle"] = c["shuffle"]
    cls = ucmagic.DataLoader if c["consumer"] == "uc" else tud.DataLoader
    return cls(ds, **kw)


def plain_epoch(c: dict[str, Any], ds: Any, epoch: int) -> Iterator[Any]:
    """A plain loop's epoch: the dataset itself, or (map-style) the user's own index order."""
    if c["kind"] not in MAP_STYLE:
        yield from ds
        return
    order = list(range(len(ds)))
    if c["shuffle"]:
        random.Random(SEED * 1000 + epoch).shuffle(order)
    for i in order:
        yield ds[i]


def ids(kind: str, x: Any, batched: bool) -> list[str]:
    """The item ids in what the loop got (one item, or a batch)."""
    if kind == "parquet":
        return [f"r{int(v):03d}" for v in x["id"].tolist()]
    if kind == "tokens":
        rows = x if batched else x.unsqueeze(0)
        return [f"t{int(r[0]) // BLOCK:03d}" for r in rows]
    if kind == "table":  # an item's id is its file's, marked where its label is not that file's row's
        pairs = zip(x["path"], x["label"].tolist()) if batched else [(x["path"], x["label"])]
        return [labelled(header(p), int(label)) for p, label in pairs]
    got = list(x) if batched else [x]
    return [header(p) for p in got] if kind == "files" else [str(v) for v in got]


def labelled(rel: str, label: int) -> str:
    """``rel`` when ``label`` is its row's (the class in its folder name), else a mark the judge counts unplanned."""
    return rel if rel.split("/")[1] == f"class{label}" else f"mislabelled {rel} as {label}"


def run_epoch(c: dict[str, Any], ds: Any, source: Any, epoch: int, stop: int | None,
              save: Any) -> tuple[list[str], bool]:
    """One epoch of a training loop; at ``stop`` batches the state is saved inside the loop (``batch``,
    ``epoch1``) or after a ``break`` (``break``). Returns the ids and whether the epoch ended."""
    plain = c["consumer"] == "plain"
    batched = not plain and c["kind"] != "parquet"
    got: list[str] = []
    it = iter(plain_epoch(c, ds, epoch) if plain else source)
    complete = True
    for n, x in enumerate(it, 1):
        got += ids(c["kind"], x, batched)
        if stop is not None and n >= (stop * (BATCH if plain and c["kind"] != "parquet" else 1)):
            if c["resume"] != "break":
                save()
            complete = False
            break
    del it
    if not complete and c["resume"] == "break":
        gc.collect()
        save()
    return got, complete


def error_facts(exc: BaseException, where: str) -> dict[str, Any]:
    return {"type": type(exc).__name__, "mro": [k.__name__ for k in type(exc).__mro__], "msg": str(exc)[-2000:],
            "where": where, "tb": "".join(traceback.format_exception(exc))[-2500:]}


def before(c: dict[str, Any], spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    res: dict[str, Any] = {"id": c["id"], "rank": rank, "before": []}
    state_path = os.path.join(spec["out"], f"{c['id']}.rank{rank}.json")
    source: Any = None

    def save() -> None:
        state = source.state_dict()
        with open(state_path, "w") as f:
            json.dump(state, f)

    try:
        ds = make_dataset(c["kind"], c["shuffle"], spec["data"], spec["cache"])
        source = make_source(c, ds, world, c["workers"])
        plan = {"none": [None, None], "batch": [c["stop"]], "break": [c["stop"]], "epoch_end": [None],
                "epoch1": [None, c["stop"]]}[c["resume"]]
        for e, stop in enumerate(plan):
            got, complete = run_epoch(c, ds, source, e, stop, save)
            res["before"].append({"ids": got, "complete": complete})
        if c["resume"] == "epoch_end":
            save()
        source = ds = None  # the loader (and its workers) go before the next cell
    except BaseException as exc:  # noqa: BLE001 - a fact for the judge
        res["error"] = error_facts(exc, "before")
    gc.collect()
    return res


def after(c: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {"id": c["id"], "rank": 0}
    with open(os.path.join(spec["out"], f"{c['id']}.rank0.json")) as f:
        state = json.load(f)
    try:
        ds = make_dataset(c["kind"], c["shuffle"], spec["data"], spec["cache"])
        source = make_source(c, ds, 1, c["workers_after"])
    except BaseException as exc:  # noqa: BLE001
        res["after_error"] = error_facts(exc, "setup")
        return res
    try:
        source.load_state_dict(state)
    except BaseException as exc:  # noqa: BLE001
        res["after_error"] = error_facts(exc, "load")
        return res
    try:
        res["after"], _ = run_epoch({**c, "resume": "none"}, ds, source, 0, None, None)
        res["next"], _ = run_epoch({**c, "resume": "none"}, ds, source, 1, None, None)  # then the next, whole
    except BaseException as exc:  # noqa: BLE001
        res["after_error"] = error_facts(exc, "iterate")
    del source, ds
    gc.collect()
    return res


def mix_items(spec: dict[str, Any]) -> dict[str, Any]:
    """The mix's planned epochs (shuffled or not, epochs 0-2) from one plain pass each: a mix's
    epoch is a fixed draw of its sources' orders, the same on every layout (docs/shards.md)."""
    out = {}
    for shuffle in (False, True):
        per = {}
        for e in (0, 1, 2):
            ds = make_dataset("mix", shuffle, spec["data"], spec["cache"])
            ds.set_epoch(e)
            per[str(e)] = [str(x) for x in ds]
        out["shuf" if shuffle else "seq"] = per
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=os.environ["PG_INIT"], rank=rank, world_size=world)
    if spec.get("mix_items"):
        print("ITEMS", json.dumps(mix_items(spec)), flush=True)
    for c in spec["cells"]:
        print("START", c["id"], flush=True)
        faulthandler.dump_traceback_later(c["timeout"], exit=True)
        t0 = time.monotonic()
        res = before(c, spec, rank, world) if spec["phase"] == "before" else after(c, spec)
        res["secs"] = round(time.monotonic() - t0, 2)
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
        faulthandler.cancel_dump_traceback_later()
        print("RESULT", json.dumps(res), flush=True)
    print("DONE", flush=True)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    faulthandler.dump_traceback_later(20, exit=True)  # a hang at interpreter exit: stacks, and out


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
