// Writing a whole text file so that readers see the old file or the new one, never half of
// one: the library's trace writers (core/trace.cpp, core/trace_merge.cpp).
//
//   replace_file("run.json", "the trace file", [&](std::ostream& out) { out << text; });
//
// The text is gathered, then written by write_file_atomically (core/file_io.h), the writer
// of checkpoints: into a temporary file of its own next to path, renamed over path; a symlink
// at path is followed; nothing else is touched. Throws IOError as that does, naming `what`,
// the path and the cause, and leaves path unchanged. An exception from write itself
// propagates, and no file is created. Internal to the library (not installed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>

namespace nanoddp {

void replace_file(const std::string& path, const std::string& what, const std::function<void(std::ostream&)>& write);

// Throws IOError (starting with what, naming path) when path is a non-empty file that is not
// in the format about to be written over it: a program replaces only its own earlier output,
// never a file it did not write (`--checkpoint README.md`, `--trace notes.txt`). is_format
// gets the file's first kFormatHeadBytes bytes (fewer for a shorter file) and its size in
// bytes; format names the format in the message ("a nanoddp checkpoint"). An absent or empty
// path passes; one this user cannot read is an IOError saying so (the system's reason).
inline constexpr size_t kFormatHeadBytes = 64;
void check_replaces_only(const std::string& path, const char* what, const char* format,
                         bool (*is_format)(const std::string& head, uint64_t size_bytes));

}  // namespace nanoddp
