// Flag validators for the command-line programs (examples, tools, benchmarks) whose messages
// name what a flag accepts: "--batch-size: must be an integer >= 1, got '0'". CLI11's own
// Range prints its bounds as doubles with hundreds of digits. CLI11 prefixes the flag name.
//
//   app.add_option("--nproc-per-node", n)->check(cli::integer_in(1, 1024));
//   app.add_option("--lr", lr)->check(cli::number_in(0));
#pragma once

#include <CLI/CLI.hpp>
#include <climits>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>

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

}  // namespace nanoddp::cli
