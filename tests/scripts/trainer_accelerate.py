"""HF Accelerate over ucmagic.DataLoader on 2 CPU ranks (gloo), run by tests/test_trainers.py under
torch.distributed.run.

argv: kind (files|map) phase (full|save|resume) data out ckpt. ``full``: 2 epochs; ``save``: epoch 0,
then ``STOP`` steps of epoch 1, ``save_state`` and exit; ``resume``: ``load_state``, the rest of
epoch 1, then epoch 2. Each rank writes the ids it received per epoch.
"""
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DistributedSampler

import ucmagic
from trainer_common import make_dataset, ids_of, write

STOP = 5


def main() -> None:
    kind, phase, data, out, ckpt = sys.argv[1:6]
    acc = Accelerator(cpu=True)
    ds = make_dataset(kind, data)
    extra = {"sampler": DistributedSampler(ds, shuffle=True, seed=0)} if kind == "map" else {}
    loader = ucmagic.DataLoader(ds, batch_size=8, num_workers=2, **extra)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.register_for_checkpointing(loader)
    seen: dict[str, list[int]] = {}

    def run_epoch(epoch: int, stop: int | None = None, set_epoch: bool = True) -> None:
        if kind == "map" and set_epoch:
            loader.set_epoch(epoch)  # torch's rule for a DistributedSampler; the files wrapper needs none
        got = seen.setdefault(str(epoch), [])
        for step, batch in enumerate(loader):
            loss = model(batch["x"]).pow(2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            got += ids_of(batch)
            if stop is not None and step + 1 == stop:
                acc.save_state(ckpt)
                return

    if phase == "full":
        run_epoch(0)
        run_epoch(1)
    elif phase == "save":
        run_epoch(0)
        run_epoch(1, stop=STOP)
    else:
        acc.load_state(ckpt)
        run_epoch(1, set_epoch=False)  # the loaded state names the epoch
        run_epoch(2)
    write(out, f"accelerate-{kind}-{phase}", acc.process_index, seen)
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
