"""One rank of the distributed test (tests/test_distributed.py): torch.distributed with gloo, the rank
and world size taken from the environment exactly as under torchrun, through gdsdata's public API."""

import json
import os
import sys

import torch.distributed as dist

import gdsdata


def main(dataset, out, batch_size, drop_last):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = gdsdata.GDSDataset(dataset)
    loader = gdsdata.Loader(ds, batch_size, shuffle="full", seed=11, drop_last=drop_last,
                            transform=gdsdata.CenterCrop(16, 18, dtype="uint8"))
    planned = [b.tolist() for b in loader.indices()]
    labels = []
    for step, (images, batch_labels) in enumerate(loader):
        assert images.shape[1:] == (3, 16, 16)
        labels.append(batch_labels.tolist())
        dist.barrier()  # a rank with fewer batches would hang here, as DDP would
    report = {"rank": rank, "node": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
              "planned": planned, "labels": labels, "targets": [[ds.targets[i] for i in b] for b in planned]}
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    loader.close()
    dist.barrier()  # every rank past its last collective before any tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
