"""Lightning ``Trainer(strategy="ddp", devices=2, accelerator="cpu")`` over ucmagic.DataLoader, run by
tests/test_trainers.py (Lightning starts the second rank itself).

argv: kind (files|map) phase (full|save|resume) data out ckpt. ``full``: 2 epochs; ``save``: epoch 0
and ``STOP`` steps of epoch 1 with ``ModelCheckpoint(every_n_train_steps=...)`` at that step, then
the processes are killed (``os._exit``) before the next step; ``resume``: ``fit(ckpt_path=...)``
to the end of epoch 2. Each rank writes the ids its training_step received per epoch.
"""
import glob
import os
import sys

import lightning
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import ucmagic
from trainer_common import make_dataset, ids_of, write

STOP = 5


class Model(lightning.LightningModule):
    def __init__(self, kind: str, data: str) -> None:
        super().__init__()
        self.kind, self.data = kind, data
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[str, list[int]] = {}

    def training_step(self, batch, _):
        self.seen.setdefault(str(self.current_epoch), []).extend(ids_of(batch))
        return self.layer(batch["x"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return ucmagic.DataLoader(make_dataset(self.kind, self.data), batch_size=8, num_workers=2)


class KillAfter(Callback):
    """Ends every rank the way a killed job ends, at the start of the step after ``step``."""

    def __init__(self, step: int, out: str, name: str) -> None:
        self.step, self.out, self.name = step, out, name

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            write(self.out, self.name, trainer.global_rank, module.seen)
            os._exit(0)


def main() -> None:
    kind, phase, data, out, ckpt = sys.argv[1:6]
    per_epoch = {"files": 13, "map": 15}[kind]  # batches per rank and epoch (200 files, 240 items; 2 ranks of 8)
    model = Model(kind, data)
    name = f"lightning-{kind}-{phase}"
    callbacks: list[Callback] = []
    if phase == "save":
        step = per_epoch + STOP
        callbacks = [ModelCheckpoint(dirpath=ckpt, every_n_train_steps=step, save_top_k=-1),
                     KillAfter(step, out, name)]
    trainer = lightning.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=3 if phase == "resume" else 2,
                        callbacks=callbacks, enable_checkpointing=phase == "save", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    path = sorted(glob.glob(os.path.join(ckpt, "*.ckpt")))[-1] if phase == "resume" else None
    trainer.fit(model, ckpt_path=path)
    write(out, name, trainer.global_rank, model.seen)


if __name__ == "__main__":
    main()
