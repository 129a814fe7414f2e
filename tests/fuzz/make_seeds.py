#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (corpus/<target>/), one small valid input per case,
in the formats of data/idx.h, nn/checkpoint.h (without the trailing checksum, which
fuzz_checkpoint appends), safetensors (nn/safetensors.h) and Note [Store wire format] in
dist/store.cpp. Rerun after a format
changes; the files are committed."""
import gzip
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    folder = os.path.join(HERE, "corpus", target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


# ---- IDX: big-endian magic 0x000008<dims>, dims x u32 sizes, the bytes ------------------------
def idx(sizes, fill=None):
    count = 1
    for s in sizes:
        count *= s
    body = bytes((fill if fill is not None else i) % 256 for i in range(count))
    return struct.pack(">BBBB", 0, 0, 8, len(sizes)) + b"".join(struct.pack(">I", s) for s in sizes) + body


write("fuzz_idx", "labels_raw", idx([5]))
write("fuzz_idx", "labels_gz", gzip.compress(idx([5]), mtime=0))
write("fuzz_idx", "images_raw", idx([2, 3, 2]))
write("fuzz_idx", "images_gz", gzip.compress(idx([2, 3, 2]), mtime=0))
write("fuzz_idx", "images_empty", idx([0, 28, 28]))
write("fuzz_idx", "matrix_2d", idx([3, 4]))
write("fuzz_idx", "tensor_4d", idx([1, 2, 2, 2]))


# ---- checkpoint body: "NDDPCKPT", u32 version 2, u64 count, entries --------------------------
FLOAT32, INT64, UINT8 = 0, 1, 2
ITEM = {FLOAT32: "<f", INT64: "<q", UINT8: "<B"}


def entry(name, dtype, sizes, values):
    data = b"".join(struct.pack(ITEM[dtype], v) for v in values)
    return (struct.pack("<I", len(name)) + name.encode() + struct.pack("<BB", dtype, len(sizes)) +
            b"".join(struct.pack("<q", s) for s in sizes) + struct.pack("<Q", len(data)) + data)


def checkpoint(*entries):
    return b"NDDPCKPT" + struct.pack("<IQ", 2, len(entries)) + b"".join(entries)


write("fuzz_checkpoint", "empty", checkpoint())
write("fuzz_checkpoint", "one_matrix", checkpoint(entry("0.weight", FLOAT32, [2, 3], [1, 2, 3, 4, 5, 6])))
write("fuzz_checkpoint", "model_and_optimizer", checkpoint(
    entry("model.0.weight", FLOAT32, [1, 2], [0.5, -0.5]),
    entry("model.0.bias", FLOAT32, [1], [0.25]),
    entry("epoch", INT64, [], [3]),
    entry("labels", UINT8, [2, 2], [0, 1, 2, 255]),
    entry("empty", FLOAT32, [0, 4], [])))


# ---- safetensors: u64 header length, the JSON header, the tensors' bytes ---------------------
def safetensors(header, data):
    text = header.encode()
    return struct.pack("<Q", len(text)) + text + data


write("fuzz_safetensors", "empty", safetensors("{}", b""))
write("fuzz_safetensors", "one_f32", safetensors(
    '{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', struct.pack("<2f", 1.5, -2)))
write("fuzz_safetensors", "every_dtype_and_metadata", safetensors(
    '{"__metadata__":{"format":"pt"},"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},'
    '"b":{"dtype":"F32","shape":[1,1],"data_offsets":[8,12]},"c":{"dtype":"I32","shape":[],"data_offsets":[12,16]},'
    '"d":{"dtype":"BF16","shape":[1],"data_offsets":[16,18]},"e":{"dtype":"F16","shape":[1],"data_offsets":[18,20]},'
    '"f":{"dtype":"U8","shape":[2],"data_offsets":[20,22]},"g":{"dtype":"F32","shape":[0,3],"data_offsets":[22,22]}}',
    bytes(range(22))))


# ---- store requests: verb byte, then fields (little-endian) ---------------------------------
SET, GET, ADD, CHECK, WAIT = 1, 2, 3, 4, 5


def s(text):
    raw = text.encode()
    return struct.pack("<I", len(raw)) + raw


write("fuzz_store", "set_get", bytes([SET]) + s("key") + s("value") + bytes([GET]) + s("key"))
write("fuzz_store", "add", bytes([ADD]) + s("counter") + struct.pack("<q", 5) +
      bytes([ADD]) + s("counter") + struct.pack("<q", -7))
write("fuzz_store", "add_overflow", bytes([ADD]) + s("c") + struct.pack("<q", 2**63 - 1) +
      bytes([ADD]) + s("c") + struct.pack("<q", 1))
write("fuzz_store", "add_to_text", bytes([SET]) + s("k") + s("not a number") + bytes([ADD]) + s("k") +
      struct.pack("<q", 1))
write("fuzz_store", "check_wait", bytes([CHECK]) + struct.pack("<I", 2) + s("a") + s("b") +
      bytes([WAIT]) + struct.pack("<I", 1) + s("a") + struct.pack("<Q", 1000))
write("fuzz_store", "partial", bytes([SET]) + struct.pack("<I", 10) + b"abc")
