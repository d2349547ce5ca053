"""The pipelines gdsdata is compared with, each as an ``epoch()`` function for ``common.measure``.

All of them produce what gdsdata's training batches produce: random-resized-crop 224, horizontal
flip, normalised, on the GPU when there is one (float16), else on the CPU (float32).
"""

import io
import os
import pickle

import torch

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def _train_transform():
    from torchvision import transforms

    return transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                               transforms.ToTensor(), transforms.Normalize(MEAN, STD)])


def _epoch_over(loader, device):
    def epoch():
        for images, labels in loader:
            if device.type == "cuda":
                images = images.to(device, non_blocking=True).half()
                labels = labels.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return epoch


def _loader(dataset, batch, workers, device):
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                       pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                                       prefetch_factor=4 if workers > 0 else None)


def imagefolder(src, batch, workers, device):
    """torchvision ImageFolder + PIL + DataLoader: the standard recipe."""
    from torchvision.datasets import ImageFolder

    return _epoch_over(_loader(ImageFolder(src, transform=_train_transform()), batch, workers, device), device)


class LmdbImages(torch.utils.data.Dataset):
    """The common LMDB recipe: encoded images in one LMDB (``tools/make_lmdb.py``), PIL decode."""

    def __init__(self, path, transform):
        self.path, self.transform, self.env = path, transform, None
        import lmdb

        with lmdb.open(path, readonly=True, lock=False) as env, env.begin() as txn:
            self.length = int(txn.get(b"__len__"))

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        import lmdb
        from PIL import Image

        if self.env is None:  # opened in each worker
            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False, meminit=False)
        with self.env.begin() as txn:
            data, label = pickle.loads(txn.get(f"{i:08d}".encode()))
        return self.transform(Image.open(io.BytesIO(data)).convert("RGB")), label

    def __getstate__(self):
        return {**self.__dict__, "env": None}


def lmdb_pipeline(path, batch, workers, device):
    return _epoch_over(_loader(LmdbImages(path, _train_transform()), batch, workers, device), device)


def file_reads(paths, device):
    """Plain file reads of every image, then one host-to-device copy per batch of bytes (no decode):
    what storage and the copy alone cost."""
    sizes = [os.path.getsize(p) for p in paths]
    pinned = device.type == "cuda"
    staging = torch.empty(max(sizes) * 256, dtype=torch.uint8, pin_memory=pinned)
    view = staging.numpy()

    def epoch():
        for start in range(0, len(paths), 256):
            cursor = 0
            for p in paths[start:start + 256]:
                with open(p, "rb", buffering=0) as f:
                    cursor += f.readinto(memoryview(view[cursor:]))
            if pinned:
                staging[:cursor].to(device, non_blocking=True)
                torch.cuda.current_stream().synchronize()  # the staging buffer is reused next batch
        if pinned:
            torch.cuda.synchronize()

    return epoch


def dali(src, batch, threads):
    """DALI's file reader + mixed decode: decode only, and its training pipeline."""
    from nvidia.dali import fn, pipeline_def, types

    mean, std = [m * 255 for m in MEAN], [s * 255 for s in STD]

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=0, prefetch_queue_depth=2)
    def train():
        jpegs, labels = fn.readers.file(file_root=src, random_shuffle=True, name="r")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16, output_layout="CHW", mean=mean, std=std,
                                          mirror=fn.random.coin_flip())
        return images, labels

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=0, prefetch_queue_depth=2)
    def decode_only():
        jpegs, labels = fn.readers.file(file_root=src, random_shuffle=True, name="r")
        return fn.decoders.image(jpegs, device="mixed", output_type=types.RGB), labels

    return {"DALI decode only (mixed)": decode_only(), "DALI train pipeline (rrc 224, flip, norm fp16)": train()}


def dali_epoch(pipe, count, batch):
    pipe.build()
    iterations = -(-count // batch)

    def epoch():
        for _ in range(iterations):
            pipe.run()
        torch.cuda.synchronize()

    return epoch
