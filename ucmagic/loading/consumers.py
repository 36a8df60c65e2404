"""What the code iterating a ``ucmagic.DataLoader`` holds that the loader cannot see: batches a
trainer takes ahead of its training step (the count a resume must not call trained)."""
from __future__ import annotations

import inspect
from typing import Any

import torch.utils.data as tud

# Consumers known to take one batch ahead of the one their training step uses (the module that calls
# iter() on the loader): Lightning's fit loop fetches the next batch before it runs the current one,
# to know which batch is last; its CombinedLoader is what iterates each loader.
LOOKAHEAD_CALLERS = ("lightning.pytorch.utilities.combined_loader", "pytorch_lightning.utilities.combined_loader")


def caller_lookahead(loader: tud.DataLoader[Any], depth: int = 4) -> int:
    """Batches the code iterating ``loader`` holds ahead of the one it uses: 1 under Lightning when the
    loader has no length (its fetcher reads one batch ahead to learn which is last), else 0.

    Seen from the module that called ``iter()`` (a few frames up): a loader has no other way to learn
    that a received batch has not reached the training step yet.
    """
    try:
        len(loader)
        return 0  # a known length: Lightning counts the batches and fetches none ahead
    except (TypeError, NotImplementedError):
        pass
    here = inspect.currentframe()
    frame = here.f_back.f_back if here is not None and here.f_back is not None else None  # __iter__'s caller
    for _ in range(depth):
        if frame is None:
            break
        if frame.f_globals.get("__name__") in LOOKAHEAD_CALLERS:
            return 1
        frame = frame.f_back
    return 0
