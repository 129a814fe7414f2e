#!/usr/bin/python3
"""Loads weights that `fashion_mnist --export FILE.safetensors` (or fashion_mnist_cnn's) wrote
into the same PyTorch model (the MLP, or the CNN when the file holds convolution weights) and
reports its test accuracy next to the one nanoddp measured (stored in the file's
metadata): the same weights must classify the test set the same way.

    build/examples/fashion_mnist --epochs 2 --export /tmp/mlp.safetensors
    /usr/bin/python3 benchmarks/torch_reference/load_safetensors.py /tmp/mlp.safetensors

The file is read with the `safetensors` package when it is installed, else with the
format's own few lines (8-byte little-endian header length, JSON header, raw data) below.
model.load_state_dict(strict=True) checks that every name and shape is PyTorch's. Prints
one JSON line; exits 1 when the accuracies differ by more than --tolerance (matrix products
summed in another order may flip an image whose two best classes tie to float rounding).
"""

import argparse
import json
import struct
import sys

import torch

from fashion_mnist import load, make_model

# torch dtypes: numpy has no bfloat16, so the bytes are read as torch reads them.
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
          "I32": torch.int32, "U8": torch.uint8}


def read_safetensors(path):
    """path -> ({name: torch.Tensor}, metadata)"""
    try:
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}
    except ImportError:
        pass
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    metadata = header.pop("__metadata__", {})
    body = data[8 + length:]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        raw = bytearray(body[begin:end])
        flat = torch.frombuffer(raw, dtype=DTYPES[entry["dtype"]]) if raw else torch.empty(0, dtype=DTYPES[entry["dtype"]])
        tensors[name] = flat.reshape(entry["shape"]).clone()
    return tensors, metadata


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="a safetensors file from fashion_mnist --export")
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--tolerance", type=float, default=0.001, help="largest accepted accuracy difference")
    args = p.parse_args()

    tensors, metadata = read_safetensors(args.path)
    model = make_model("cnn" if any(t.dim() == 4 for t in tensors.values()) else "mlp")
    model.load_state_dict(tensors, strict=True)
    model.eval()
    test_x, test_y = load(args.data_dir, train=False)
    with torch.no_grad():
        predicted = model(test_x.float().div_(255.0)).argmax(dim=1)
    accuracy = (predicted == test_y).float().mean().item()
    ours = float(metadata["test_accuracy"]) if "test_accuracy" in metadata else None
    print(json.dumps({"file": args.path, "torch_test_accuracy": accuracy, "nanoddp_test_accuracy": ours,
                      "parameters": {name: list(t.shape) for name, t in tensors.items()}}))
    if ours is not None and abs(accuracy - ours) > args.tolerance:
        print(f"accuracies differ by {abs(accuracy - ours):.4f} (> {args.tolerance})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
