// Flag validators for the command-line programs (examples, tools, benchmarks) whose messages
// name what a flag accepts: "--batch-size: must be an integer >= 1, got '0'". CLI11's own
// Range prints its bounds as doubles with hundreds of digits. CLI11 prefixes the flag name.
//
//   app.add_option("--nproc-per-node", n)->check(cli::integer_in(1, 1024));
//   app.add_option("--backend", backend)->check(cli::backend());
//   if (!cli::values_given(argc, argv, "fashion_mnist")) return 2;   // before app.parse
#pragma once

#include <CLI/CLI.hpp>
#include <climits>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "dist/process_group.h"

namespace nanoddp::cli {

// An integer for which ok(value) holds; otherwise "must be <what>, got '<text>'".
// short_what is the hint CLI11 shows in --help.
inline CLI::Validator integer_where(const std::string& what, const std::string& short_what,
                                    std::function<bool(long long)> ok) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        size_t used = 0;
        long long value = 0;
        try {
          value = std::stoll(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size() || !ok(value)) return "must be " + what + ", got '" + text + "'";
        return "";
      },
      short_what);
}

// An integer in [min, max].
inline CLI::Validator integer_in(long long min, long long max = LLONG_MAX) {
  const std::string lo = std::to_string(min), hi = std::to_string(max);
  const bool open = max == LLONG_MAX;
  return integer_where(open ? "an integer >= " + lo : "an integer between " + lo + " and " + hi,
                       open ? lo + " or more" : lo + ".." + hi,
                       [min, max](long long v) { return v >= min && v <= max; });
}

// A finite number in [min, max].
inline CLI::Validator number_in(double min, double max = std::numeric_limits<double>::infinity()) {
  std::ostringstream range;
  if (std::isinf(max)) {
    range << ">= " << min;
  } else {
    range << "between " << min << " and " << max;
  }
  const std::string what = "a finite number " + range.str();
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        size_t used = 0;
        double value = NAN;
        try {
          value = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size() || !std::isfinite(value) || value < min || value > max)
          return "must be " + what + ", got '" + text + "'";
        return "";
      },
      range.str());
}

// One of values, spelt exactly; otherwise "must be one of a, b or c, got '<text>'".
inline CLI::Validator one_of(const std::vector<std::string>& values) {
  std::string listed, short_listed;
  for (size_t i = 0; i < values.size(); ++i) {
    listed += (i == 0 ? "" : i + 1 == values.size() ? " or " : ", ") + values[i];
    short_listed += (i == 0 ? "" : "|") + values[i];
  }
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        for (const std::string& value : values)
          if (text == value) return "";
        return "must be one of " + listed + ", got '" + text + "'";
      },
      short_listed);
}

// --backend: the names dist::parse_backend takes (dist::backend_names), so that a bad one is
// refused before anything starts. shm+gloo is what auto picks across nodes.
inline CLI::Validator backend() { return one_of(dist::backend_names()); }

// --device as the examples take it: cpu, cuda (this rank's GPU) or cuda:N (Device::parse).
inline CLI::Validator device() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const std::string prefix = "cuda:";
        const bool indexed = text.rfind(prefix, 0) == 0 && text.size() > prefix.size() &&
                             text.size() <= prefix.size() + 5 &&
                             text.find_first_not_of("0123456789", prefix.size()) == std::string::npos;
        if (text == "cpu" || text == "cuda" || indexed) return "";
        return "must be cpu, cuda or cuda:N, got '" + text + "'";
      },
      "cpu|cuda|cuda:N");
}

// Anything but the empty string, which would otherwise read as "not given" (`--checkpoint
// "$CKPT"` with CKPT unset: no checkpoint) or fail later, far from the flag.
inline CLI::Validator non_empty(const std::string& what, const std::string& short_what) {
  return CLI::Validator(
      [=](std::string& text) -> std::string { return text.empty() ? "must name " + what + ", got ''" : ""; },
      short_what);
}

// A file or folder name.
inline CLI::Validator path() { return non_empty("a file or folder", "PATH"); }

// CLI11 takes `--flag=` (nothing after '=') as `--flag` for a flag, and as a missing value
// ("1 required TEXT missing") for an option. Refuses both before parsing, naming the argument;
// returns false after printing "<program>: --flag= has no value ..." to stderr.
inline bool values_given(int argc, const char* const* argv, const std::string& program) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.size() > 3 && arg.compare(0, 2, "--") == 0 && arg.back() == '=' && arg.find('=') == arg.size() - 1) {
      std::fprintf(stderr,
                   "%s: %s has no value after '=': give one (%sVALUE) or leave the flag out\n"
                   "Run with --help for more information.\n",
                   program.c_str(), arg.c_str(), arg.c_str());
      return false;
    }
  }
  return true;
}

}  // namespace nanoddp::cli
