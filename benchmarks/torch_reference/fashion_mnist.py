#!/usr/bin/python3
"""Fashion-MNIST MLP or CNN in PyTorch: the same work as examples/fashion_mnist.cpp.

The reference that benchmarks/run compares build/examples/fashion_mnist (and, with --model
cnn, build/examples/fashion_mnist_cnn) against.

    /usr/bin/python3 benchmarks/torch_reference/fashion_mnist.py --epochs 1
    /usr/bin/python3 benchmarks/torch_reference/fashion_mnist.py --world-size 2 --epochs 5 --lr 0.1
    /usr/bin/python3 benchmarks/torch_reference/fashion_mnist.py --model cnn --epochs 5

The work, identical to ours: MLP 784-256-128-10 with ReLU (or the CNN
Conv(1->32, 3)-ReLU-MaxPool(2)-Conv(32->64, 3)-ReLU-MaxPool(2)-Flatten-Linear(1600, 128)-ReLU-
Dropout(0.1)-Linear(128, 10) on [N, 1, 28, 28] views of the same rows), CrossEntropyLoss, SGD with
momentum (and weight decay; defaults equal ours: 10 epochs, lr 0.05 on a per-step cosine schedule, momentum 0.9), DistributedSampler (shuffle, seed + epoch) over the 60,000
training images, batch size per rank (default 64), images kept as uint8 and converted per
batch as pixel / 255, read from the same gzipped IDX files with gzip + numpy (no
torchvision). World size > 1 wraps the model in DistributedDataParallel on gloo (Debian's
torch has no MPI); world size 1 trains the plain model in one process, as PyTorch users do.

Rank 0 ends with one JSON line
    {"example":"fashion_mnist" (or "fashion_mnist_cnn"),"framework":"torch","world_size":W,"epochs":E,"threads":T,
     "test_accuracy":a,"train_loss":l,"samples_per_s":s,"peak_rss_mb":m}
samples_per_s = all ranks' training samples in the last epoch / that epoch's training-loop
wall time (the slowest rank's; startup, data loading and evaluation excluded).
train_loss = mean batch loss of the last epoch over all ranks. test_accuracy counts every
test image exactly once across ranks (rank r takes images r, r+W, ...; no padding).
peak_rss_mb = max over ranks of each rank's peak resident set (ru_maxrss).

Batches are gathered by indexing the uint8 tensor with the sampler's indices, not through
torch.utils.data.DataLoader: DataLoader's per-sample __getitem__ + collate costs more than
the MLP step here, and the point is to measure PyTorch at its best.
"""

import argparse
import gzip
import json
import os
import resource
import struct
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from launch import emit, run_ranks, set_threads


IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801


def read_idx(path, magic):
    """IDX file (gzipped or raw) -> uint8 numpy array shaped by its header."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    (found,) = struct.unpack(">I", data[:4])
    if found != magic:
        raise ValueError(f"{path}: magic 0x{found:08x}, expected 0x{magic:08x}")
    ndim = found & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header promises {int(np.prod(dims))} bytes, file has {body.size}")
    return body.reshape(dims)


def load(data_dir, train):
    prefix = "train" if train else "t10k"
    images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"), IMAGES_MAGIC)
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"), LABELS_MAGIC)
    # images: (N, 784) uint8, labels: (N,) int64
    return (torch.from_numpy(images.reshape(images.shape[0], -1).copy()),
            torch.from_numpy(labels.astype(np.int64)))


class NormalizedImages(torch.nn.Module):
    """Rows of 784 pixels in [0, 1] -> (x - mean) / std as [N, 1, 28, 28], as
    torchvision's Normalize((0.2860,), (0.3530,)) and fashion_mnist_cnn's first step."""

    def forward(self, x):
        return ((x - 0.2860) / 0.3530).reshape(x.shape[0], 1, 28, 28)


def make_model(kind):
    if kind == "cnn":
        return torch.nn.Sequential(
            NormalizedImages(),
            torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(1600, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(128, 10))
    return torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10))


def train(rank, world_size, args):
    set_threads(args.threads)
    distributed = world_size > 1
    if distributed:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(args.seed)
    train_x, train_y = load(args.data_dir, True)
    test_x, test_y = load(args.data_dir, False)
    model = make_model(args.model)
    net = DistributedDataParallel(model) if distributed else model
    loss_fn = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    sampler = DistributedSampler(range(train_x.shape[0]), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    bs = args.batch_size
    steps_per_epoch = (len(sampler) + bs - 1) // bs
    # ours: lr follows a cosine from --lr to 0 over all steps (CosineAnnealingLR per batch)
    scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)
                 if args.schedule == "cosine" else None)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        indices = torch.tensor(list(iter(sampler)), dtype=torch.int64)
        net.train()
        loss_sum = 0.0
        steps = 0
        start = time.perf_counter()
        for b in range(0, indices.shape[0], bs):
            idx = indices[b:b + bs]
            x = train_x[idx].float().div_(255.0)
            y = train_y[idx]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(net(x), y)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            loss_sum += loss.item()
            steps += 1
        seconds = time.perf_counter() - start
        samples = indices.shape[0]

        # Evaluation: every test image exactly once across ranks.
        net.eval()
        correct = 0
        with torch.no_grad():
            mine = torch.arange(rank, test_x.shape[0], world_size)
            for b in range(0, mine.shape[0], 1000):
                idx = mine[b:b + 1000]
                pred = model(test_x[idx].float().div_(255.0)).argmax(dim=1)
                correct += int((pred == test_y[idx]).sum())
        stats = torch.tensor([loss_sum, steps, correct, samples], dtype=torch.float64)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        if distributed:
            dist.all_reduce(stats)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        train_loss = stats[0].item() / stats[1].item()
        accuracy = stats[2].item() / test_x.shape[0]
        samples_per_s = stats[3].item() / slowest.item()
        if rank == 0:
            emit(f"epoch {epoch + 1}/{args.epochs} train_loss {train_loss:.4f} "
                 f"test_accuracy {accuracy:.4f} samples/s {samples_per_s:.0f}")

    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    if distributed:
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        example = "fashion_mnist_cnn" if args.model == "cnn" else "fashion_mnist"
        emit(json.dumps({"example": example, "framework": "torch",
                         "world_size": world_size, "epochs": args.epochs,
                         "threads": args.threads, "test_accuracy": accuracy,
                         "train_loss": train_loss, "samples_per_s": samples_per_s,
                         "peak_rss_mb": rss.item()}))
    if distributed:
        dist.destroy_process_group()



def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--threads", type=int, default=1,
                   help="torch and OpenBLAS threads per rank (launch.set_threads; see benchmarks/README.md)")
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    args = p.parse_args()
    run_ranks(train, args.world_size, args)


if __name__ == "__main__":
    main()
