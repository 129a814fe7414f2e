// Whole-file reads and all-or-nothing writes for every file the library saves (checkpoints,
// safetensors, traces). Internal: not installed.
//
//   write_file_atomically("w.safetensors", bytes, "safetensors");  // old file or new, never half
//   const std::string bytes = read_regular_file("w.safetensors", "safetensors");
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/replace_file.h"

namespace nanoddp {

// The folder a file lives in ("." for a bare name, "/" for a file in the root).
std::string folder_of(const std::string& path);

// Throws IOError (starting with what) unless write_file_atomically(path, ...) could write
// there: path is absent or a regular file (after following symlinks), and its folder exists
// and takes a new file (one is made and removed: access() alone says yes to root anywhere).
void check_writable(const std::string& path, const char* what);

// check_replaces_only (a file is replaced only by one of its own format) is in
// core/replace_file.h.

// First checks path as check_writable does, but for the permission (Note [Save target] in
// file_io.cpp): an empty path, a missing folder, a folder or a device in path's place are
// IOErrors before anything is written; a symlink is followed, and the file it names is
// replaced (the link stays). Then writes bytes to a temporary file of its own
// ("<path>.tmp.<space>.<pid>.XXXXXX", mkstemp), fsyncs it, renames it over path and fsyncs the
// folder: a crash or kill -9 leaves the old file or the new one (SIGINT, SIGTERM or SIGHUP
// mid-write remove the temporary file and then end the process as before; a kill -9 mid-write
// leaves it behind, and the next write of path in the same pid space removes it: Note [Stale
// temporary files] in file_io.cpp), and writers of the same path at once all succeed, the last rename
// winning. Throws IOError (starting with what: "checkpoint") naming the file and the failed
// call; the temporary file is removed on failure. A full disk (ENOSPC) or a write past the
// file size limit (RLIMIT_FSIZE, EFBIG) is such an IOError, as torch.save's OSError: the
// limit's SIGXFSZ does not end the process (Note [File size limit] in
// core/file_size_limit.h).
void write_file_atomically(const std::string& path, const std::string& bytes, const char* what);

// The file a save to path replaces (Note [Save target] in file_io.cpp): path with its symbolic
// links followed, also to a file that does not exist yet. Throws IOError naming path (what:
// "checkpoint", ...) when that is not a regular file, or its folder does not exist.
std::string save_target(const std::string& path, const char* what);

// "<path>.tmp.<space>.": how the temporary files of path that processes of this pid space
// write begin (Note [Stale temporary files] in file_io.cpp); "" when the space is unknown or
// the name would be longer than a file name may be (those are "<path>.tmp.XXXXXX").
std::string temporary_file_prefix(const std::string& path);

// Removes the temporary files of path (temporary_file_prefix) whose writer, a process of this
// pid space, is gone: what a write killed before its rename left. Others' are left alone.
void remove_stale_temporaries(const std::string& path);

// Whether path names a regular file (links followed). A device or a FIFO is not one: reading
// it to see what it holds could wait forever (a terminal, a FIFO without a writer).
bool is_regular_file(const std::string& path);

// The whole content of path. Throws IOError (starting with what) when path is missing, not a
// regular file, or unreadable.
std::string read_regular_file(const std::string& path, const char* what);

class Tensor;

// tensor copied to the host (itself when it is there), for a writer to save. Throws
// ValueError starting with where ("safetensors w.safetensors"), naming the tensor, when it is
// undefined or its memory is freed (an FSDP unit's parameter outside its forward, on any
// device): there is nothing to save.
Tensor host_tensor_to_save(const Tensor& tensor, const std::string& where, const std::string& name);

}  // namespace nanoddp
