#include "core/replace_file.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "core/file_size_limit.h"

namespace nanoddp {

void replace_file(const std::string& path, const std::string& what, const std::function<void(std::ostream&)>& write) {
  const std::string temporary = path + ".tmp";
  {
    const FileSizeSignalHeld held;  // Note [File size limit]: past `ulimit -f`, an IOError
    std::ofstream out(temporary);
    NANODDP_CHECK(out.good(), IOError, "cannot write ", what, " ", path, " (into ", temporary,
                  "): ", std::strerror(errno));
    try {
      write(out);
    } catch (...) {
      out.close();
      std::remove(temporary.c_str());
      throw;
    }
    out.flush();
    const int error = errno;
    if (!out.good()) {
      out.close();
      std::remove(temporary.c_str());
      NANODDP_THROW(IOError, "writing ", what, " ", path, " failed (into ", temporary, ", removed): ",
                    std::strerror(error), file_size_limit_hint(error));
    }
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    std::remove(temporary.c_str());  // a whole file under a name nobody asked for is litter
    NANODDP_THROW(IOError, "cannot rename ", temporary, " to ", path, " (", what, "): ", std::strerror(error));
  }
}

}  // namespace nanoddp
