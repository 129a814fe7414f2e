// Small things the examples share: this rank's device, peak memory, a progress display, JSON
// numbers.
#pragma once

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/trace.h"
#include "dist/init.h"
#include "kernels/device_memory.h"

namespace nanoddp::examples {

// --device as the examples take it: "cuda" means this rank's GPU, cuda:LOCAL_RANK (one GPU
// per rank), wrapping around when there are more ranks on the host than GPUs: ranks then share
// a GPU, which Gloo and MPI allow (they stage CUDA tensors through host memory) and NCCL
// refuses with an error that says so. Anything else is parsed as written ("cpu", "cuda:3").
inline Device rank_device(const std::string& name) {
  if (name != "cuda") return Device::parse(name);
  const int gpus = kernels::cuda::device_count();
  const int local_rank = dist::get_local_rank();
  return Device::cuda(gpus > 0 ? local_rank % gpus : local_rank);
}

// This process's peak resident set size in MiB (getrusage reports KiB on Linux).
// Writes --trace's file (or this rank's part of it) now and stops recording: a write that
// fails throws IOError, so the run exits 1 as for a failed checkpoint, where the write at
// exit (core/trace.h) could only say so on stderr. Nothing is recorded after this, and a
// failed write is not tried again at exit (it would say the same a second time).
inline void finish_trace() {
  try {
    trace::write();
  } catch (...) {
    trace::stop();
    throw;
  }
  trace::stop();
}

inline double peak_rss_mb() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

// The median of values (the mean of the two middle ones for an even count); NaN when empty.
inline double median_of(std::vector<double> values) {
  if (values.empty()) return NAN;
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  if (values.size() % 2 == 1) return *middle;
  return (*middle + *std::max_element(values.begin(), middle)) / 2;
}

// A number as JSON: finite values with enough digits to round-trip a float, else null.
inline std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  std::ostringstream out;
  out.precision(9);
  out << value;
  return out.str();
}

// "1:05" or "1:02:03" for a duration in seconds.
inline std::string clock_text(double seconds) {
  const long long total = std::llround(std::max(seconds, 0.0));
  char text[32];
  if (total >= 3600)
    std::snprintf(text, sizeof(text), "%lld:%02lld:%02lld", total / 3600, total / 60 % 60, total % 60);
  else
    std::snprintf(text, sizeof(text), "%lld:%02lld", total / 60, total % 60);
  return text;
}

// Rank 0's view of an epoch. On a terminal of its own: one line redrawn in place with the
// epoch, a bar, step/steps, the loss, samples/s and the time left for the whole run (ETA:
// this epoch's time per step times the steps left in all epochs; evaluation not counted).
// Elsewhere (a pipe, a log file, nanoddp-run's prefixed output, mpirun): one plain line per
// tenth of the epoch.
class Progress {
 public:
  Progress(int epoch, int epochs, int64_t steps, bool enabled)
      : epoch_(epoch),
        epochs_(epochs),
        steps_(steps),
        enabled_(enabled),
        terminal_(redraw_in_place()),
        start_(std::chrono::steady_clock::now()) {
    if (enabled_ && terminal_) end_line_on_signal();
  }
  ~Progress() { mid_line() = 0; }

  // A terminal that is ours alone: mpirun hands its ranks a pseudo-terminal but prefixes and
  // interleaves their lines, where a carriage return would only garble the output.
  static bool redraw_in_place() {
    return ::isatty(STDOUT_FILENO) == 1 && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr &&
           std::getenv("PMIX_RANK") == nullptr && std::getenv("SLURM_PROCID") == nullptr;
  }

  // step: steps done in this epoch (1..steps); samples_per_s: all ranks' rate this epoch so
  // far, left out of the line when NaN.
  void update(int64_t step, double mean_loss, double samples_per_s = NAN) {
    if (!enabled_ || steps_ == 0) return;
    if (terminal_) {
      draw(step, mean_loss, samples_per_s);
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
  void draw(int64_t step, double mean_loss, double samples_per_s) {
    constexpr int kWidth = 20;
    const int filled = static_cast<int>(kWidth * step / steps_);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const int64_t steps_left = (steps_ - step) + static_cast<int64_t>(epochs_ - epoch_) * steps_;
    std::string rate;
    if (std::isfinite(samples_per_s)) rate = " " + std::to_string(std::llround(samples_per_s)) + " samples/s";
    // \r: back to the line's start; \033[K: erase what a longer previous line left there.
    std::printf("\repoch %d/%d [%s%s] %lld/%lld loss %.4f%s ETA %s\033[K", epoch_, epochs_,
                std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                static_cast<long long>(step), static_cast<long long>(steps_), mean_loss, rate.c_str(),
                clock_text(step > 0 ? elapsed / static_cast<double>(step) * static_cast<double>(steps_left) : 0).c_str());
    if (step == steps_) std::printf("\n");
    std::fflush(stdout);
    mid_line() = step != steps_;
  }

  // Set while the terminal's cursor is after a drawn line.
  static volatile std::sig_atomic_t& mid_line() {
    static volatile std::sig_atomic_t flag = 0;
    return flag;
  }

  // Ctrl-C (or SIGTERM, SIGHUP) in the middle of an epoch: the line is ended first, so the
  // shell's prompt or the error that follows starts on a line of its own; then the signal
  // ends the process as it would have. Only signals left at their default are taken.
  static void end_line_on_signal() {
    static bool installed = false;
    if (installed) return;
    installed = true;
    for (int signal_number : {SIGINT, SIGTERM, SIGHUP}) {
      struct sigaction current {};
      if (::sigaction(signal_number, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) continue;
      struct sigaction ending {};
      ending.sa_handler = [](int received) {
        if (mid_line()) {
          ssize_t ignored = ::write(STDOUT_FILENO, "\n", 1);
          (void)ignored;
        }
        ::signal(received, SIG_DFL);
        ::raise(received);
      };
      sigemptyset(&ending.sa_mask);
      ::sigaction(signal_number, &ending, nullptr);
    }
  }

  int epoch_, epochs_;
  int64_t steps_;
  bool enabled_, terminal_;
  std::chrono::steady_clock::time_point start_;
  int64_t printed_tenth_ = 0;
};

}  // namespace nanoddp::examples
