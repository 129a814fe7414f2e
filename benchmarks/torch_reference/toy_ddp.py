#!/usr/bin/python3
"""The classic PyTorch DDP tutorial, corrected the same way as examples/toy_ddp.cpp.

The reference that benchmarks/run times against build/examples/toy_ddp (whole-process
wall time, `import torch` included) and whose final parameters it compares with ours.

    /usr/bin/python3 benchmarks/torch_reference/toy_ddp.py --world-size 2
    /usr/bin/python3 benchmarks/torch_reference/toy_ddp.py --init-weight 0.5 --init-bias 0

The work, identical to ours: ToyDataset of 100 pairs x = (i - 50)/50, y = 2x (the tutorial's
raw (i, 2i) with lr 0.01 diverges); Linear(1, 1) (the tutorial's Linear(2, 1) is a shape
error on 1-feature inputs); DistributedSampler without shuffle; batch 8 per rank; MSELoss;
SGD lr 0.4; 10 epochs (benchmarks/run passes its own); gloo. Each rank prints `Rank r, Epoch [e], Loss: v` per epoch and
ends with one JSON line
    {"example":"toy_ddp","rank":r,"world_size":W,"weight":w,"bias":b,"loss":l}
where loss is the last batch's loss on that rank.

Launch: world size 1 runs in this process (no extra interpreter); larger worlds fork the
ranks from this process after `import torch`, so each rank does not pay the import again.
Both choices favour PyTorch: the tutorial's mp.spawn re-imports torch in every rank.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from launch import emit, run_ranks, set_threads



class ToyDataset(Dataset):
    def __init__(self, size=100):
        half = size // 2
        self.x = (torch.arange(size, dtype=torch.float32).unsqueeze(1) - half) / half
        self.y = 2.0 * self.x

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def train(rank, world_size, args):
    # Torch's default intra-op pool would oversubscribe 2 cores with 2 ranks.
    set_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        if args.init_weight is not None:
            model.weight.fill_(args.init_weight)
        if args.init_bias is not None:
            model.bias.fill_(args.init_bias)
    ddp = DistributedDataParallel(model)
    dataset = ToyDataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    loss_fn = torch.nn.MSELoss()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    loss = torch.tensor(float("nan"))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
        emit(f"Rank {rank}, Epoch [{epoch + 1}], Loss: {loss.item():.6f}")
    emit(json.dumps({"example": "toy_ddp", "framework": "torch", "rank": rank,
                     "world_size": world_size, "weight": model.weight.item(),
                     "bias": model.bias.item(), "loss": loss.item()}))
    dist.destroy_process_group()



def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--init-weight", type=float, default=None)
    p.add_argument("--init-bias", type=float, default=None)
    args = p.parse_args()
    run_ranks(train, args.world_size, args)


if __name__ == "__main__":
    main()
