// Checkpoint files: named tensors saved atomically, loaded with every byte checked.
//
//   save_checkpoint("run.ckpt", {{"model.0.weight", w}, {"epoch", Tensor::from_vector({3.0f})}});
//   StateDict state = load_checkpoint("run.ckpt");
//
// Format (little-endian): magic "NDDPCKPT", u32 version = 2, u64 count, then per tensor:
// u32 name length, name bytes, u8 dtype, u8 dim, dim x i64 sizes, u64 nbytes, data; finally
// a u64 FNV-1a checksum (64-bit, offset basis 0xcbf29ce484222325) of everything before it.
// dtype is DType's number (core/device.h): 0 float32, 1 int64, 2 uint8, 3 float16,
// 4 bfloat16, 5 int32. Version 1 files, whose checksum started from 1469598103934665603
// instead, load too.
//
// save writes the file through write_file_atomically (core/file_io.h): a temporary file of its
// own, fsynced, renamed over path. A crash or kill -9 leaves the old file or the new one,
// never half of one, and processes saving the same path at once all succeed, the last rename
// winning (torch.save promises neither). load throws IOError naming the file and byte offset
// on a missing, truncated or corrupt file, or one with two entries of one name (ambiguous:
// save never writes one), and checks every size against int64 and the bytes present before
// trusting it.
//
// Why a format of our own for training checkpoints, next to safetensors (nn/safetensors.h)
// for weights: a checkpoint resumes a run, so it must notice any damaged byte (the checksum;
// safetensors has none) and it carries what only nanoddp reads (optimizer buffers, the epoch).
// To hand weights to PyTorch or another tool, export them with save_safetensors.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "nn/module.h"

namespace nanoddp::nn {

// The offset basis of version 1's FNV-1a checksum (core/hash.h has the standard one).
constexpr uint64_t kCheckpointVersion1OffsetBasis = 1469598103934665603ull;

void save_checkpoint(const std::string& path, const StateDict& tensors);
// Throws IOError unless save_checkpoint(path, ...) could write there: path is absent or a
// regular file, and its folder exists and is writable. For programs that save only after
// long work (an epoch of training) and should fail before it. Also throws IOError, naming
// path, when path is a non-empty file that is not a nanoddp checkpoint: a program replaces
// its own earlier checkpoint, never a file it did not write (save_checkpoint itself, like
// torch.save, replaces whatever is there). path + ".prev" and path + ".prev.tmp", which a
// save that keeps the previous checkpoint replaces, are checked the same way.
void check_checkpoint_writable(const std::string& path);
// True when path can be read and begins as a nanoddp checkpoint does (its magic); nothing
// past the magic is read or checked. For deciding whether a file is ours to remove.
bool is_checkpoint_file(const std::string& path);
// Keeps the file at path, if there is one, as path + ".prev", before path is replaced: a hard
// link made under a temporary name and renamed over path.prev, so that path.prev is never
// absent and path is never touched. A path that does not load (`loads(path)` false; by
// default its checksum over every byte, read without building tensors) is not kept over an existing
// path.prev: after a resume that fell back to path.prev, that is the only checkpoint that
// loads. Throws IOError naming both files and the step that failed (link: another file
// system, no permission; rename), or a path.prev.tmp (a leftover of a save that died there)
// that is not a nanoddp checkpoint.
void keep_previous_checkpoint(const std::string& path,
                              const std::function<bool(const std::string&)>& loads = nullptr);
StateDict load_checkpoint(const std::string& path);
// The bytes save_checkpoint writes for tensors (to send a state elsewhere than to a file).
// Throws ValueError for a name longer than 4096 bytes or holding a control character (a byte
// below 0x20).
std::string checkpoint_bytes(const StateDict& tensors);
// The tensors in bytes, the whole content of a checkpoint file; path only names it in errors.
// Throws IOError as load_checkpoint does. For readers that have the bytes already (and fuzzing).
StateDict parse_checkpoint(const std::string& bytes, const std::string& path);

// Adds every entry of part to into with prefix + name ("model." + "0.weight").
void merge_prefixed(StateDict& into, const std::string& prefix, const StateDict& part);
// The entries of state whose names start with prefix, with the prefix removed.
StateDict strip_prefix(const StateDict& state, const std::string& prefix);

}  // namespace nanoddp::nn
