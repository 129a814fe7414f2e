// How every program reports a usage error (a bad flag, value or combination of flags), by
// argparse's convention: "<program>: <message naming the flag>" on stderr and exit status 2.
// Apart from tools/cli_checks.h so that a program's run, which has no flags to parse, can
// throw UsageError without compiling CLI11.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>

namespace nanoddp::cli {

// The exit status of a usage error (a bad flag, value or combination of flags), as argparse's
// parser.error() and most Unix tools use; CLI11's own codes (105, 109, 114...) vary by error.
inline constexpr int kUsageErrorExit = 2;

// Prints "<program>: <message>" and a pointer to --help on stderr; returns kUsageErrorExit, so
// that `return cli::usage_error(...)` ends main.
inline int usage_error(const std::string& program, const std::string& message) {
  std::fprintf(stderr, "%s: %s\nRun with --help for more information.\n", program.c_str(), message.c_str());
  return kUsageErrorExit;
}

// A usage error that only shows after parsing, once the data or the build is known (a batch
// larger than the data set). Thrown from a program's run; its main reports it as usage_error.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace nanoddp::cli
