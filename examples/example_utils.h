// Small things the examples share: this rank's device, peak memory, a progress display, JSON
// numbers.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include "core/device.h"
#include "dist/init.h"

namespace nanoddp::examples {

// --device as the examples take it: "cuda" means this rank's GPU, cuda:LOCAL_RANK (one GPU
// per rank); anything else is parsed as written ("cpu", "cuda:3").
inline Device rank_device(const std::string& name) {
  return name == "cuda" ? Device::cuda(dist::get_local_rank()) : Device::parse(name);
}

// This process's peak resident set size in MiB (getrusage reports KiB on Linux).
inline double peak_rss_mb() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

// A number as JSON: finite values with enough digits to round-trip a float, else null.
inline std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  std::ostringstream out;
  out.precision(9);
  out << value;
  return out.str();
}

// Rank 0's view of an epoch: on a terminal a bar redrawn in place, elsewhere (a pipe, a log
// file, nanoddp-run's prefixed output) one line per tenth of the epoch.
class Progress {
 public:
  Progress(int epoch, int epochs, int64_t steps, bool enabled)
      : epoch_(epoch), epochs_(epochs), steps_(steps), enabled_(enabled), terminal_(redraw_in_place()) {}

  // A terminal that is ours alone: mpirun hands its ranks a pseudo-terminal but prefixes and
  // interleaves their lines, where a carriage return would only garble the output.
  static bool redraw_in_place() {
    return ::isatty(STDOUT_FILENO) == 1 && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr &&
           std::getenv("PMIX_RANK") == nullptr && std::getenv("SLURM_PROCID") == nullptr;
  }

  void update(int64_t step, double mean_loss) {
    if (!enabled_ || steps_ == 0) return;
    if (terminal_) {
      constexpr int kWidth = 30;
      const int filled = static_cast<int>(kWidth * step / steps_);
      std::printf("\repoch %d/%d [%s%s] %lld/%lld loss %.4f", epoch_, epochs_, std::string(filled, '#').c_str(),
                  std::string(kWidth - filled, '.').c_str(), static_cast<long long>(step),
                  static_cast<long long>(steps_), mean_loss);
      if (step == steps_) std::printf("\n");
      std::fflush(stdout);
      return;
    }
    // Called every few steps: print when a new tenth of the epoch has been reached.
    const int64_t tenth = step * 10 / steps_;
    if (tenth > printed_tenth_) {
      printed_tenth_ = tenth;
      std::printf("epoch %d/%d step %lld/%lld loss %.4f\n", epoch_, epochs_, static_cast<long long>(step),
                  static_cast<long long>(steps_), mean_loss);
      std::fflush(stdout);
    }
  }

 private:
  int epoch_, epochs_;
  int64_t steps_;
  bool enabled_, terminal_;
  int64_t printed_tenth_ = 0;
};

}  // namespace nanoddp::examples
