// safetensors files: named tensors in the format PyTorch users exchange weights in
// (Hugging Face's safetensors; safetensors.torch.save_file / load_file read and write it).
//
//   save_safetensors("mlp.safetensors", model.state_dict(), {{"epochs", "10"}});
//   StateDict weights = load_safetensors("mlp.safetensors");
//   model.load_state_dict(weights);
//
// Format: an 8-byte little-endian unsigned header length N; N bytes of UTF-8 JSON, an object
// mapping each tensor name to {"dtype": "F32", "shape": [256, 784], "data_offsets": [begin,
// end]}, plus an optional "__metadata__" object of string to string; then the tensors' raw
// little-endian bytes, dense and row-major. Offsets count from the first data byte; the
// tensors cover the data exactly, with no overlap and no gap.
//
// dtypes: Float32 <-> "F32", Float16 <-> "F16", BFloat16 <-> "BF16", Int64 <-> "I64",
// Int32 <-> "I32", UInt8 <-> "U8". A half-precision file (weights shared in BF16) loads as
// such, and Module::load_state_dict converts it into a float32 model as torch's copy_ does.
// Files holding other dtypes (F64, BOOL, I8, ...) or more than Shape::kMaxDims dimensions are
// refused with an IOError naming the tensor. The header must start with '{' and hold no NUL
// byte, as the format's specification requires. save throws ValueError for a tensor whose
// memory is freed and for a name or metadata that is not UTF-8. For training checkpoints
// (optimizer state, epoch, checksum) see nn/checkpoint.h.
#pragma once

#include <map>
#include <string>

#include "nn/module.h"

namespace nanoddp::nn {

// "__metadata__": free-form text, as safetensors' metadata= argument.
using SafetensorsMetadata = std::map<std::string, std::string>;

// Writes tensors (any device: copied to the CPU) to path, all-or-nothing: a temporary file
// is fsynced and renamed over path, so a crash leaves the old file or the new one. The header
// is padded with spaces to a multiple of 8 bytes (as safetensors does) so the data starts
// 8-byte aligned; tensors follow as the safetensors library lays them out, the widest dtype
// first (int64, float32, int32, bfloat16, float16, uint8), by name within one, so each starts
// at a multiple of its element size. Throws ValueError for a tensor named
// "__metadata__", IOError (naming the file) when writing fails.
void save_safetensors(const std::string& path, const StateDict& tensors, const SafetensorsMetadata& metadata = {});

// Throws IOError naming path unless save_safetensors(path, ...) could write there (path is
// absent or a regular file in a writable folder), or when path is a non-empty file that is not
// a safetensors file (a program replaces its own earlier export, never a file it did not
// write). For programs that export after long work.
void check_safetensors_writable(const std::string& path);

// Reads every tensor of path onto the CPU; with metadata non-null, also replaces *metadata
// with its "__metadata__" (empty when absent; untouched when the load throws). Checks everything before
// trusting it: the header length against the file size, the JSON, each dtype, shape and data_offsets, that
// each tensor's byte count is its numel * dtype size (overflow-checked), that no name appears twice in one
// JSON object (two entries for a tensor or two "__metadata__": which one a reader takes is undefined), and
// that the tensors tile the data exactly. Throws IOError naming the file (and the tensor and byte offsets) on
// any violation, and on a missing or unreadable file.
StateDict load_safetensors(const std::string& path, SafetensorsMetadata* metadata = nullptr);
// The tensors in bytes, the whole content of a safetensors file; path only names it in errors.
// Checks and throws as load_safetensors does. For readers that have the bytes already (and fuzzing).
StateDict parse_safetensors(const std::string& bytes, const std::string& path,
                            SafetensorsMetadata* metadata = nullptr);

}  // namespace nanoddp::nn
