"""torch's own DataLoader over the seeds' files wrapper, prepared by HF Accelerate (which splits the
data over the ranks again, though each rank's UCVolumeDataset already reads only its share): the
first batch raises SplitTwiceError with the fix, in Accelerate's dispatching mode (rank 0 reads for
both; the other rank reads nothing) and with ``dispatch_batches=False`` (IterableDatasetShard on each
rank), with worker processes. Then the fix: ucmagic.DataLoader, each epoch exact.

argv: data out
"""
import faulthandler
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration

import ucmagic
from trainer_common import make_dataset, write

faulthandler.dump_traceback_later(120, exit=True)  # a hang shows where it stopped
data, out = sys.argv[1:3]
results = {}
for dispatch in (True, False):
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
    rank = acc.process_index
    loader = acc.prepare(torch.utils.data.DataLoader(make_dataset("files", data), batch_size=8, num_workers=2))
    if dispatch and rank != 0:  # rank 0 reads for every rank and raises before any broadcast
        results[f"dispatch={dispatch}"] = "not read here"
    else:
        try:
            next(iter(loader))
            results[f"dispatch={dispatch}"] = "no error"
        except ucmagic.SplitTwiceError as e:
            results[f"dispatch={dispatch}"] = str(e)
    acc.wait_for_everyone()
acc = Accelerator(cpu=True)
loader = acc.prepare(ucmagic.DataLoader(make_dataset("files", data), batch_size=8, num_workers=2))
results["fixed"] = [int(i) for b in loader for i in b["id"]]
write(out, "split-twice", acc.process_index, results)
