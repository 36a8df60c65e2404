"""One phase of cells of the trainers table (tests/test_trainer_table.py, docs/trainers.md), on 2 CPU ranks (gloo).

    python trainer_table.py TRAINER PHASE DATA OUT CKPT CELLS          (lightning: run as it is; it starts rank 1)
    python -m torch.distributed.run --nproc_per_node 2 trainer_table.py ...       (every other trainer)

TRAINER: ``lightning`` | ``accelerate`` | ``hf`` | ``stateful`` (torchdata's StatefulDataLoader) | ``plain`` (a loop
saving its own epoch counter beside ``loader.state_dict()``). PHASE: ``save`` (epoch 0, then ``STOP`` steps of epoch
1, a checkpoint in the trainer's own way, and the run ends there: killed for Lightning, stopped for the others) or
``resume`` (a new run that resumes from it, the trainer's documented way, to the end of epoch 2). CELLS: a JSON list of
``[recipe, data]``; data is ``files`` (the ucmagic dataset itself, its paths decoded by ``collate_fn``), ``wrapper``
(the seeds' wrapper IterableDataset) or ``map`` (a user map-style dataset). Each rank writes, per cell and phase,
``{"seen": {epoch: [ids the training steps received]}, "error": ...}``. A cell's exception is a fact for the judge
(the run goes on with the next cell); a hang dumps every thread's stack (faulthandler; the test then kills the phase).
"""
from __future__ import annotations

import faulthandler
import glob
import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.utils.data as tud

import ucmagic
from trainer_common import Files, file_id  # Files: the seeds' wrapper

N = 43  # items of every kind (odd: the two ranks' shares are evened out by one padded repeat per epoch)
BATCH, WORKERS, STOP, EPOCHS = 4, 2, 2, 3
PER_EPOCH = 6  # batches per rank and epoch: 22 items (43 padded to 44) in batches of 4
HANG = int(os.environ.get("TRAINER_TABLE_HANG", "300"))  # seconds before a phase is taken as hung


# ---------------------------------------------------------------- the data, passed each way users pass it

def decode(paths: list[str]) -> dict[str, torch.Tensor]:
    """collate_fn over the ucmagic dataset itself: the paths it yields, decoded (here: each file's index)."""
    ids = [file_id(p) for p in paths]
    return {"id": torch.tensor(ids), "x": torch.tensor([[float(i % 7)] for i in ids])}


class SizedFiles(Files):
    """The wrapper with a length (HF Trainer's ``num_train_epochs`` needs ``len(train_dataset)``): the ucmagic
    dataset's, this rank's items in a whole epoch."""

    def __len__(self) -> int:
        return len(self._path_dataset)


class StatefulFiles(Files):
    """The wrapper with the two methods torchdata's StatefulDataLoader asks each worker's copy for."""

    def state_dict(self) -> dict[str, Any]:
        return self._path_dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._path_dataset.load_state_dict(state)


class Items(tud.Dataset):
    """A user map-style dataset: item i is i."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": int(i), "x": torch.tensor([float(i % 7)])}


def make_data(data: str, root: str, wrapper: type = Files) -> tuple[Any, Any]:
    """(dataset, collate_fn) for one way of passing the data."""
    if data == "map":
        return Items(), None
    files = ucmagic.UCVolumeDataset(root, shuffle=True, seed=3)
    return (files, decode) if data == "files" else (wrapper(files), None)


def uc_loader(data: str, root: str, wrapper: type = Files, **kw: Any) -> ucmagic.DataLoader:
    ds, collate = make_data(data, root, wrapper)
    return ucmagic.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=collate, **kw)


def ids_of(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"]]


# ---------------------------------------------------------------- what a cell records

class Record:
    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = {}
        self.error: dict[str, Any] | None = None

    def got(self, epoch: int, batch: Any) -> None:
        self.seen.setdefault(str(epoch), []).extend(ids_of(batch))

    def fail(self, exc: BaseException) -> None:
        self.error = {"type": type(exc).__name__, "mro": [k.__name__ for k in type(exc).__mro__],
                      "msg": str(exc)[-1500:], "tb": "".join(traceback.format_exception(exc))[-3000:]}

    def write(self, out: str, name: str, rank: int) -> None:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as f:
            json.dump({"seen": self.seen, "error": self.error}, f)


def cell_dir(ckpt: str, recipe: str, data: str) -> str:
    return os.path.join(ckpt, f"{recipe}-{data}")


def save_counter(path: str, epoch: int, step: int) -> None:
    """The loop's own bookkeeping beside the trainer's checkpoint (what every recipe keeps: epoch, step)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "loop.json"), "w") as f:
        json.dump({"epoch": epoch, "step": step}, f)


def load_counter(path: str) -> tuple[int, int]:
    with open(os.path.join(path, "loop.json")) as f:
        d = json.load(f)
    return int(d["epoch"]), int(d["step"])


# ---------------------------------------------------------------- HF Accelerate

def accelerate_cell(recipe: str, data: str, phase: str, root: str, ckpt: str, rec: Record) -> None:
    """Accelerate's checkpointing guide: ``save_state`` / ``load_state``; ``register`` registers the loader for
    checkpointing; the ``skip`` recipes resume mid-epoch with ``skip_first_batches(loader, step)`` (``epoch``: and
    call ``loader.set_epoch(epoch)`` every epoch); ``restart`` does neither (the epoch starts again)."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    loader = uc_loader(data, root)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, loader)
    if recipe in ("register", "register_skip"):
        acc.register_for_checkpointing(loader)
    where = cell_dir(ckpt, recipe, data)
    set_epochs = recipe == "skip_set_epoch"

    def step(epoch: int, batch: Any) -> None:
        loss = model(batch["x"]).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        rec.got(epoch, batch)

    if phase == "save":
        for epoch in (0, 1):
            if set_epochs:
                loader.set_epoch(epoch)
            for k, batch in enumerate(loader, 1):
                step(epoch, batch)
                if epoch == 1 and k == STOP:
                    acc.save_state(where)
                    if acc.is_main_process:
                        save_counter(where, epoch, k)
                    break
        acc.wait_for_everyone()
        return
    acc.load_state(where)
    start, done = load_counter(where)
    for epoch in range(start, EPOCHS):
        if set_epochs:
            loader.set_epoch(epoch)
        active = loader
        if epoch == start and recipe in ("register_skip", "skip_set_epoch", "skip"):
            active = acc.skip_first_batches(loader, done)
        for batch in active:
            step(epoch, batch)
    acc.wait_for_everyone()


# ---------------------------------------------------------------- HF Trainer

def hf_cell(recipe: str, data: str, phase: str, root: str, ckpt: str, rec: Record) -> None:
    """``transformers.Trainer`` on a tiny config-built model, its loader a ucmagic.DataLoader (docs/trainers.md:
    ``get_train_dataloader`` and ``get_resumed_dataloader`` overridden, the loader's state saved with each
    checkpoint); ``max_steps`` or ``num_train_epochs`` (with the wrapper's ``__len__``), then
    ``train(resume_from_checkpoint=...)``."""
    import transformers

    class Tiny(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.layer = torch.nn.Linear(1, 1)
            self.epoch = 0

        def forward(self, x: torch.Tensor, id: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # noqa: A002
            rec.got(self.epoch, {"id": id})
            return {"loss": self.layer(x).pow(2).mean()}

    class UCTrainer(transformers.Trainer):
        resume_dir: str | None = None

        def get_train_dataloader(self) -> Any:
            if getattr(self, "_uc_loader", None) is None:
                ds = self.train_dataset
                self._uc_loader = self.accelerator.prepare(ucmagic.DataLoader(
                    ds, batch_size=self.args.per_device_train_batch_size, collate_fn=self.data_collator,
                    num_workers=WORKERS))
            return self._uc_loader

        def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
            with open(os.path.join(self.resume_dir or "", "ucmagic_loader.json")) as f:
                dataloader.load_state_dict(json.load(f))
            return dataloader

    class SaveLoaderState(transformers.TrainerCallback):
        def __init__(self, trainer: UCTrainer, stop: int | None) -> None:
            self.trainer, self.stop = trainer, stop

        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.trainer.model.epoch = int(round(state.epoch or 0))

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            st = self.trainer._uc_loader.state_dict()  # every rank: it gathers what each rank received
            if state.is_world_process_zero:
                path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "ucmagic_loader.json")
                with open(path, "w") as f:
                    json.dump(st, f)
            if self.stop is not None and state.global_step >= self.stop:
                control.should_training_stop = True

    where = cell_dir(ckpt, recipe, data)
    stop = PER_EPOCH + STOP if phase == "save" else None
    epochs = (2 if phase == "save" else EPOCHS)
    length = {"max_steps": PER_EPOCH * epochs} if recipe == "max_steps" else {"num_train_epochs": epochs}
    args = transformers.TrainingArguments(
        output_dir=where, per_device_train_batch_size=BATCH, save_strategy="steps" if phase == "save" else "no",
        save_steps=stop or 1, logging_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=WORKERS,
        remove_unused_columns=False, seed=0, ddp_backend="gloo", disable_tqdm=True, **length)
    ds, collate = make_data(data, root, SizedFiles if recipe == "epochs" else Files)
    trainer = UCTrainer(model=Tiny(transformers.PretrainedConfig()), args=args, train_dataset=ds,
                        data_collator=collate or tud.default_collate)
    trainer.add_callback(SaveLoaderState(trainer, stop))
    path = None
    if phase == "resume":
        path = sorted(glob.glob(os.path.join(where, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))[-1]
        trainer.resume_dir = path
    trainer.train(resume_from_checkpoint=path)


# ---------------------------------------------------------------- torchdata's StatefulDataLoader

def stateful_cell(recipe: str, data: str, phase: str, root: str, ckpt: str, rec: Record) -> None:
    """torchdata's StatefulDataLoader as torchtitan uses it: one per rank, ``state_dict()`` saved per rank with the
    loop's epoch, ``load_state_dict()`` in the new run. ``map``: torchdata's StatefulDistributedSampler with its
    ``set_epoch`` each epoch; ``stateless``: the seeds' wrapper as it is (no state methods)."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    rank = int(os.environ.get("RANK", 0))
    ds, collate = make_data(data, root, StatefulFiles if recipe == "stateful" else Files)
    kw: dict[str, Any] = {}
    if data == "map":
        kw["sampler"] = StatefulDistributedSampler(ds, shuffle=True, seed=0)
    loader = StatefulDataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=collate, **kw)
    where = cell_dir(ckpt, recipe, data)
    start = 0
    if phase == "resume":
        start, _ = load_counter(where)
        loader.load_state_dict(torch.load(os.path.join(where, f"loader-rank{rank}.pt"), weights_only=False))
    for epoch in range(start, 2 if phase == "save" else EPOCHS):
        if data == "map":
            kw["sampler"].set_epoch(epoch)
        for k, batch in enumerate(loader, 1):
            rec.got(epoch, batch)
            if phase == "save" and epoch == 1 and k == STOP:
                os.makedirs(where, exist_ok=True)
                torch.save(loader.state_dict(), os.path.join(where, f"loader-rank{rank}.pt"))
                if rank == 0:
                    save_counter(where, epoch, k)
                return


# ---------------------------------------------------------------- a plain loop

def plain_cell(recipe: str, data: str, phase: str, root: str, ckpt: str, rec: Record) -> None:
    """A training loop of its own over ucmagic.DataLoader: it saves its epoch counter beside the loader's state
    and, in the new run, loads both and counts on from the saved epoch (no set_epoch)."""
    rank = int(os.environ.get("RANK", 0))
    loader = uc_loader(data, root)
    where = cell_dir(ckpt, recipe, data)
    start = 0
    if phase == "resume":
        with open(os.path.join(where, "state.json")) as f:
            saved = json.load(f)
        start = int(saved["epoch"])
        loader.load_state_dict(saved["loader"])
    for epoch in range(start, 2 if phase == "save" else EPOCHS):
        for k, batch in enumerate(loader, 1):
            rec.got(epoch, batch)
            if phase == "save" and epoch == 1 and k == STOP:
                state = {"epoch": epoch, "loader": loader.state_dict()}  # every rank: it gathers
                if rank == 0:
                    os.makedirs(where, exist_ok=True)
                    with open(os.path.join(where, "state.json"), "w") as f:
                        json.dump(state, f)
                return


# ---------------------------------------------------------------- Lightning

def lightning_cell(recipe: str, data: str, phase: str, root: str, ckpt: str, out: str) -> None:
    """``Trainer(strategy="ddp", devices=2)``, ``ModelCheckpoint(every_n_train_steps=...)`` ``STOP`` steps into epoch
    1, every rank killed at the next step (``os._exit``), then ``fit(ckpt_path=...)`` to the end of epoch 2."""
    import lightning
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    rec = Record()
    name = f"lightning-{recipe}-{data}-{phase}"

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            rec.got(self.current_epoch, batch)
            return self.layer(batch["x"]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return uc_loader(data, root)

    class KillAfter(Callback):
        def __init__(self, step: int) -> None:
            self.step = step

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == self.step:
                rec.write(out, name, trainer.global_rank)
                os._exit(0)

    where = cell_dir(ckpt, recipe, data)
    callbacks: list[Any] = []
    if phase == "save":
        callbacks = [ModelCheckpoint(dirpath=where, every_n_train_steps=PER_EPOCH + STOP, save_top_k=-1),
                     KillAfter(PER_EPOCH + STOP)]
    trainer = lightning.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=EPOCHS if phase == "resume"
                                else 2, callbacks=callbacks, enable_checkpointing=phase == "save", logger=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    path = sorted(glob.glob(os.path.join(where, "*.ckpt")))[-1] if phase == "resume" else None
    try:
        trainer.fit(Model(), ckpt_path=path)
    except Exception as exc:  # noqa: BLE001 - a fact for the judge
        rec.fail(exc)
    rec.write(out, name, trainer.global_rank)


CELLS = {"accelerate": accelerate_cell, "hf": hf_cell, "stateful": stateful_cell, "plain": plain_cell}


def main() -> None:
    trainer, phase, root, out, ckpt = sys.argv[1:6]
    cells = json.loads(sys.argv[6])
    # a hung phase shows where every thread of every rank stopped: no exit here, so one rank's exit does not get the
    # other killed before its own dump (CI's one hang showed rank 0 only); the test kills the phase a minute later
    faulthandler.dump_traceback_later(HANG, exit=False)
    print(f"rank {os.environ.get('RANK', 0)} is pid {os.getpid()}", flush=True)
    torch.set_num_threads(1)
    if trainer == "lightning":
        (recipe, data), = cells
        lightning_cell(recipe, data, phase, root, ckpt, out)
        return
    rank = int(os.environ.get("RANK", 0))
    if trainer in ("plain", "stateful") and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        torch.distributed.init_process_group("gloo")  # a loop of its own sets up its process group (torchrun's env)
    for recipe, data in cells:
        rec = Record()
        try:
            CELLS[trainer](recipe, data, phase, root, ckpt, rec)
        except Exception as exc:  # noqa: BLE001 - a fact for the judge
            rec.fail(exc)
        rec.write(out, f"{trainer}-{recipe}-{data}-{phase}", rank)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
