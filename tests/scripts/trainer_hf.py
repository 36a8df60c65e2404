"""HF ``transformers.Trainer`` on a tiny model built from a config (no download), 2 CPU ranks (gloo)
under torch.distributed.run, its train loader a ucmagic.DataLoader (tests/test_trainers.py).

argv: kind (files|map) phase (full|save|resume) data out ckpt. ``full``: 2 epochs; ``save``: a
checkpoint every 18 steps (5 steps into epoch 1), stopped there; ``resume``:
``train(resume_from_checkpoint=...)`` to the end of epoch 2. Each rank writes the ids its training
steps received per epoch.
"""
import glob
import json
import os
import sys

import torch
import transformers
from torch.utils.data import DistributedSampler

import ucmagic
from trainer_common import make_dataset, write

PER_EPOCH = {"files": 13, "map": 15}  # batches per rank and epoch (200 files, 240 items; 2 ranks of 8)
STATE = "ucmagic_loader.json"


class Tiny(transformers.PreTrainedModel):
    config_class = transformers.PretrainedConfig

    def __init__(self, config):
        super().__init__(config)
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[str, list[int]] = {}
        self.epoch = 0

    def forward(self, x, id=None):  # noqa: A002 - the batch's key
        self.seen.setdefault(str(self.epoch), []).extend(int(i) for i in id)
        return {"loss": self.layer(x).pow(2).mean()}


class UCTrainer(transformers.Trainer):
    """The Trainer's loader is a ucmagic.DataLoader (Accelerate leaves it split per rank); its state
    is saved with each checkpoint and loaded on resume (instead of skipping batches again)."""

    resume_dir: str | None = None

    def get_train_dataloader(self):
        if getattr(self, "_uc_loader", None) is None:
            ds = self.train_dataset
            extra = {"sampler": DistributedSampler(ds, shuffle=True, seed=0)} if not isinstance(
                ds, torch.utils.data.IterableDataset) else {}
            self._uc_loader = self.accelerator.prepare(ucmagic.DataLoader(
                ds, batch_size=self.args.per_device_train_batch_size, collate_fn=self.data_collator, num_workers=2,
                **extra))
        return self._uc_loader

    def get_resumed_dataloader(self, dataloader, num_batches):
        with open(os.path.join(self.resume_dir, STATE)) as f:
            dataloader.load_state_dict(json.load(f))
        return dataloader


class SaveLoaderState(transformers.TrainerCallback):
    def __init__(self, trainer: UCTrainer, stop: int | None) -> None:
        self.trainer, self.stop = trainer, stop

    def on_epoch_begin(self, args, state, control, **kw):
        self.trainer.model.epoch = int(round(state.epoch or 0))  # the loader has a length: epochs are whole

    def on_save(self, args, state, control, **kw):
        st = self.trainer._uc_loader.state_dict()  # every rank: it gathers what each rank received
        if state.is_world_process_zero:
            with open(os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE), "w") as f:
                json.dump(st, f)
        if self.stop is not None and state.global_step >= self.stop:
            control.should_training_stop = True


def main() -> None:
    kind, phase, data, out, ckpt = sys.argv[1:6]
    per_epoch = PER_EPOCH[kind]
    stop = per_epoch + 5 if phase == "save" else None
    args = transformers.TrainingArguments(
        output_dir=ckpt, per_device_train_batch_size=8, max_steps=per_epoch * (3 if phase == "resume" else 2),
        save_strategy="steps" if phase == "save" else "no", save_steps=stop or 1, logging_strategy="no",
        report_to=[], use_cpu=True, dataloader_num_workers=2, remove_unused_columns=False, seed=0,
        ddp_backend="gloo", disable_tqdm=True)
    model = Tiny(transformers.PretrainedConfig())
    trainer = UCTrainer(model=model, args=args, train_dataset=make_dataset(kind, data),
                        data_collator=torch.utils.data.default_collate)
    trainer.add_callback(SaveLoaderState(trainer, stop))
    path = None
    if phase == "resume":
        path = sorted(glob.glob(os.path.join(ckpt, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))[-1]
        trainer.resume_dir = path
    trainer.train(resume_from_checkpoint=path)
    write(out, f"hf-{kind}-{phase}", trainer.args.process_index, model.seen)


if __name__ == "__main__":
    main()
