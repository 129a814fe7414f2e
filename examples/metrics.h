// --metrics FILE: a run's training curve as JSON lines, one object per line, flushed as it
// is written (follow it with tail -f; plot it with tools/plot; pandas.read_json(lines=True)
// reads it too). Rank 0 writes; every other rank passes an empty path and writes nothing.
//
//   examples::MetricsLog metrics(rank == 0 ? config.metrics : "");   // throws if unwritable
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
//   wall_s         seconds since the log was opened
#pragma once

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/file_size_limit.h"
#include "examples/example_utils.h"

namespace nanoddp::examples {

struct MetricsRecord {
  int64_t step = 0;
  int epoch = 0;
  double loss = NAN;
  double lr = NAN;
  double samples_per_s = NAN;
  double test_accuracy = NAN;
};

class MetricsLog {
 public:
  // Creates path (truncating it), or with append (a resumed run: steps go on where the
  // file's left off) adds to its end. An empty path makes a log that writes nothing. Throws
  // IOError naming the file when it cannot be opened.
  explicit MetricsLog(const std::string& path, bool append = false) : start_(std::chrono::steady_clock::now()) {
    if (path.empty()) return;
    path_ = path;
    file_ = std::fopen(path.c_str(), append ? "a" : "w");
    NANODDP_CHECK(file_ != nullptr, IOError, "--metrics ", path, ": cannot create: ", std::strerror(errno));
  }
  ~MetricsLog() {
    if (file_ != nullptr) std::fclose(file_);
  }
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  bool enabled() const { return file_ != nullptr; }

  // Appends one JSON line and flushes it. Throws IOError naming the file when the write fails
  // (a full disk, or `ulimit -f`: Note [File size limit]).
  void write(const MetricsRecord& r) {
    if (file_ == nullptr) return;
    const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const FileSizeSignalHeld held;  // Note [File size limit]: past `ulimit -f`, an IOError
    std::fprintf(file_,
                 "{\"step\":%lld,\"epoch\":%d,\"loss\":%s,\"lr\":%s,\"samples_per_s\":%s,\"test_accuracy\":%s,"
                 "\"wall_s\":%s}\n",
                 static_cast<long long>(r.step), r.epoch, json_number(r.loss).c_str(), json_number(r.lr).c_str(),
                 json_number(r.samples_per_s).c_str(), json_number(r.test_accuracy).c_str(),
                 json_number(wall_s).c_str());
    const bool written = std::fflush(file_) == 0 && !std::ferror(file_);
    const int error = errno;
    NANODDP_CHECK(written, IOError, "--metrics ", path_, ": write failed: ", std::strerror(error),
                  file_size_limit_hint(error));
  }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace nanoddp::examples
