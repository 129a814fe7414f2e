#!/usr/bin/python3
"""Forward + backward time per layer on a 64 x 1024 input in PyTorch, one thread: the same
work as benchmarks/layer_bench.cpp (read its header for the protocol), one JSON line each:
    {"example":"layer_bench","framework":"torch","layer":L,"input":[...],"us_per_iter":t}

    /usr/bin/python3 benchmarks/torch_reference/layer_bench.py --min-time 0.2
"""

import argparse
import json
import time

import torch

from launch import emit, set_threads


def layer_cases():
    rows, images = (64, 1024), (64, 16, 8, 8)
    cnn_pooled = (64, 32, 13, 13)  # fashion_mnist_cnn's second convolution's input
    nn = torch.nn
    return [
        ("ReLU", rows, nn.ReLU),
        ("Sigmoid", rows, nn.Sigmoid),
        ("Tanh", rows, nn.Tanh),
        ("GELU", rows, nn.GELU),
        ("GELU(tanh)", rows, lambda: nn.GELU(approximate="tanh")),
        ("Softplus", rows, nn.Softplus),
        ("Dropout(0.5)", rows, lambda: nn.Dropout(0.5)),
        ("LayerNorm(1024)", rows, lambda: nn.LayerNorm(1024)),
        ("BatchNorm1d(1024)", rows, lambda: nn.BatchNorm1d(1024)),
        ("Conv2d(16,16,3,p=1)", images, lambda: nn.Conv2d(16, 16, 3, padding=1)),
        ("Conv2d(32,64,3)", cnn_pooled, lambda: nn.Conv2d(32, 64, 3)),
        ("MaxPool2d(2)", images, lambda: nn.MaxPool2d(2)),
        ("Flatten", images, nn.Flatten),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-time", type=float, default=0.2, help="seconds per timed round")
    p.add_argument("--only", help="one layer's name, as printed")
    args = p.parse_args()
    set_threads(1)
    torch.manual_seed(0)
    for name, shape, make in layer_cases():
        if args.only and name != args.only:
            continue
        layer = make()
        x = torch.randn(shape, requires_grad=True)
        g = torch.randn(layer(x).shape)

        def step():
            layer(x).backward(g)
            x.grad = None
            layer.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        rounds = []
        for _ in range(5):
            iterations, start = 0, time.perf_counter()
            while True:
                step()
                iterations += 1
                if time.perf_counter() - start >= args.min_time:
                    break
            rounds.append((time.perf_counter() - start) / iterations)
        rounds.sort()
        emit(json.dumps({"example": "layer_bench", "framework": "torch", "layer": name, "input": list(shape),
                         "us_per_iter": round(rounds[len(rounds) // 2] * 1e6, 2)}))


if __name__ == "__main__":
    main()
