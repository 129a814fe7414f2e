// For a benchmark that takes no flags: an argument would be ignored without a word, so any is
// refused (exit 2), and --help (or -h) says what the program does (exit 0).
//
//   if (const int status = benchmarks::refuse_arguments(argc, argv, "trace_bench prints ..."); status >= 0)
//     return status;
#pragma once

#include <cstdio>
#include <string>

namespace nanoddp::benchmarks {

// what: the sentence --help prints. Returns the status to exit with, or -1 to go on.
inline int refuse_arguments(int argc, char** argv, const char* what) {
  if (argc <= 1) return -1;
  const std::string first = argv[1];
  if (first == "--help" || first == "-h") {
    std::printf("%s; it takes no arguments\n", what);
    return 0;
  }
  std::fprintf(stderr, "%s takes no arguments, got '%s' (--help says what it does)\n", argv[0], first.c_str());
  return 2;
}

}  // namespace nanoddp::benchmarks
