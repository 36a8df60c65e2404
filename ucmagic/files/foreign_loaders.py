"""Other projects' loaders seen from inside a planned dataset's iteration: HF Accelerate's splitters and
``skip_first_batches``, torchdata's ``StatefulDataLoader``, and the refusals a combination that cannot be
exact gets at its first batch (:class:`~ucmagic.errors.SplitTwiceError`,
:class:`~ucmagic.errors.ResumeRecipeError`). Cheap: nothing is looked at unless that project is imported.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any

from ..dist import dist_info, worker_info
from ..errors import ResumeRecipeError, SplitTwiceError

__all__ = ["accelerate_skipping", "is_stateful", "refuse_split_twice", "refuse_stateless_wrapper"]


# HF Accelerate's wrappers that split a loader's data over the ranks (again, for a ucmagic dataset)
_ACCELERATE_SPLITTERS = ("IterableDatasetShard", "DataLoaderShard", "DataLoaderDispatcher")


# Accelerate's loader that skip_first_batches makes over an iterable dataset (a torch DataLoader iterating it again)
_ACCELERATE_SKIPPERS = ("SkipDataLoader", "SkipBatchSampler")


def _accelerate_splitter(depth: int = 16, names: tuple[str, ...] = _ACCELERATE_SPLITTERS) -> str | None:
    """The Accelerate class (of ``names``: splitting over the ranks by default) iterating the dataset now, or None.

    Seen in the frames that iterate the dataset (``IterableDatasetShard`` in a worker or the main
    process, a dispatcher's fetch) or, in a worker forked by such a loader, as the loader Accelerate
    marked active when it started. Cheap: nothing is looked at unless Accelerate is imported.
    """
    if "accelerate.data_loader" not in sys.modules:
        return None
    frame = inspect.currentframe()
    for _ in range(depth):
        if frame is None:
            break
        if frame.f_globals.get("__name__") == "accelerate.data_loader":
            owner = frame.f_locals.get("self")
            name = type(owner).__name__ if owner is not None else frame.f_code.co_name
            if name in names:
                return name
        frame = frame.f_back
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    refs = shared.get("_dataloader_references_ref") if isinstance(shared, dict) else None
    active = refs[-1]() if refs and refs[-1] is not None else None  # GradientState.active_dataloader
    name = type(active).__name__ if active is not None else ""
    # only when that loader is the one this worker serves (a loader left mid-epoch stays marked active)
    served = getattr(worker_info(), "dataset", None)
    if name in names and served is not None and getattr(active, "dataset", None) is served:
        return name
    return None


def accelerate_skipping() -> str | None:
    """The Accelerate class of ``skip_first_batches`` (SkipDataLoader, SkipBatchSampler) iterating now, or None."""
    return _accelerate_splitter(24, _ACCELERATE_SKIPPERS)


def _stateful_loader_dataset(depth: int = 24) -> tuple[bool, Any]:
    """``(True, the dataset it was given)`` when torchdata's StatefulDataLoader iterates the dataset now (in
    its worker loop, or its single-process iterator), else ``(False, None)``: the dataset is the one torch's
    fetcher iterates. Nothing is looked at unless torchdata's StatefulDataLoader is imported."""
    if "torchdata.stateful_dataloader" not in sys.modules:
        return False, None
    frame = inspect.currentframe()
    top = None
    for _ in range(depth):
        if frame is None:
            break
        module = str(frame.f_globals.get("__name__", ""))
        if module == "torch.utils.data._utils.fetch" and top is None:
            top = getattr(frame.f_locals.get("self"), "dataset", None)
        elif module.startswith("torchdata.stateful_dataloader"):
            return True, top
        frame = frame.f_back
    return False, None


def is_stateful(obj: Any) -> bool:
    """``obj`` has ``state_dict`` and ``load_state_dict`` (torchdata's ``Stateful``: it saves and restores it)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def refuse_stateless_wrapper(ds: Any) -> None:
    """Raise :class:`~ucmagic.errors.ResumeRecipeError` when torchdata's StatefulDataLoader iterates ``ds`` (a
    ucmagic dataset) through a user's wrapper without ``state_dict``/``load_state_dict``: it would resume that
    wrapper by fetching and dropping the batches it delivered, which replays the epoch ``ds`` is on then (epoch 0
    in a new process), not the saved one."""
    under, top = _stateful_loader_dataset()
    if not under or top is None or top is ds or is_stateful(top):
        return
    attr = next((k for k, v in vars(top).items() if v is ds), None) if hasattr(top, "__dict__") else None
    inner = f"self.{attr}" if attr else f"the {ds.kind} it wraps"
    raise ResumeRecipeError(
        f"torchdata's StatefulDataLoader iterates your {type(top).__name__} around a {ds.kind}, and your wrapper has "
        "no state_dict/load_state_dict: it would resume by fetching and dropping the delivered batches, which "
        f"replays the epoch the {ds.kind} is on then (epoch 0 in a new process), not the saved one. Give the "
        f"wrapper the two methods, forwarding to the {ds.kind}: `def state_dict(self): return {inner}.state_dict()` "
        f"and `def load_state_dict(self, state): {inner}.load_state_dict(state)` (each worker then resumes its own "
        "stream exactly, nothing fetched twice), or use ucmagic.DataLoader (docs/loading.md)")


def refuse_split_twice(kind: str) -> None:
    """Raise :class:`~ucmagic.errors.SplitTwiceError` when HF Accelerate splits over the ranks an
    iteration of a ucmagic dataset (``kind``) that already reads only this rank's share."""
    if dist_info().world <= 1:
        return
    splitter = _accelerate_splitter()
    if splitter is not None:
        raise SplitTwiceError(
            f"HF Accelerate's {splitter} splits this {kind} over the ranks again, but each rank already reads "
            "only its share (most of every epoch would be lost): pass ucmagic.DataLoader(dataset, ...) to "
            "accelerator.prepare (it is left as it is); under HF Trainer, override get_train_dataloader as in "
            "docs/trainers.md")
