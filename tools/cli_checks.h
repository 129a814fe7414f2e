// Flag validators for the command-line programs (examples, tools, benchmarks) whose messages
// name what a flag accepts: "--batch-size: must be an integer >= 1, got '0'". CLI11's own
// Range prints its bounds as doubles with hundreds of digits. CLI11 prefixes the flag name.
// cli::parse and cli::usage_error give every program argparse's convention: a usage error is
// "<program>: <message naming the flag>" on stderr and exit status 2; --help exits 0.
//
//   app.add_option("--nproc-per-node", n)->check(cli::integer_in(1, 1024));
//   if (auto code = cli::parse(app, argc, argv, "fashion_mnist")) return *code;
//   if (a > b) return cli::usage_error("fashion_mnist", "--stop-after 5 is past --epochs 2");
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "kernels/kernels.h"
#include "tools/usage_error.h"

namespace nanoddp::cli {

// text as a whole decimal integer that fits a long long, or nullopt.
inline std::optional<long long> whole_integer(const std::string& text) {
  size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used == 0 || used != text.size()) return std::nullopt;
  return value;
}

// An integer for which ok(value) holds; otherwise "must be <what>, got '<text>'".
// short_what is the hint CLI11 shows in --help.
inline CLI::Validator integer_where(const std::string& what, const std::string& short_what,
                                    std::function<bool(long long)> ok) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        const std::optional<long long> value = whole_integer(text);
        if (!value || !ok(*value)) return "must be " + what + ", got '" + text + "'";
        return "";
      },
      short_what);
}

// An integer in [min, max]. The default max is what an int holds, the type of these flags'
// variables: a larger value would otherwise pass here and fail in CLI11's conversion with only
// "Could not convert". With that default the message names only min, unless the value is past max.
inline CLI::Validator integer_in(long long min, long long max = INT_MAX) {
  const std::string lo = std::to_string(min), hi = std::to_string(max);
  const bool open = max == INT_MAX;
  const std::string what = open ? "an integer >= " + lo : "an integer between " + lo + " and " + hi;
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        const std::optional<long long> value = whole_integer(text);
        // Digits that no long long holds are past the top, which the message then names.
        const size_t sign = !text.empty() && (text[0] == '-' || text[0] == '+') ? 1 : 0;
        const bool too_long =
            !value && text.size() > sign && text.find_first_not_of("0123456789", sign) == std::string::npos;
        if (too_long || (value && *value > max))
          return "must be an integer between " + lo + " and " + hi + ", got '" + text + "'";
        if (!value || *value < min) return "must be " + what + ", got '" + text + "'";
        return "";
      },
      open ? lo + " or more" : lo + ".." + hi);
}

// A seed: an integer from 0 to 2^64 - 1, written in decimal. CLI11 alone reads "-1" and any
// number past 2^64 as 2^64 - 1, so that different seeds gave the same run.
inline CLI::Validator seed() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const bool digits = !text.empty() && text.size() <= 20 &&
                            std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (!digits || (text.size() == 20 && text > "18446744073709551615"))
          return "must be an integer from 0 to 18446744073709551615, got '" + text + "'";
        return "";
      },
      "0..2^64-1");
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

// A finite number in [min, max] that a float32 holds: for flags read into a float, where
// CLI11 would turn 1e39 into inf and "nan" into NaN without a word. --help shows the bounds
// the user chose (">= 0", "a float32"), not float32's largest value.
inline CLI::Validator float_in(float min, float max = std::numeric_limits<float>::max()) {
  CLI::Validator check = number_in(min, max);
  const bool no_max = max == std::numeric_limits<float>::max(),
             no_min = min == std::numeric_limits<float>::lowest();
  if (no_max) {
    std::ostringstream shown;
    shown << ">= " << min;
    check.description(no_min ? "a float32" : shown.str());
  }
  return check;
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

// --backend: the names dist::parse_backend takes (dist::backend_names), and built into this
// library, so that a bad one is refused before anything starts. shm+gloo is what auto picks
// across nodes.
inline CLI::Validator backend() {
  const CLI::Validator named = one_of(dist::backend_names());
  return CLI::Validator(
      [named](std::string& text) -> std::string {
        if (std::string problem = named(text); !problem.empty()) return problem;
        const std::string missing = dist::backend_unavailable(dist::parse_backend(text));
        return missing.empty() ? "" : text + " is not available: " + missing;
      },
      named.get_description());
}

// --device as the examples take it: cpu, cuda (this rank's GPU) or cuda:N (Device::parse).
inline CLI::Validator device() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const std::string prefix = "cuda:";
        const bool indexed = text.rfind(prefix, 0) == 0 && text.size() > prefix.size() &&
                             text.size() <= prefix.size() + 5 &&
                             text.find_first_not_of("0123456789", prefix.size()) == std::string::npos;
        if (!(text == "cpu" || text == "cuda" || indexed)) return "must be cpu, cuda or cuda:N, got '" + text + "'";
        if (text != "cpu" && !kernels::cuda_built())
          return text + " needs a CUDA build, and this build of nanoddp has no CUDA (configure with "
                 "-Dcuda=enabled on a machine with the CUDA toolkit); use cpu";
        return "";
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

// A path that is not empty: "got an empty path; give <names>" says what is wrong with '', which
// no file system opens (and `--checkpoint "$CKPT"` with CKPT unset passes).
inline CLI::Validator non_empty_path(const std::string& names, const std::string& short_what) {
  return CLI::Validator(
      [=](std::string& text) -> std::string { return text.empty() ? "got an empty path; give " + names : ""; },
      short_what);
}

// Every program's option defaults: --help shows each default value, and a flag takes no value
// (CLI11 would read --quiet=3 as --quiet, and --quiet=0 as its absence).
inline void set_option_defaults(CLI::App& app) {
  app.option_defaults()->always_capture_default()->disable_flag_override();
}

// A list flag given once, with no empty item. CLI11 splits "--hidden 1,,2" at the commas and
// drops the empty item, and joins "--hidden 5 --hidden 6" into 5,6, so the run would quietly
// use a list nobody wrote (a repeated single-valued flag is refused as given twice).
// Returns "" or the problem.
inline std::string list_flag_problem(int argc, const char* const* argv, const std::string& flag) {
  int given = 0;
  std::string first;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    std::string value;
    if (arg == flag && i + 1 < argc) {
      value = argv[i + 1];
    } else if (arg.rfind(flag + "=", 0) == 0) {
      value = arg.substr(flag.size() + 1);
    } else {
      continue;
    }
    if (++given == 1) first = value;
    if (value.empty()) continue;  // the validators refuse an empty value by name
    if (value.front() == ',' || value.back() == ',' || value.find(",,") != std::string::npos)
      return flag + ": an empty item in '" + value + "': give numbers separated by single commas";
  }
  if (given > 1)
    return flag + " is given " + std::to_string(given) + " times: give it once, its items separated by commas (" +
           flag + " " + first + ",...)";
  return "";
}

// A file to read or write (--checkpoint, --metrics, --trace ...).
inline CLI::Validator file_path() { return non_empty_path("a file name", "FILE"); }

// A folder (--data-dir).
inline CLI::Validator folder_path() { return non_empty_path("a folder name", "DIR"); }

// CLI11 takes `--flag=` (nothing after '=') as `--flag` for a flag, and as a missing value
// ("1 required TEXT missing") for an option. Refuses both before parsing, naming the argument;
// returns false after printing "<program>: --flag= has no value ..." to stderr.
inline bool values_given(int argc, const char* const* argv, const std::string& program) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.size() > 3 && arg.compare(0, 2, "--") == 0 && arg.back() == '=' && arg.find('=') == arg.size() - 1) {
      usage_error(program, arg + " has no value after '=': give one (" + arg + "VALUE) or leave the flag out");
      return false;
    }
  }
  return true;
}

// The long option of app that `given` most likely meant ("--epoch=3" -> "--epochs"): the one
// option whose name `given` begins, when it is at least 3 letters ("--data" -> "--data-dir");
// none when it begins several ("--checkpoint-" -> three options) or names one exactly (a real
// flag in the wrong place); else the one at most two letters added, dropped or changed away,
// and fewer than half of them; "" when none is that close.
inline std::string closest_long_option(const CLI::App& app, const std::string& given) {
  std::string word = given.substr(0, given.find('='));
  if (word.compare(0, 2, "--") != 0) return "";
  word = word.substr(2);
  std::vector<std::string> extended;  // per option, its first name that goes on from word
  for (const CLI::Option* option : app.get_options()) {
    for (const std::string& name : option->get_lnames()) {
      if (name == word) return "";
      if (word.size() >= 3 && name.size() > word.size() && name.compare(0, word.size(), word) == 0) {
        extended.push_back("--" + name);
        break;
      }
    }
  }
  if (!extended.empty()) return extended.size() == 1 ? extended[0] : "";
  std::string best;
  size_t best_distance = 3;
  for (const CLI::Option* option : app.get_options()) {
    for (const std::string& name : option->get_lnames()) {
      // Levenshtein distance, one row at a time.
      std::vector<size_t> row(name.size() + 1);
      for (size_t j = 0; j <= name.size(); ++j) row[j] = j;
      for (size_t i = 1; i <= word.size(); ++i) {
        size_t diagonal = row[0];
        row[0] = i;
        for (size_t j = 1; j <= name.size(); ++j) {
          const size_t above = row[j];
          row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (word[i - 1] == name[j - 1] ? 0 : 1)});
          diagonal = above;
        }
      }
      const size_t distance = row[name.size()];
      if (distance < best_distance && 2 * distance < std::max(word.size(), name.size())) {
        best_distance = distance;
        best = "--" + name;
      }
    }
  }
  return best;
}

// Parses argv[1..argc) into app, after values_given over argv[1..flags_end) (all of argv when
// flags_end < 0; a launcher passes where its own flags end). Returns nullopt when the program
// goes on, else the status main returns: 0 after --help (printed on stdout), kUsageErrorExit
// after any usage error, printed by usage_error with CLI11's message (which names the flag:
// "--epochs: must be an integer >= 1, got '0'", "The following argument was not expected:
// --bogus", "--epochs needs a value (INT:1 or more) after it"). A --help that could not be
// written returns 1.
inline std::optional<int> parse(CLI::App& app, int argc, const char* const* argv, const std::string& program,
                                int flags_end = -1) {
  if (!values_given(flags_end < 0 ? argc : std::min(flags_end, argc), argv, program)) return kUsageErrorExit;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {  // --help
      app.exit(e);
      // Help that was asked for and not written (stdout closed or full) is a failure.
      if (!std::cout.flush()) {
        std::cerr << program << ": could not write --help to stdout\n";
        return 1;
      }
      return 0;
    }
    const std::string what = e.what();
    // CLI11's "--epochs: 1 required INT:1..1024 missing": the flag was last, with no value.
    const std::string missing = " missing";
    const size_t required_at = what.find(": 1 required ");
    if (required_at != std::string::npos && what.size() > missing.size() &&
        what.compare(what.size() - missing.size(), missing.size(), missing) == 0)
      return usage_error(program,
                         what.substr(0, required_at) + " needs a value (" +
                             what.substr(required_at + 13, what.size() - missing.size() - required_at - 13) +
                             ") after it");
    const size_t override_at = what.find(" was given a disallowed flag override");
    if (override_at != std::string::npos) {  // CLI11 names the flag without its dashes
      const std::string flag = "--" + what.substr(0, override_at);
      return usage_error(program, flag + " is a switch and takes no value: give " + flag + " alone, or leave it out");
    }
    // CLI11's "--epochs: At Most 1 required but received 2": the flag was given twice.
    const std::string repeated = ": At Most 1 required but received ";
    const size_t repeated_at = what.find(repeated);
    if (repeated_at != std::string::npos)
      return usage_error(program, what.substr(0, repeated_at) + " is given " + what.substr(repeated_at + repeated.size()) +
                                      " times: give it once");
    // CLI11's IsMember on an empty value: "--precision:  not in {fp32,bf16,fp16}".
    const std::string empty_member = ":  not in ";
    const size_t empty_at = what.find(empty_member);
    if (empty_at != std::string::npos)
      return usage_error(program, what.substr(0, empty_at) + ": got '', expected one of " +
                                      what.substr(empty_at + empty_member.size()));
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {  // a misspelt flag, most often
      // CLI11 2.1's message lists the arguments left over last first ("1 --epoch" for --epoch
      // 1); remaining() has them in the order given.
      const std::vector<std::string> left = app.remaining(false);
      std::string listed, hint;
      for (const std::string& word : left) {
        listed += (listed.empty() ? "" : " ") + word;
        const std::string known = hint.empty() ? closest_long_option(app, word) : "";
        if (!known.empty()) hint = " (did you mean " + known + "?)";
      }
      return usage_error(program, std::string(left.size() > 1 ? "The following arguments were not expected: "
                                                              : "The following argument was not expected: ") +
                                      listed + hint);
    }
    return usage_error(program, what);
  }
  return std::nullopt;
}

}  // namespace nanoddp::cli
