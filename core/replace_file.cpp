#include "core/replace_file.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/file_io.h"

namespace nanoddp {

void replace_file(const std::string& path, const std::string& what, const std::function<void(std::ostream&)>& write) {
  std::ostringstream text;
  write(text);
  write_file_atomically(path, text.str(), what.c_str());
}

void check_replaces_only(const std::string& path, const char* what, const char* format,
                         bool (*is_format)(const std::string& head, uint64_t size_bytes)) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode) || info.st_size == 0) return;
  std::ifstream in(path, std::ios::binary);
  // A file this user cannot read may well be ours: say why, not that it is something else.
  NANODDP_CHECK(in.is_open(), IOError, what, " ", path, ": cannot read ", path, " to check that it is ",
                format, " before replacing it: ", std::strerror(errno),
                "; fix its permissions or name another file");
  std::string head(kFormatHeadBytes, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(std::max<std::streamsize>(in.gcount(), 0)));
  if (is_format(head, static_cast<uint64_t>(info.st_size))) return;
  // The first line, printable, so the user sees which file that is.
  std::string shown;
  for (char c : head) {
    if (c == '\n' || shown.size() >= 24) break;
    shown += std::isprint(static_cast<unsigned char>(c)) ? c : '.';
  }
  NANODDP_THROW(IOError, what, " ", path, ": refusing to replace ", path, ": it is not ", format,
                " (it begins \"", shown,
                "\"), so this program did not write it; move it away or name another file");
}

}  // namespace nanoddp
