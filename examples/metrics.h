// --metrics FILE: a run's training curve as JSON lines, one object per line, flushed as it
// is written (follow it with tail -f; plot it with tools/plot; pandas.read_json(lines=True)
// reads it too). Rank 0 writes; every other rank passes an empty path and writes nothing.
//
//   examples::MetricsLog metrics(rank == 0 ? config.metrics : "");   // throws if unwritable or not a log
//   examples::MetricsRecord r;  r.step = 50;  r.epoch = 1;  r.loss = 0.61;  metrics.write(r);
//
// Fields (null when not measured at that point):
//   step           optimizer steps done since the run began (all epochs, resumed ones too)
//   epoch          the 1-based epoch the step belongs to
//   loss           mean training loss of the epoch so far (rank 0's; fashion_mnist's epoch
//                  lines: over all ranks)
//   lr             learning rate of the last step
//   samples_per_s  training samples per second, all ranks, this epoch so far
//   test_accuracy  fraction of the test set classified right (only on an epoch's last line)
//   wall_s         seconds since the log was opened (by this run: a resumed run starts again at 0)
#pragma once

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/file_io.h"
#include "core/file_size_limit.h"
#include "examples/example_utils.h"

namespace nanoddp::examples {

struct MetricsRecord {
  // Optimizer steps since the job's first run began, a resumed checkpoint's counted as its
  // run took them (another world size or batch size takes another number per epoch).
  int64_t step = 0;
  int epoch = 0;
  double loss = NAN;
  double lr = NAN;
  double samples_per_s = NAN;
  double test_accuracy = NAN;
};

// Throws IOError naming path when it is a non-empty file that is not a metrics log (every
// line a JSON object that begins {"step":): a run replaces its own earlier log, never a file
// it did not write. A last line cut short (a run killed mid-write) still counts as ours.
// Only a regular file is read (is_regular_file): a device or a FIFO (/dev/stdout, a pipe to
// a plotter) holds nothing to keep.
inline void check_metrics_replaceable(const std::string& path) {
  std::FILE* file = is_regular_file(path) ? std::fopen(path.c_str(), "r") : nullptr;
  if (file == nullptr) return;  // absent (or unreadable: opening it to write says why)
  static const std::string kStart = "{\"step\":";
  std::string line;  // the current line's first kStart.size() bytes at most
  int line_number = 1;
  bool ours = true;
  for (int c = std::fgetc(file); c != EOF; c = std::fgetc(file)) {
    if (c == '\n') {
      if (line != kStart) {
        ours = false;
        break;
      }
      ++line_number;
      line.clear();
    } else if (line.size() < kStart.size()) {
      line += static_cast<char>(c);
      if (line.size() == kStart.size() && line != kStart) {
        ours = false;
        break;
      }
    }
  }
  // A last line without its newline: a prefix of a line's start is a write cut short.
  if (ours && kStart.compare(0, line.size(), line) != 0) ours = false;
  std::fclose(file);
  for (char& c : line)
    if (!std::isprint(static_cast<unsigned char>(c))) c = '.';  // a binary file's bytes, shown
  NANODDP_CHECK(ours, IOError, "--metrics ", path, ": refusing to replace ", path, ": line ", line_number,
                " is not a metrics line (it begins \"", line, "\"), so this program did not write it; move it away "
                "or name another file");
}

class MetricsLog {
 public:
  // Creates path, replacing a log an earlier run wrote (check_metrics_replaceable). With
  // steps_kept > 0 (a run resumed from a checkpoint taken after that many steps, at an epoch's
  // end or inside one) the lines of steps 1..steps_kept stay and the rest go: those are steps a
  // killed run took past its last checkpoint, which the resumed run takes again. An empty path
  // makes a log that writes nothing. Throws IOError naming the file when it is not a log or
  // cannot be opened.
  explicit MetricsLog(const std::string& path, int64_t steps_kept = 0) : start_(std::chrono::steady_clock::now()) {
    if (path.empty()) return;
    check_metrics_replaceable(path);
    path_ = path;
    const long kept_bytes = steps_kept > 0 && is_regular_file(path) ? bytes_of_steps(path, steps_kept) : 0;
    file_ = std::fopen(path.c_str(), kept_bytes > 0 ? "r+" : "w");
    NANODDP_CHECK(file_ != nullptr, IOError, "--metrics ", path, ": cannot create: ", std::strerror(errno));
    if (kept_bytes > 0) {
      const bool cut = ::ftruncate(::fileno(file_), kept_bytes) == 0 && std::fseek(file_, 0, SEEK_END) == 0;
      const int error = errno;
      if (!cut) std::fclose(file_);
      NANODDP_CHECK(cut, IOError, "--metrics ", path, ": cannot drop the lines past step ", steps_kept, ": ",
                    std::strerror(error));
    }
  }
  ~MetricsLog() {
    if (file_ != nullptr) std::fclose(file_);
  }
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  bool enabled() const { return file_ != nullptr; }

  // Appends one JSON line, written through at once. Throws IOError naming the file when the
  // write fails (a full disk, or `ulimit -f`: Note [File size limit]); the part of the line
  // that got out is cut off again, so the file keeps whole lines only.
  void write(const MetricsRecord& r) {
    if (file_ == nullptr) return;
    const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const std::string line = "{\"step\":" + std::to_string(r.step) + ",\"epoch\":" + std::to_string(r.epoch) +
                             ",\"loss\":" + json_number(r.loss) + ",\"lr\":" + json_number(r.lr) +
                             ",\"samples_per_s\":" + json_number(r.samples_per_s) +
                             ",\"test_accuracy\":" + json_number(r.test_accuracy) +
                             ",\"wall_s\":" + json_number(wall_s) + "}\n";
    const FileSizeSignalHeld held;  // Note [File size limit]: past `ulimit -f`, an IOError
    // Straight to the descriptor, not through stdio: a buffer left after a failed flush would
    // go out at fclose, half a line after the error.
    const int fd = ::fileno(file_);
    const off_t before = ::lseek(fd, 0, SEEK_CUR);
    size_t done = 0;
    int error = 0;
    while (done < line.size()) {
      const ssize_t n = ::write(fd, line.data() + done, line.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        error = n < 0 ? errno : ENOSPC;
        break;
      }
      done += static_cast<size_t>(n);
    }
    if (error != 0 && done > 0 && before >= 0 && ::ftruncate(fd, before) == 0) ::lseek(fd, before, SEEK_SET);
    NANODDP_CHECK(error == 0, IOError, "--metrics ", path_, ": write failed: ", std::strerror(error),
                  file_size_limit_hint(error));
  }

 private:
  // The length of path's leading complete lines whose step is at most steps (0 when it is
  // absent): lines are written in step order, so they are a prefix.
  static long bytes_of_steps(const std::string& path, int64_t steps) {
    std::FILE* file = std::fopen(path.c_str(), "r");
    if (file == nullptr) return 0;
    long kept = 0, at = 0;
    std::string line;
    for (int c = std::fgetc(file); c != EOF; c = std::fgetc(file)) {
      ++at;
      if (c != '\n') {
        line += static_cast<char>(c);
        continue;
      }
      const size_t field = line.find("\"step\":");
      if (field == std::string::npos || std::atoll(line.c_str() + field + 7) > steps) break;
      kept = at;
      line.clear();
    }
    std::fclose(file);
    return kept;
  }

  std::string path_;
  std::FILE* file_ = nullptr;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace nanoddp::examples
