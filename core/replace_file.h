// Writing a whole text file so that readers see the old file or the new one, never half of
// one: the library's trace writers (core/trace.cpp, core/trace_merge.cpp).
//
//   replace_file("run.json", "the trace file", [&](std::ostream& out) { out << text; });
//
// The text goes to "<path>.tmp", which is then renamed over path. Throws IOError, naming
// `what`, the path and the cause, when the temporary file cannot be opened, written (a full
// disk; past `ulimit -f`, Note [File size limit]) or renamed; the temporary file is then
// removed and path is as it was. An exception from write itself is passed on, also after the
// temporary file is removed. Internal to the library (not installed).
#pragma once

#include <functional>
#include <ostream>
#include <string>

namespace nanoddp {

void replace_file(const std::string& path, const std::string& what, const std::function<void(std::ostream&)>& write);

}  // namespace nanoddp
